"""``slotq bench clients`` (or ``python -m bench.clients_bench``): the real client libraries against slotq
and against llama-server, on the bundled model (issue 45).

Both servers start once (slotq: embedded Redis, a generation worker, an embedding worker, ``slotq gateway``;
llama-server as :mod:`bench.api_shapes` starts it, with ``--jinja``) and every check in
:data:`bench.client_checks.CHECKS` (the calls the gateway's tests make: openai SDK chat and Responses,
the Agents SDK, instructor, pydantic-ai, langchain-openai, litellm, the anthropic SDK) runs against each
with ``base_url`` pointed at it. A check passes or fails with its exception's first line.

llama-server runs with ``--embeddings --pooling mean`` (it refuses ``/v1/embeddings`` without the first,
and a text generator's GGUF declares no pooling), which leaves its chat routes as they are, so one
server answers every check; slotq's embedding worker pools the same way (``SLOTQ_POOLING=auto`` is
``mean`` for this model).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import api_shapes, client_checks, llama_server
from bench.peers_bench import _wait_http
from bench.report import markdown_table, progress, write_results
from slotq.engine import bundled_model_path
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.redis_server import EmbeddedRedis

MODEL = api_shapes.MODEL
EMBED = f"{MODEL}-embed"
SERVERS = api_shapes.SERVERS
PEER_ARGS = ("--embeddings", "--pooling", "mean")     # one llama-server serves chat and embeddings with these


def first_line(exc: BaseException) -> str:
    """``Type: the message's first line`` (an assertion's own text when it has one); for a library that
    wraps its tries' errors (instructor's ``failed_attempts``), the last try's, after the wrapper's name."""
    attempts = getattr(exc, "failed_attempts", None)
    if attempts and isinstance(getattr(attempts[-1], "exception", None), BaseException):
        return f"{type(exc).__name__}, last try: {first_line(attempts[-1].exception)}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def run_checks(server: client_checks.Server) -> list[dict[str, Any]]:
    """Every check against ``server``, in this thread (async ones on a loop of their own)."""
    results = []
    for library, case, check in client_checks.CHECKS:
        progress(f"{server.url} {library}: {case}")
        started = time.perf_counter()
        try:
            outcome = check(server)
            if inspect.isawaitable(outcome):
                asyncio.run(_awaited(outcome))
            error = ""
        except Exception as exc:     # any failure of a client call is the row's answer
            error = first_line(exc)
        results.append({"library": library, "case": case, "passed": not error, "error": error,
                        "seconds": round(time.perf_counter() - started, 2)})
    return results


async def _awaited(outcome: Any) -> None:
    await outcome


async def _measure(urls: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    async with httpx.AsyncClient(timeout=30) as http:
        await _wait_http(http, f"{urls['slotq']}/health",
                         lambda r: r.status_code == 200 and {MODEL, EMBED} <= set(r.json().get("models", {})))
        if "llama-server" in urls:
            await _wait_http(http, f"{urls['llama-server']}/health", lambda r: r.status_code == 200)
    return {name: await asyncio.to_thread(run_checks, client_checks.Server(url, MODEL, EMBED))
            for name, url in urls.items()}


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    """Both servers, every check once (``quick`` changes nothing but that the results are not written)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")      # else litellm fetches a price list online
    model = bundled_model_path()
    skipped: dict[str, str] = {}
    try:
        binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        binary, skipped["llama-server"] = None, str(exc)
        progress(f"skipping llama-server: {exc}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slotq-bench-clients-") as tmp_name:
        tmp = Path(tmp_name)
        redis = EmbeddedRedis(tmp / "redis")
        url = redis.start()
        children, urls = api_shapes._children(tmp, url, model, binary, PEER_ARGS)
        children.append(ChildProcess("slotq embedding worker", [sys.executable, "-m", "slotq.jobs.cli", "worker"], env={
            **os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_MODEL_NAME": EMBED,
            "SLOTQ_QUEUE_NAME": "slotq:embed", "SLOTQ_EMBEDDINGS": "true", "SLOTQ_CTX": "512", "SLOTQ_BATCH": "512",
            "SLOTQ_SLOTS": "2", "SLOTQ_THREADS": str(api_shapes.THREADS), "SLOTQ_LOG_LEVEL": "WARNING"},
            log_path=tmp / "embedder.log"))
        try:
            results = await run_watched(_measure(urls), *children)
        finally:
            for child in children:
                child.stop()
            redis.stop()
    data = {"model": model.name, "seconds": round(time.perf_counter() - started, 1), "results": results,
            "totals": totals(results), "skipped": skipped,
            "llama_server_args": [*PEER_ARGS]}
    text = table(results, skipped)
    if not quick:
        write_results("clients", data, text, "slotq bench clients")
    return data, text


def totals(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, int]]:
    return {name: {"pass": sum(r["passed"] for r in rows), "fail": sum(not r["passed"] for r in rows)}
            for name, rows in results.items()}


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    return "pass" if row["passed"] else "FAIL: " + row["error"].replace("|", "\\|").replace("\n", " ")


def table(results: dict[str, list[dict[str, Any]]], skipped: dict[str, str]) -> str:
    names = [name for name in SERVERS if name in results]
    by_server = {name: {(r["library"], r["case"]): r for r in results[name]} for name in names}
    rows = [[library, case, *(_cell(by_server[name].get((library, case))) for name in names)]
            for library, case, _ in client_checks.CHECKS]
    counted = totals(results)
    rows.append(["**total**", "", *(f"**{counted[n]['pass']} pass / {counted[n]['fail']} fail**" for n in names)])
    out = [("Each client library called as its documentation shows, `base_url` at each server, the bundled "
            "model on both (a forced call must name the function with schema-valid arguments; a free turn after "
            "the tool's output must answer in text). A failure shows its exception's first line."), "",
           markdown_table(["library", "case", *names], rows), "",
           f"llama-server ran with `--jinja {' '.join(PEER_ARGS)}` (one server for chat and embeddings)."]
    out += [f"\nSkipped {name}: {why}" for name, why in skipped.items()]
    return "\n".join(out)


if __name__ == "__main__":
    from bench import run_benchmark

    run_benchmark("clients", quick="--quick" in sys.argv[1:])
