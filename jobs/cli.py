"""The ``slotq`` command line. ``slotq --help`` and ``slotq COMMAND --help`` explain each command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pydantic import ValidationError

from jobs.settings import Settings

log = logging.getLogger("slotq")


# ---------------------------------------------------------------------- helpers
def _settings(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in {
        "redis_url": getattr(args, "redis_url", None),
        "model": getattr(args, "model", None),
        "slots": getattr(args, "slots", None),
        "ctx": getattr(args, "ctx", None),
    }.items() if v is not None}
    return Settings(**overrides)


@contextlib.asynccontextmanager
async def _client(settings: Settings) -> AsyncIterator[Any]:
    """A client on the configured Redis, or on an embedded one that `slotq redis`/`slotq worker`
    already started; commands that only talk to Redis never start a server of their own."""
    from jobs.client import SlotqClient
    from jobs.redis_server import port_is_serving

    url = settings.redis_url
    if url is None:
        if not port_is_serving(settings.embedded_redis_port):
            raise SystemExit(f"no Redis: set SLOTQ_REDIS_URL, or start one with `slotq redis` "
                             f"(embedded, port {settings.embedded_redis_port})")
        url = f"redis://127.0.0.1:{settings.embedded_redis_port}/0"
    client = await SlotqClient.connect(url, settings)
    try:
        yield client
    finally:
        await client.close()


def _init_sentry() -> None:
    """Report worker errors to Sentry when SENTRY_DSN is set (sentry-sdk reads it itself).
    Prompts and outputs are not sent: job payloads never appear in log messages."""
    import os

    if os.environ.get("SENTRY_DSN"):
        import sentry_sdk

        sentry_sdk.init(send_default_pii=False)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


# ---------------------------------------------------------------------- commands
def cmd_worker(args: argparse.Namespace) -> None:
    from jobs.redis_server import redis_url_or_embedded
    from jobs.worker import SlotqWorker

    settings = _settings(args)
    _init_sentry()

    async def run(url: str) -> None:
        await SlotqWorker(settings, url).run()     # arq binds to the running loop: build it inside

    with redis_url_or_embedded(settings.redis_url, settings.data_dir, settings.embedded_redis_port) as url:
        asyncio.run(run(url))


def cmd_redis(args: argparse.Namespace) -> int:
    import signal
    import threading

    from jobs.redis_server import EmbeddedRedis, EmbeddedRedisError, port_data_dir
    from jobs.watch import describe_returncode, log_tail

    settings = _settings(args)
    port = settings.embedded_redis_port if args.port is None else args.port
    server = EmbeddedRedis(port_data_dir(settings.data_dir, port), port)
    try:
        url = server.start()
    except EmbeddedRedisError as exc:
        print(f"slotq redis: {exc}", file=sys.stderr)
        return 1
    print(f"embedded Redis (Valkey) listening on {url}; data in {server.data_dir}. Ctrl-C to stop.", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):          # also watch the server: if it dies, say so and exit (systemd restarts)
        code = server.exit_code()
        if code is not None:
            print(f"slotq redis: Valkey stopped ({describe_returncode(code)}); last lines of {server.log_path}:\n"
                  f"{log_tail(server.log_path)}", file=sys.stderr)
            server.stop()
            return 1
    server.stop()
    return 0


async def _enqueue(args: argparse.Namespace) -> int:
    from jobs.schemas import JobRequest

    settings = _settings(args)
    try:
        request = JobRequest(prompt=args.prompt, max_tokens=args.max_tokens, stop=args.stop or [],
                             idempotency_key=args.idempotency_key, priority=args.priority,
                             sampling={"temperature": args.temperature, **({"seed": args.seed} if args.seed is not None else {})})
    except ValidationError as exc:
        print(f"invalid request: {exc}", file=sys.stderr)
        return 2
    async with _client(settings) as client:
        job = await client.enqueue(request)
        if not args.json:
            print(job.id, flush=True)
        if args.stream:
            async for text in job.text():
                print(text, end="", flush=True)
            print()
        if args.json:
            result = await job.result(timeout=args.timeout)
            _print_json(result.model_dump(mode="json"))
            return 0 if result.status.value == "succeeded" else 1
    return 0


async def _result(args: argparse.Namespace) -> int:
    async with _client(_settings(args)) as client:
        result = await client.result(args.job_id, timeout=args.timeout)
        _print_json(result.model_dump(mode="json"))
        return 0


async def _cancel(args: argparse.Namespace) -> int:
    async with _client(_settings(args)) as client:
        done = await client.cancel(args.job_id)
        print("cancelled" if done else "not cancelled: the job already finished or does not exist")
        return 0 if done else 1


async def _status(args: argparse.Namespace) -> int:
    async with _client(_settings(args)) as client:
        info = await client.queue_info()
    if args.json:
        _print_json(info.model_dump(mode="json") | {"slots_total": info.slots_total, "slots_busy": info.slots_busy})
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    age = f"{info.oldest_queued_age_s:.1f} s" if info.oldest_queued_age_s is not None else "-"
    console.print(f"queue [bold]{info.queue}[/]: {info.queued} queued (oldest {age}), {info.deferred} deferred, "
                  f"{info.running} running, {info.dead_letters} dead letters")
    table = Table("worker", "model", "slots busy/total", "waiting", "generated tokens")
    for w in info.workers:
        table.add_row(w.id, w.model, f"{w.slots_busy}/{w.slots_total}", str(w.waiting), str(w.generated_tokens))
    console.print(table)
    console.print(f"fleet: {info.slots_busy}/{info.slots_total} slots busy across {len(info.workers)} workers")
    return 0


async def _dlq(args: argparse.Namespace) -> int:
    from jobs import dead_letters

    async with _client(_settings(args)) as client:
        redis = client.redis
        if args.action == "list":
            for job_id in await dead_letters.list_ids(redis):
                letter = await dead_letters.get(redis, job_id)
                if letter:
                    print(f"{job_id}  attempts={letter.attempts}  {letter.error.code}: {letter.error.message}")
        elif args.action == "show":
            letter = await dead_letters.get(redis, args.job_id or "")
            if letter is None:
                print(f"no dead letter {args.job_id}", file=sys.stderr)
                return 1
            _print_json(letter.model_dump(mode="json"))
        elif args.action == "requeue":
            ids = await dead_letters.list_ids(redis) if args.all else [args.job_id]
            for job_id in ids:
                new = await client.requeue_dead_letter(job_id)
                print(f"{job_id} requeued" if new else f"{job_id}: no requeueable payload")
        elif args.action == "purge":
            ids = await dead_letters.list_ids(redis) if args.all or not args.job_id else [args.job_id]
            for job_id in ids:
                await dead_letters.remove(redis, job_id)
            print(f"purged {len(ids)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> None:
    from jobs.demo import run_demo

    asyncio.run(run_demo(_settings(args), n_jobs=args.jobs, max_tokens=args.max_tokens))


def cmd_bench(args: argparse.Namespace) -> None:
    from bench import run_benchmark

    run_benchmark(args.which, as_json=args.json, quick=args.quick)


def _async(fn: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    return lambda args: asyncio.run(fn(args))


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotq",
        description="Serve llama.cpp models behind a durable Redis queue with continuous batching. "
                    "Settings come from SLOTQ_* environment variables or a .env file; with no "
                    "SLOTQ_REDIS_URL an embedded Redis (Valkey) is used, with no SLOTQ_MODEL the "
                    "bundled SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--redis-url", help="Redis URL (overrides SLOTQ_REDIS_URL)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("worker", help="run a worker: load the model, pull as many jobs as it has free slots")
    p.add_argument("--slots", type=int, help="concurrent sequences (SLOTQ_SLOTS, default 8)")
    p.add_argument("--model", help="GGUF file (SLOTQ_MODEL, default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--ctx", type=int, help="per-sequence context in tokens (SLOTQ_CTX, default 4096)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("enqueue", help="enqueue one prompt; prints the job id")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--priority", type=int, default=0, help="-100..100; higher runs first")
    p.add_argument("--idempotency-key", help="the same key always maps to the same job")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--json", action="store_true", help="wait and print the result as one JSON object")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait with --json")
    p.set_defaults(func=_async(_enqueue))

    p = sub.add_parser("result", help="wait for a job's result and print it as JSON")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=600)
    p.set_defaults(func=_async(_result))

    p = sub.add_parser("cancel", help="cancel a queued or running job")
    p.add_argument("job_id")
    p.set_defaults(func=_async(_cancel))

    p = sub.add_parser("status", help="queue depth, workers seen, slots busy/total")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_async(_status))

    p = sub.add_parser("dlq", help="dead letters: jobs that exhausted their tries or could not be read")
    p.add_argument("action", choices=["list", "show", "requeue", "purge"])
    p.add_argument("job_id", nargs="?")
    p.add_argument("--all", action="store_true", help="with requeue/purge: every dead letter")
    p.set_defaults(func=_async(_dlq))

    p = sub.add_parser("redis", help="run the embedded Redis (Valkey) in the foreground for other slotq processes")
    p.add_argument("--port", type=int, help="default SLOTQ_EMBEDDED_REDIS_PORT (6399); data in SLOTQ_DATA_DIR/redis-PORT")
    p.set_defaults(func=cmd_redis)

    p = sub.add_parser("demo", help="zero-config demo: embedded Redis, one worker, a dozen streamed jobs")
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--slots", type=int, default=8)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="benchmarks: engine (batching modes), queue (Redis overhead), prefix (KV reuse)")
    p.add_argument("which", choices=["engine", "queue", "prefix"])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, not for the README)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        level = "DEBUG" if args.verbose else Settings().log_level.upper()
    except ValidationError:
        level = "INFO"   # the command reports the invalid settings itself
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code = args.func(args)
    except ValidationError as exc:
        print(f"invalid settings: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
