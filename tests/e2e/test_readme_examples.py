"""The docs' Python examples run as written, so they cannot drift from the code.

The ```python blocks of README.md's "Using it from a web app" and of docs/bulk.md's Python API are
read from the files (not copied here) and run against a real Redis and a real ``slotq worker`` on
the tiny model, each in a child process of the checkout's Python (so ``from slotq import ...`` is
the installed import path, not the repository's folders); so are docs/gateway.md's blocks that
make their own OpenAI client, against a real ``slotq gateway``. The only change made to them is
the address: the examples use the embedded server's ``redis://localhost:6399/0`` and the gateway's
``http://127.0.0.1:8000``, the test its own servers. Blocks with a top-level ``await`` run in order
in one ``async def main()`` (they share one namespace, as a reader's session would); each blocking
block runs on its own.

Every Python block of README.md and docs/*.md must also compile and import only names that exist,
and name no Redis URL but the embedded server's.
"""

from __future__ import annotations

import ast
import asyncio
import gzip
import inspect
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.redis_server import EmbeddedRedis
from tests.support import REPO_ROOT
from tests.support.gateway import Stack
from tests.support.jobs import WorkerProcess, clean_env, emptied, wait_for_workers

EXAMPLE_URL = "redis://localhost:6399/0"      # the embedded server a `slotq worker` starts: what the docs use
EXAMPLE_GATEWAY = "http://127.0.0.1:8000"     # `slotq gateway`'s default address
EXAMPLE_WEBHOOK = "https://hooks.example.com/"  # docs/gateway.md's webhook receiver: a name no offline machine resolves
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
WORKER = "docs-examples"
# a hang guard, not a timed assertion: the examples' own result(timeout=60) fail long before it
SCRIPT_LIMIT_S = 240


def section(path: Path, heading: str) -> str:
    """The text of the ``## heading`` section of ``path`` (its subsections included)."""
    text = path.read_text()
    start = re.search(rf"^## {re.escape(heading)}\n", text, re.MULTILINE)
    assert start, f"{path.name} has no section '## {heading}'"
    end = re.search(r"^## ", text[start.end():], re.MULTILINE)
    return text[start.end(): start.end() + end.start() if end else len(text)]


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, re.MULTILINE | re.DOTALL)


def has_top_level_await(block: str) -> bool:
    code = compile(block, "<example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return bool(code.co_flags & inspect.CO_COROUTINE)


def scripts(blocks: list[str], redis_url: str, gateway_url: str) -> list[str]:
    """The blocks as runnable scripts: the awaiting ones in order in one ``main()``, then each blocking one.
    A webhook receiver becomes a local address that nothing answers (the test's gateway allows it)."""
    assert blocks, "no ```python blocks found"
    blocks = [b.replace(EXAMPLE_URL, redis_url).replace(EXAMPLE_GATEWAY, gateway_url)
              .replace(EXAMPLE_WEBHOOK, "http://127.0.0.1:9/") for b in blocks]
    awaiting = [b for b in blocks if has_top_level_await(b)]
    blocking = [b for b in blocks if not has_top_level_await(b)]
    body = textwrap.indent("\n".join(awaiting), "    ")
    wrapped = [f"import asyncio\n\n\nasync def main():\n{body}\n\n\nasyncio.run(main())\n"] if awaiting else []
    return wrapped + blocking


def run_scripts(blocks: list[str], redis_url: str, cwd: Path, gateway_url: str = EXAMPLE_GATEWAY) -> list[str]:
    """Run each script with the checkout's Python in ``cwd``; their outputs, in order."""
    outputs = []
    for i, script in enumerate(scripts(blocks, redis_url, gateway_url)):
        path = cwd / f"example_{i}.py"
        path.write_text(script)
        done = subprocess.run([sys.executable, str(path)], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                              timeout=SCRIPT_LIMIT_S)
        assert done.returncode == 0, f"{script}\n---- stdout\n{done.stdout}\n---- stderr\n{done.stderr}"
        outputs.append(done.stdout)
    return outputs


@pytest.fixture(scope="module")
def worker_redis_url(redis_server: EmbeddedRedis, tiny_model_path: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's Redis, emptied, with one `slotq worker` on the tiny model, registered."""
    url = emptied(redis_server)
    env = clean_env(redis_url=url, model=tiny_model_path, slots=4, threads=1, ctx=2048)
    proc = WorkerProcess(WORKER, env, tmp_path_factory.mktemp("docs-worker"))

    async def registered() -> None:
        async with await SlotqClient.connect(url) as client:
            await wait_for_workers(client, {WORKER}, procs=[proc])

    try:
        asyncio.run(registered())
        yield url
    finally:
        proc.stop()


def test_the_readme_web_app_examples_run(worker_redis_url: str, tmp_path: Path) -> None:
    blocks = python_blocks(section(REPO_ROOT / "README.md", "Using it from a web app"))
    assert any(EXAMPLE_URL in b for b in blocks), f"no example connects to {EXAMPLE_URL}"
    assert any(has_top_level_await(b) for b in blocks) and not all(has_top_level_await(b) for b in blocks), \
        "the section should show both the async client and the blocking facade"
    outputs = run_scripts(blocks, worker_redis_url, tmp_path)
    assert all(outputs), outputs        # every script printed what its example prints


def test_the_bulk_python_api_examples_run(worker_redis_url: str, tmp_path: Path) -> None:
    text = (REPO_ROOT / "docs" / "bulk.md").read_text()
    blocks = python_blocks(text)
    inputs = set(re.findall(r'"([\w-]*prompts\.jsonl(?:\.gz)?)"', "\n".join(blocks)))
    outputs = set(re.findall(r'"([\w-]*results\.jsonl)"', "\n".join(blocks)))
    assert inputs and outputs, blocks
    lines = [json.dumps({"id": f"q-{i}", "prompt": f"line {i}", "max_tokens": 8}) + "\n" for i in range(3)]
    for name in inputs:
        data = "".join(lines).encode()
        (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    run_scripts(blocks, worker_redis_url, tmp_path)
    for name in outputs:
        written = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert sorted(r["id"] for r in written) == ["q-0", "q-1", "q-2"], written
        assert {r["status"] for r in written} == {"succeeded"}, written


def test_the_gateway_openai_sdk_examples_run(tiny_model_path: Path, tmp_path: Path) -> None:
    """The blocks that make their own client (a fragment such as the embeddings call needs an
    embedding worker and the client of an earlier block). The webhook example's receiver is a name
    no offline machine resolves, so it becomes a loopback address, which the gateway is told to allow."""
    blocks = [b for b in python_blocks((REPO_ROOT / "docs" / "gateway.md").read_text()) if "OpenAI(" in b]
    assert blocks and all(EXAMPLE_GATEWAY in b for b in blocks), blocks
    batch = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "smollm2", "max_tokens": 8,
                                  "messages": [{"role": "user", "content": f"line {i}"}]}}) for i in range(2)]
    (tmp_path / "batch.jsonl").write_text("\n".join(batch) + "\n")
    with Stack.started(tmp_path, tiny_model_path) as stack:
        stack.start_worker("docs-gateway-worker", "smollm2", ctx=2048)
        stack.start_gateway("docs-gateway", data_dir=tmp_path / "data", gateway_webhook_allow_private=True).wait_ready()
        stack.wait_for_models({"smollm2"})
        run_scripts(blocks, stack.redis.url, tmp_path, stack.url)


@pytest.mark.real_model
def test_the_engine_example_runs_on_the_bundled_model(tmp_path: Path) -> None:
    blocks = python_blocks(section(REPO_ROOT / "docs" / "architecture.md", "The engine on its own"))
    assert blocks, "docs/architecture.md's engine section has no ```python block"
    run_scripts(blocks[:1], "unused", tmp_path)  # the first block; the rest are fragments of the engine's API


def _imported_names(block: str) -> Iterator[tuple[str, str]]:
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield from ((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((alias.name, "") for alias in node.names)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_example_compiles_and_imports_what_exists(doc: Path) -> None:
    for block in python_blocks(doc.read_text()):
        compile(block, doc.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for module, name in _imported_names(block):
            top = module.split(".")[0]
            assert top not in {"engine", "jobs"}, f"{doc.name}: `{module}` is a repository folder: use slotq.{module}"
            if top == "slotq":
                imported = __import__(module, fromlist=[name] if name else [])
                assert not name or hasattr(imported, name), f"{doc.name}: {module} has no {name}"
        urls = set(re.findall(r"redis(?:s|\+sentinel)?://[^\s\"')]+", block))
        assert urls <= {EXAMPLE_URL}, f"{doc.name}: an example uses {urls - {EXAMPLE_URL}}, not {EXAMPLE_URL}"
