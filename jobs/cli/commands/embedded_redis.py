"""``slotq redis``: the embedded Redis (Valkey) in the foreground, for other slotq processes to share."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from slotq.jobs.settings import ClientSettings, from_command_line


def cmd_redis(args: argparse.Namespace) -> int:
    from slotq.jobs.child_processes import describe_returncode, log_tail
    from slotq.jobs.redis_server import EmbeddedRedis, EmbeddedRedisError, port_data_dir

    settings = from_command_line(ClientSettings, args, None)
    port = settings.embedded_redis_port if args.port is None else args.port
    server = EmbeddedRedis(port_data_dir(settings.data_dir, port), port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):     # before the line that says it serves: a stop sent on it is kept
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = server.start()
    except EmbeddedRedisError as exc:
        print(f"slotq redis: {exc}", file=sys.stderr)
        return 1
    print(f"embedded Redis (Valkey) listening on {url}; data in {server.data_dir}. Ctrl-C to stop.", flush=True)
    while not stop.wait(0.5):          # also watch the server: if it dies, say so and exit (systemd restarts)
        code = server.exit_code()
        if code is not None:
            print(f"slotq redis: Valkey stopped ({describe_returncode(code)}); last lines of {server.log_path}:\n"
                  f"{log_tail(server.log_path)}", file=sys.stderr)
            server.stop()
            return 1
    server.stop()
    return 0
