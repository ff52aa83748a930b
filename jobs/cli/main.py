"""The ``slotq`` command line. ``slotq --help`` and ``slotq COMMAND --help`` explain each command.

Settings flags (``--slots``, ``--queue-name``, ...) are generated from the settings classes, so each
command accepts exactly the settings it uses, with the same bounds and the same names as the
``SLOTQ_*`` environment variables. Errors a user can fix are printed as one line, with a non-zero
exit code: 1 for a failed job or a slotq error (Redis unreachable, no such job, queue full), 2 for
invalid input or settings, 130 when Ctrl-C or SIGTERM interrupted the command, 141 when the reader of
its output went away (``slotq result ID | head -5``), which ends the command quietly as Unix tools do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from slotq.jobs.errors import JobTimeout, SlotqError
from slotq.jobs.settings import ClientSettings, add_settings_flags, from_command_line
from slotq.jobs.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from slotq.jobs.producer.client import JobHandle

log = logging.getLogger("slotq")

EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_TIMED_OUT = 124       # what coreutils' `timeout` reports for a command that ran out of time
EXIT_INTERRUPTED = 130     # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141     # 128 + SIGPIPE, what a shell reports for `yes | head -1`'s yes


# ---------------------------------------------------------------------- helpers
def _client_settings(args: argparse.Namespace) -> ClientSettings:
    return from_command_line(ClientSettings, args, args.settings_source)


def _worker_settings(args: argparse.Namespace) -> WorkerSettings:
    return from_command_line(WorkerSettings, args, args.settings_source)


@contextlib.asynccontextmanager
async def _client(settings: ClientSettings) -> AsyncIterator[Any]:
    """A client on the configured Redis, or on an embedded one that `slotq redis`/`slotq worker`
    started (waited for a while, as a worker started just before may still be starting it); commands
    that only talk to Redis never start a server of their own."""
    from slotq.jobs.producer.client import SlotqClient
    from slotq.jobs.redis_server import running_embedded_url

    url = settings.redis_url
    if url is None:
        url = running_embedded_url(settings.embedded_redis_port)
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


def _describe(exc: ValidationError) -> str:
    """One line per problem, naming the field: ``slots: Input should be ... (got '0')``."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or exc.title
        shows_input = err.get("type") != "missing" and not isinstance(err.get("input"), dict)
        got = f" (got {err['input']!r})" if shows_input else ""
        lines.append(f"{where}: {err['msg']}{got}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- commands
def cmd_worker(args: argparse.Namespace) -> int:
    """Exit code 0 after a drain; 70 when the engine died (its supervisor should restart it)."""
    from slotq.jobs.redis_server import redis_url_or_embedded
    from slotq.jobs.worker.worker import SlotqWorker

    settings = _worker_settings(args)
    _init_sentry()

    async def run(url: str) -> int:
        return await SlotqWorker(settings, url).run()     # arq binds to the running loop: build it inside

    with redis_url_or_embedded(settings.redis_url, settings.data_dir, settings.embedded_redis_port) as url:
        return asyncio.run(run(url))


def cmd_gateway(args: argparse.Namespace) -> None:
    from slotq.jobs.gateway.server import serve
    from slotq.jobs.gateway.settings import GatewaySettings

    serve(from_command_line(GatewaySettings, args, args.settings_source))


def cmd_redis(args: argparse.Namespace) -> int:
    import signal
    import threading

    from slotq.jobs.child_processes import describe_returncode, log_tail
    from slotq.jobs.redis_server import EmbeddedRedis, EmbeddedRedisError, port_data_dir

    settings = from_command_line(ClientSettings, args, None)
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
    from slotq.jobs.protocol.schemas import JobRequest

    settings = _client_settings(args)
    text: dict[str, Any]
    if args.raw:
        text = {"prompt": args.text}
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        text = {"messages": [*system, {"role": "user", "content": args.text}]}
    try:
        seed = {"seed": args.seed} if args.seed is not None else {}
        request = JobRequest(**text, max_tokens=args.max_tokens, stop=args.stop or [], ignore_eos=args.ignore_eos,
                             idempotency_key=args.idempotency_key, priority=args.priority, lane=args.lane,
                             sampling={"temperature": args.temperature, **seed})
    except ValidationError as exc:
        print(f"invalid request:\n{_describe(exc)}", file=sys.stderr)
        return EXIT_INVALID
    waits = args.stream or args.json
    async with _client(settings) as client:
        interrupted = asyncio.Event()
        _stop_on_interrupt(interrupted.set)     # before the enqueue: no Ctrl-C slips in between it and the wait
        job = await client.enqueue(request)
        # The id comes first, so whoever interrupts the wait can still follow or cancel the job. It is
        # stdout's only line when it is the command's whole output; with --stream stdout is the text and
        # with --json one JSON object, so there it goes to stderr.
        print(job.id, file=sys.stderr if waits else sys.stdout, flush=True)
        if waits:
            try:
                code = await _until_interrupted(_wait_for(job, args), interrupted)
            except BrokenPipeError:     # stdout's reader left (`| head`): the job should not outlive it either
                await _let_go(job, detach=args.detach, why="the reader of the output went away")
                raise
            except JobTimeout:          # the caller's wait is over, as with Ctrl-C: its job goes with it
                await _let_go(job, detach=args.detach, why=f"no result within --timeout {args.timeout:g} s")
                return EXIT_TIMED_OUT
            if code is not None:
                return code
        elif not interrupted.is_set():
            return 0
        await _let_go(job, detach=args.detach, why="interrupted")
        return EXIT_INTERRUPTED


async def _wait_for(job: JobHandle, args: argparse.Namespace) -> int:
    """``enqueue --stream`` prints the text as it comes, ``--json`` the result; the exit code is 1 when
    the job did not succeed (known with --json only, as --stream prints nothing but the text)."""
    if args.stream:
        try:
            async for chunk in job.text():
                print(chunk, end="", flush=True)
        finally:
            print()     # end the text's line, also when interrupted, before anything goes to stderr
    if args.json:
        result = await job.result(timeout=args.timeout)
        _print_json(result.model_dump(mode="json"))
        return 0 if result.status.value == "succeeded" else EXIT_FAILED
    return 0


async def _until_interrupted(work: Awaitable[int], interrupted: asyncio.Event) -> int | None:
    """``work``'s exit code, or None when ``interrupted`` is set first (``work`` is then cancelled)."""
    working = asyncio.ensure_future(work)
    waiting = asyncio.create_task(interrupted.wait())
    try:
        await asyncio.wait({working, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if working.done():
        return working.result()
    working.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await working
    return None


async def _let_go(job: JobHandle, *, detach: bool, why: str) -> None:
    """What becomes of the job when its command stops waiting early: the command's caller is gone, so
    the job it created is cancelled, unless --detach asked to keep it. A job the command only
    attached to (its --idempotency-key matched an existing job) belongs to whoever created it, and
    keeps running. Either way stderr says what happened and how to reach the job."""
    if detach or not job.created:
        because = "--detach" if detach else "--idempotency-key matched a job this command did not create"
        print(f"{why}; job {job.id} keeps running ({because}): `slotq result {job.id}` waits for it, "
              f"`slotq cancel {job.id}` cancels it", file=sys.stderr)
    elif await job.cancel():
        print(f"{why}; job {job.id} cancelled", file=sys.stderr)
    else:
        print(f"{why}; job {job.id} had already finished: `slotq result {job.id}` shows it", file=sys.stderr)


async def _result(args: argparse.Namespace) -> int:
    async with _client(_client_settings(args)) as client:
        result = await client.result(args.job_id, timeout=args.timeout)
        _print_json(result.model_dump(mode="json"))
        return 0


async def _cancel(args: argparse.Namespace) -> int:
    async with _client(_client_settings(args)) as client:
        done = await client.cancel(args.job_id)
        print("cancelled" if done else "not cancelled: the job already finished or does not exist")
        return 0 if done else EXIT_FAILED


def _stop_on_interrupt(stop: Callable[[], None]) -> None:
    """The first Ctrl-C (or SIGTERM) calls ``stop`` and the command ends cleanly; a second one is
    a plain KeyboardInterrupt."""
    loop = asyncio.get_running_loop()

    def first() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first)


async def _status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from slotq.jobs.cli.status_view import render, watch

    async with _client(_client_settings(args)) as client:
        if args.watch:
            stop = asyncio.Event()
            _stop_on_interrupt(stop.set)
            await watch(client.queue_info, interval_s=args.interval, stop=stop)
            return EXIT_INTERRUPTED
        info = await client.queue_info()
    if args.json:
        _print_json(info.model_dump(mode="json"))
        return 0
    Console().print(render(info))
    return 0


NO_DEAD_LETTERS = "no dead-lettered jobs"


def _no_dead_letter(job_id: str) -> int:
    """Say that ``job_id`` is not a dead letter; the exit code for it."""
    print(f"no dead letter {job_id} (`slotq dlq list` lists them)", file=sys.stderr)
    return EXIT_FAILED


async def _dlq(args: argparse.Namespace) -> int:
    """Exit code 1 when a named job is not a dead letter, or one could not be requeued: a script that
    requeues or purges learns that it did not happen. Notes (no dead letters) go to stderr, so stdout
    holds only the listing or the records."""
    from slotq.jobs.protocol import dead_letters

    if (args.action == "show" and not args.job_id) or (args.action == "requeue" and not (args.job_id or args.all)):
        print(f"slotq dlq {args.action}: give a job id{' or --all' if args.action == 'requeue' else ''}",
              file=sys.stderr)
        return EXIT_INVALID
    async with _client(_client_settings(args)) as client:
        redis = client.redis
        if args.action == "show":
            letter = await dead_letters.get(redis, args.job_id)
            if letter is None:
                return _no_dead_letter(args.job_id)
            _print_json(letter.model_dump(mode="json"))
            return 0
        named = bool(args.job_id) and not args.all and args.action != "list"
        ids = [args.job_id] if named else await dead_letters.list_ids(redis)
        if not ids:
            print(NO_DEAD_LETTERS, file=sys.stderr)
            return 0
        code = 0
        if args.action == "list":
            for job_id in ids:
                letter = await dead_letters.get(redis, job_id)
                if letter:
                    deaths = f" worker_deaths={letter.worker_deaths}" if letter.worker_deaths else ""
                    print(f"{job_id}  attempts={letter.attempts} (interrupted={letter.interruptions}){deaths}  "
                          f"{letter.reason}: {letter.error.message}")
        elif args.action == "requeue":
            for job_id in ids:
                if await dead_letters.get(redis, job_id) is None:
                    code = _no_dead_letter(job_id)
                elif await client.requeue_dead_letter(job_id):
                    print(f"{job_id} requeued")
                else:
                    print(f"{job_id}: no requeueable payload (`slotq dlq show {job_id}`)", file=sys.stderr)
                    code = EXIT_FAILED
        elif args.action == "purge":
            purged = [job_id for job_id in ids if await dead_letters.remove(redis, job_id)]
            print(f"purged {len(purged)}")
            if named and not purged:
                code = _no_dead_letter(args.job_id)
    return code


async def _bulk(args: argparse.Namespace) -> int:
    """Exit code 0: every line has its output; 1: some lines are in the errors file; 130: interrupted."""
    from slotq.jobs.bulk import BulkOptions, open_bulk
    from slotq.jobs.bulk.progress import RichProgress, summary_table

    options = BulkOptions(window=args.window, lane=args.lane)
    async with _client(_client_settings(args)) as client, open_bulk(
            client, args.input, args.output, errors=args.errors, options=options,
            observer=None if args.quiet or args.json else RichProgress()) as run:
        _stop_on_interrupt(run.stop)
        summary = await run.run()
    if args.json:
        _print_json(summary.model_dump(mode="json"))
    elif not args.quiet:
        from rich.console import Console

        Console().print(summary_table(summary))
    return EXIT_INTERRUPTED if summary.interrupted else 0 if summary.all_succeeded else EXIT_FAILED


def cmd_demo(args: argparse.Namespace) -> None:
    from slotq.jobs.cli.demo import run_demo

    asyncio.run(run_demo(_worker_settings(args), n_jobs=args.jobs, max_tokens=args.max_tokens, tools=args.tools))


def cmd_bench(args: argparse.Namespace) -> None:
    options = {name: getattr(args, name) for name in SPEC_BENCH_OPTIONS if getattr(args, name) is not None}
    if options and args.which != "spec":
        flags = ", ".join("--" + name.replace("_", "-") for name in options)
        raise SystemExit(f"slotq bench {args.which}: {flags} apply to `slotq bench spec` only")
    if args.draft_model is not None and not args.draft_model.is_file():
        raise SystemExit(f"slotq bench spec: --draft-model: no such file: {args.draft_model}")
    run_benchmark = _checkout_benchmarks()
    run_benchmark(args.which, as_json=args.json == "-", quick=args.quick,
                  json_path=Path(args.json) if args.json not in (None, "-") else None, options=options)


SPEC_BENCH_OPTIONS = ("concurrency", "rounds", "draft_model")


def _client_counts(text: str) -> list[int]:
    """``--concurrency 1,4,16``: positive client counts."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected client counts such as 1,4,16, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be >= 1, got {text!r}")
    return counts


def _checkout_benchmarks() -> Callable[..., None]:
    """bench/ is not in the wheel (producers don't need it), so ``slotq bench`` runs from a checkout:
    an editable install (``make install``) maps ``slotq.jobs`` to the checkout's jobs/, next to bench/."""
    import slotq.jobs

    checkout = Path(slotq.jobs.__file__).resolve().parents[1]
    if not (checkout / "bench" / "__init__.py").is_file():
        raise SystemExit("slotq bench: the benchmarks are not installed with slotq; run them from a checkout of the "
                         "slotq repository (git clone, then `make bench` or `.venv/bin/slotq bench ...` there)")
    if str(checkout) not in sys.path:
        sys.path.append(str(checkout))
    from bench import run_benchmark

    return run_benchmark


def _async(fn: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    return lambda args: asyncio.run(fn(args))


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotq",
        description="Serve llama.cpp models behind a durable Redis queue with continuous batching. "
                    "Settings come from flags, SLOTQ_* environment variables or ./.env; with no "
                    "SLOTQ_REDIS_URL an embedded Redis (Valkey) is used, with no SLOTQ_MODEL the "
                    "bundled SmolLM2-135M-Instruct.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, settings_cls: type[ClientSettings] | None = ClientSettings,
                **kwargs: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, **kwargs)
        p.set_defaults(settings_source=add_settings_flags(p, settings_cls) if settings_cls else None)
        return p

    p = command("worker", "run a worker: load the model, pull as many jobs as it has free slots", WorkerSettings)
    p.set_defaults(func=cmd_worker)

    from slotq.jobs.gateway.settings import GatewaySettings

    p = command("gateway", "HTTP gateway: OpenAI-compatible API, background jobs, dashboard at /", GatewaySettings)
    p.add_argument("--host", dest="gateway_host", default=argparse.SUPPRESS, help="short for --gateway-host")
    p.add_argument("--port", dest="gateway_port", default=argparse.SUPPRESS, help="short for --gateway-port")
    p.set_defaults(func=cmd_gateway)

    p = command("enqueue", "enqueue one job and print its id; with --stream or --json wait for it (the id then "
                           "goes first, to stderr), and Ctrl-C or SIGTERM cancels the job unless --detach")
    p.add_argument("text", help="the user's message (the model's chat template applies), or with --raw a raw prompt")
    p.add_argument("--raw", action="store_true",
                   help="send TEXT as a plain completion prompt, without the chat template")
    p.add_argument("--system", help="a system message before TEXT (not with --raw)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-tokens tokens, past end-of-sequence")
    p.add_argument("--priority", type=int, default=0, help="-100..100; higher is admitted first inside a worker")
    p.add_argument("--lane", default="interactive", help="priority lane of the queue (SLOTQ_LANES), e.g. bulk")
    p.add_argument("--idempotency-key", help="the same key always maps to the same job; when it matches an "
                                             "existing job, Ctrl-C leaves that job running")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (stdout: the text only)")
    p.add_argument("--json", action="store_true", help="wait and print the result as one JSON object")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds to wait with --json; then the job is cancelled (kept with --detach) and the "
                        "exit code is 124")
    p.add_argument("--detach", action="store_true", help="with --stream or --json: Ctrl-C, SIGTERM or --timeout "
                                                         "stops the waiting but leaves the job running (`slotq "
                                                         "result ID` waits again, `slotq cancel ID` cancels it)")
    p.set_defaults(func=_async(_enqueue))

    p = command("result", "wait for a job's result and print it as JSON")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=600)
    p.set_defaults(func=_async(_result))

    p = command("cancel", "cancel a queued or running job")
    p.add_argument("job_id")
    p.set_defaults(func=_async(_cancel))

    p = command("status", "queue depth and oldest wait per lane; workers: state, busy/active/max slots, KV, "
                          "tokens/s, drafts kept (speculative decoding), memory, degradation")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true", help="a live view, refreshed in place until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.set_defaults(func=_async(_status))

    p = command("dlq", "dead letters: jobs that exhausted their tries or could not be read; exit code 1 when "
                       "a named job is not one")
    p.add_argument("action", choices=["list", "show", "requeue", "purge"])
    p.add_argument("job_id", nargs="?", help="the dead letter to show, requeue or purge")
    p.add_argument("--all", action="store_true", help="with requeue/purge: every dead letter")
    p.set_defaults(func=_async(_dlq))

    p = command("bulk", "run a JSONL file of requests (slotq or OpenAI Batch lines) through the queue, resumably")
    p.add_argument("input", help="JSONL input, gzip-compressed or not; - reads stdin")
    p.add_argument("-o", "--output", required=True, help="JSONL output; running again resumes into it")
    p.add_argument("--errors", help="failed lines (default: OUTPUT with .errors.jsonl)")
    p.add_argument("--window", type=int, default=256, help="lines in Redis at once (keep above the fleet's slots)")
    p.add_argument("--lane", default="bulk", help="queue lane of the lines (SLOTQ_LANES)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary; the exit code tells")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=_async(_bulk))

    p = command("redis", "run the embedded Redis (Valkey) in the foreground for other slotq processes", None)
    p.add_argument("--port", type=int,
                   help="default SLOTQ_EMBEDDED_REDIS_PORT (6399); data in SLOTQ_DATA_DIR/redis-PORT")
    p.set_defaults(func=cmd_redis)

    p = command("demo", "zero-config demo: embedded Redis, one worker, a dozen jobs arriving at once, streamed as "
                        "they are batched, then the same jobs one at a time for comparison", WorkerSettings)
    p.add_argument("--jobs", type=int, default=12, help="jobs in the burst")
    p.add_argument("--max-tokens", type=int, default=48, help="max tokens per job (with --tools: per answer)")
    p.add_argument("--tools", action="store_true",
                   help="the tool-call demo instead: questions the model answers by calling a tool (forced, "
                        "schema-valid calls streamed), the results sent back, then the answers")
    p.set_defaults(func=cmd_demo)

    p = command("bench", "benchmarks: engine (batching modes), queue (Redis overhead), prefix (KV reuse), "
                         "gateway (HTTP overhead), gateway-batch (chat TTFT while the gateway writes a 100 MB "
                         "batch output), fleet (the claim path at 100 to 10,000 simulated slots), "
                         "bulk (bulk runs beside interactive jobs), peers (slotq beside llama-server and "
                         "llama-cpp-python's server), overhead (many streams on a tiny model: slotq beside "
                         "llama-server in both KV layouts), constraints (what one JSON schema costs its "
                         "batch: llguidance beside llama.cpp's grammar sampler), "
                         "logprobs (what one logprobs stream costs the 7 plain ones beside it), embeddings (tokens/s "
                         "of embedding requests through Redis beside llama-server --embeddings), spec (speculative "
                         "decoding: slotq with and without it beside llama-server's draft modes)", None)
    p.add_argument("which", choices=["engine", "queue", "prefix", "gateway", "gateway-batch", "fleet", "bulk", "peers",
                                     "overhead", "constraints", "logprobs", "embeddings", "spec"])
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="print one JSON object instead of a table; with PATH, write it there and print the table")
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, not for the README)")
    p.add_argument("--concurrency", type=_client_counts, metavar="N,N,...",
                   help="spec only: client counts to measure (default 1,4,16; 1 with --quick)")
    p.add_argument("--rounds", type=int, choices=range(1, 11), metavar="1..10",
                   help="spec only: rounds over every row (default 2; 1 with --quick)")
    p.add_argument("--draft-model", type=Path, metavar="PATH",
                   help="spec only: a small GGUF with the bundled model's vocabulary; adds the draft-model rows "
                        "(SLOTQ_SPEC=draft, llama-server --model-draft)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        level = "DEBUG" if args.verbose else (getattr(args, "log_level", None)
                                              or from_command_line(ClientSettings, args, None).log_level).upper()
    except ValidationError:
        level = "INFO"   # the command reports the invalid settings itself
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code = args.func(args)
        sys.stdout.flush()      # here, so that a reader gone before the last buffered write ends as below
    except BrokenPipeError:
        # The reader of stdout left (`slotq result ID | head -5`): stop quietly, as Unix tools do, with the
        # status a shell reports for them. stdout now points at /dev/null, so the flush at exit cannot fail
        # again and print "Exception ignored ... BrokenPipeError".
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_BROKEN_PIPE
    except ValidationError as exc:
        print(f"invalid settings:\n{_describe(exc)}", file=sys.stderr)
        code = EXIT_INVALID
    except SlotqError as exc:
        print(f"slotq: {exc}", file=sys.stderr)
        code = EXIT_INVALID if isinstance(exc, ValueError) else EXIT_FAILED
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
