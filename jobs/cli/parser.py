"""The ``slotq`` argument tree: every command, its flags and its help text, each bound to the function
in :mod:`slotq.jobs.cli.commands` that runs it.

Settings flags (``--slots``, ``--queue-name``, ...) are generated from the settings classes, so each
command accepts exactly the settings it uses, with the same bounds and the same names as the
``SLOTQ_*`` environment variables.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from slotq.jobs.cli.commands.bench import client_counts, cmd_bench, primary_counts
from slotq.jobs.cli.commands.bulk import cmd_bulk
from slotq.jobs.cli.commands.demo import cmd_demo
from slotq.jobs.cli.commands.dlq import cmd_dlq
from slotq.jobs.cli.commands.embedded_redis import cmd_redis
from slotq.jobs.cli.commands.gateway import cmd_gateway
from slotq.jobs.cli.commands.jobs import cmd_cancel, cmd_enqueue, cmd_result
from slotq.jobs.cli.commands.status import cmd_status
from slotq.jobs.cli.commands.worker import cmd_worker
from slotq.jobs.protocol.keys import MAX_QUEUE_PARTITIONS
from slotq.jobs.settings import ClientSettings, add_settings_flags
from slotq.jobs.worker.settings import WorkerSettings


def _async(command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
           ) -> Callable[[argparse.Namespace], int]:
    """A command that awaits, as one that runs: its own event loop for the whole command."""
    return lambda args: asyncio.run(command(args))


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
    p.set_defaults(func=_async(cmd_enqueue))

    p = command("result", "wait for a job's result and print it as JSON")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=600)
    p.set_defaults(func=_async(cmd_result))

    p = command("cancel", "cancel a queued or running job")
    p.add_argument("job_id")
    p.set_defaults(func=_async(cmd_cancel))

    p = command("status", "queue depth and oldest wait per lane; workers: state, busy/active/max slots, KV, "
                          "tokens/s, drafts kept (speculative decoding), memory, degradation; on a cluster, each "
                          "shard's load")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true", help="a live view, refreshed in place until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.set_defaults(func=_async(cmd_status))

    p = command("dlq", "dead letters: jobs that exhausted their tries or could not be read; exit code 1 when "
                       "a named job is not one")
    p.add_argument("action", choices=["list", "show", "requeue", "purge"])
    p.add_argument("job_id", nargs="?", help="the dead letter to show, requeue or purge")
    p.add_argument("--all", action="store_true", help="with requeue/purge: every dead letter")
    p.set_defaults(func=_async(cmd_dlq))

    p = command("bulk", "run a JSONL file of requests (slotq or OpenAI Batch lines) through the queue, resumably")
    p.add_argument("input", help="JSONL input, gzip-compressed or not; - reads stdin")
    p.add_argument("-o", "--output", required=True, help="JSONL output; running again resumes into it")
    p.add_argument("--errors", help="failed lines (default: OUTPUT with .errors.jsonl)")
    p.add_argument("--window", type=int, default=256, help="lines in Redis at once (keep above the fleet's slots)")
    p.add_argument("--lane", default="bulk", help="queue lane of the lines (SLOTQ_LANES)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary; the exit code tells")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=_async(cmd_bulk))

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

    p = command("bench", "benchmarks: api-shapes (every API route's JSON and event shapes beside llama-server's "
                         "and the official SDKs' types), clients (the real client libraries' calls, pass/fail "
                         "against slotq and llama-server), engine (batching modes), queue (Redis overhead), prefix "
                         "(KV reuse), gateway (HTTP overhead), gateway-batch (chat TTFT while the gateway writes a "
                         "100 MB batch output), fleet (the claim path at 100 to 10,000 simulated slots), "
                         "bulk (bulk runs beside interactive jobs), peers (slotq beside llama-server and "
                         "llama-cpp-python's server), overhead (many streams on a tiny model: slotq beside "
                         "llama-server in both KV layouts), constraints (what one JSON schema costs its "
                         "batch: llguidance beside llama.cpp's grammar sampler), "
                         "logprobs (what one logprobs stream costs the 7 plain ones beside it), embeddings (tokens/s "
                         "of embedding requests through Redis beside llama-server --embeddings), rerank (the same "
                         "scores and pairs/s beside llama-server --rerank), spec (speculative "
                         "decoding: slotq with and without it beside llama-server's draft modes), step-costs "
                         "(the engine thread's per-step Python at 64 and 256 sequences, before and after batching "
                         "it), on-demand (a job for a model no worker has loaded: first token beside the model's "
                         "load time), lora (a load half on a LoRA adapter beside the same load without one, beside "
                         "llama-server --lora)", None)
    p.add_argument("which", choices=["api-shapes", "clients", "engine", "queue", "prefix", "gateway", "gateway-batch",
                                     "fleet", "bulk", "peers", "overhead", "constraints", "logprobs", "embeddings",
                                     "rerank", "spec", "step-costs", "on-demand", "lora"])
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="print one JSON object instead of a table; with PATH, write it there and print the table")
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, not for the README)")
    p.add_argument("--concurrency", type=client_counts, metavar="N,N,...",
                   help="spec only: client counts to measure (default 1,4,16; 1 with --quick)")
    p.add_argument("--rounds", type=int, choices=range(1, 11), metavar="1..10",
                   help="spec only: rounds over every row (default 2; 1 with --quick)")
    p.add_argument("--draft-model", type=Path, metavar="PATH",
                   help="spec only: a small GGUF with the bundled model's vocabulary; adds the draft-model rows "
                        "(SLOTQ_SPEC=draft, llama-server --model-draft)")
    p.add_argument("--cluster", type=primary_counts, metavar="N,N,...",
                   help="fleet only: instead of the whole benchmark, its streaming steps (a GPU's pace, 10 and "
                        "100 ms flush) on one Valkey and on a local Valkey Cluster of each N primaries, side by "
                        "side; capacity = busy slots per core of the hottest primary, and its ratio to one "
                        "Valkey's (writes bench/results/fleet-cluster.md)")
    p.add_argument("--models", type=int, choices=range(1, 49), metavar="1..48",
                   help="fleet --cluster only: the same load spread over this many models' queues, each landing "
                        "on its own primary while there are primaries enough (writes "
                        "bench/results/fleet-cluster-M-models.md)")
    p.add_argument("--partitions", type=int, choices=range(1, MAX_QUEUE_PARTITIONS + 1),
                   metavar=f"1..{MAX_QUEUE_PARTITIONS}",
                   help="fleet --cluster only: each queue split into this many partitions (SLOTQ_QUEUE_PARTITIONS), "
                        "their hash slots one per primary when there are as many; the one-Valkey baseline too "
                        "(writes bench/results/fleet-cluster-P-partitions.md)")
    p.set_defaults(func=cmd_bench)
    return parser
