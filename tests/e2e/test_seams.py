"""The seams between slotq's packages hold: each process loads only its own code, and no package
imports against the layers that docs/architecture.md ("The package layers") writes down.

Both are checked on the real thing: the layers against every import statement in engine/ and jobs/
(read with ``ast``, including imports inside functions and under ``TYPE_CHECKING``, which are still
arrows a refactor must respect), the loading against ``sys.modules`` of a fresh interpreter that
imports one entry point.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

SOURCES = {"engine": "slotq.engine", "jobs": "slotq.jobs"}
PUBLIC = REPO_ROOT / "jobs" / "public"   # installed as the top-level `slotq` (pyproject's package-dir)


def package_of(module: str) -> str | None:
    """The node of the package graph a module belongs to: ``engine``, a folder or shared module of
    ``jobs/`` (``worker``, ``settings``, ...), ``slotq`` for the public import; None outside slotq."""
    parts = module.split(".")
    if parts[0] != "slotq":
        return None
    if len(parts) == 1:
        return "slotq"
    if parts[1] == "engine":
        return "engine"
    if parts[1] == "jobs" and len(parts) > 2:
        return parts[2]
    return "jobs"


@dataclass(frozen=True)
class Arrow:
    source: str          # importing module
    target: str          # imported module
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    if path.is_relative_to(PUBLIC):
        return ".".join(["slotq", *path.relative_to(PUBLIC).with_suffix("").parts]).removesuffix(".__init__")
    top = path.relative_to(REPO_ROOT).parts[0]
    rel = path.relative_to(REPO_ROOT / top).with_suffix("")
    return ".".join([SOURCES[top], *rel.parts]).removesuffix(".__init__")


def imports_of(path: Path) -> list[Arrow]:
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    arrows = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            arrows += [Arrow(source, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            arrows.append(Arrow(source, base, node.lineno))
    return arrows


def all_arrows() -> list[Arrow]:
    return [arrow for top in SOURCES for path in sorted((REPO_ROOT / top).rglob("*.py")) for arrow in imports_of(path)]


def documented_layers() -> list[list[str]]:
    """The layers from docs/architecture.md, top first: the first fenced block under the heading
    "The package layers", one layer per line, ``name, name  # comment``."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### The package layers", 1)[1]
    block = re.search(r"```[a-z]*\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md: no fenced block under 'The package layers'"
    layers = []
    for line in block.group(1).splitlines():
        names = line.split("#", 1)[0].replace(",", " ").split()
        if names:
            layers.append(names)
    return layers


def backward_arrows(arrows: list[Arrow], layers: list[list[str]]) -> list[str]:
    rank = {name: depth for depth, layer in enumerate(layers) for name in layer}
    wrong = []
    for arrow in arrows:
        source, target = package_of(arrow.source), package_of(arrow.target)
        if target is None or source == target or "jobs" in (source, target):
            continue
        assert source in rank and target in rank, f"{arrow}: {source} or {target} is in no documented layer"
        if rank[target] <= rank[source]:
            wrong.append(f"{arrow} ({source} -> {target} runs back: {target} is not on a lower layer)")
    return wrong


def test_every_package_is_in_a_documented_layer() -> None:
    layers = [name for layer in documented_layers() for name in layer]
    assert len(layers) == len(set(layers)), "a package is on two layers"
    on_disk = {package_of(module_name(path)) for top in SOURCES for path in (REPO_ROOT / top).rglob("*.py")}
    assert on_disk - {"jobs"} == set(layers)


def test_no_import_runs_back_against_the_layers() -> None:
    assert backward_arrows(all_arrows(), documented_layers()) == []


def test_the_layer_check_sees_a_backward_arrow(tmp_path: Path) -> None:
    """The check itself: an arrow from the engine into jobs, and one between packages of one
    layer, are both refused."""
    layers = [["worker", "bulk"], ["engine"]]
    arrows = [Arrow("slotq.engine.runner", "slotq.jobs.worker.metrics", 1),
              Arrow("slotq.jobs.worker.job_run", "slotq.jobs.bulk.runner", 2),
              Arrow("slotq.jobs.worker.job_run", "slotq.engine", 3)]
    assert len(backward_arrows(arrows, layers)) == 2


def test_the_jobs_package_itself_imports_nothing() -> None:
    """``slotq.jobs`` is loaded by every process before its own folder, so it must stay empty of imports."""
    assert [str(a) for a in imports_of(REPO_ROOT / "jobs" / "__init__.py") if package_of(a.target)] == []


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``statement`` (not from the checkout's
    directory, so only the installed names resolve)."""
    probe = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=REPO_ROOT / "deploy", check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def loaded_under(modules: set[str], *prefixes: str) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


PRODUCER_MUST_NOT_LOAD = ("arq", "llama_cpp", "fastapi", "uvicorn", "slotq.jobs.worker",
                          "slotq.jobs.gateway", "slotq.jobs.cli", "slotq.engine.engine", "slotq.engine.runner",
                          # the schema and tool checks load these on the first request that needs them
                          "numpy", "llguidance", "jinja2", "slotq.engine.constraints", "slotq.engine.tools")


@pytest.mark.parametrize("statement", [
    "from slotq import SlotqClient, SyncSlotqClient, JobRequest",
    "import slotq.jobs.producer.client, slotq.jobs.producer.sync_client",
])
def test_a_producer_loads_no_worker_gateway_or_llama_cpp(statement: str) -> None:
    assert loaded_under(loaded_after(statement), *PRODUCER_MUST_NOT_LOAD) == []


def test_importing_slotq_alone_loads_nothing_else() -> None:
    assert loaded_under(loaded_after("import slotq"), "slotq.jobs", "slotq.engine", "redis", "pydantic") == []


def test_the_gateway_loads_no_worker_and_no_llama_cpp() -> None:
    modules = loaded_after("import slotq.jobs.gateway.server, slotq.jobs.gateway.app")
    assert loaded_under(modules, "slotq.jobs.worker", "slotq.jobs.cli", "llama_cpp", "arq.worker") == []


def test_bulk_loads_no_worker_gateway_or_llama_cpp() -> None:
    modules = loaded_after("import slotq.jobs.bulk")
    assert loaded_under(modules, "slotq.jobs.worker", "slotq.jobs.gateway", "llama_cpp", "fastapi") == []


def test_the_engine_loads_no_redis_and_no_job_layer() -> None:
    modules = loaded_after("import slotq.engine\nfrom slotq.engine import Engine")
    assert "llama_cpp" in modules, "the probe must load the engine for real"
    assert loaded_under(modules, "redis", "arq", "slotq.jobs") == []


def test_the_worker_loads_no_gateway() -> None:
    modules = loaded_after("import slotq.jobs.worker.worker")
    assert loaded_under(modules, "slotq.jobs.gateway", "fastapi", "slotq.jobs.bulk") == []


def test_the_public_import_offers_what_it_lists() -> None:
    """``from slotq import *`` and each name of ``__all__`` resolve, to the object its module defines."""
    import importlib

    import slotq

    assert sorted(slotq.__all__) == sorted(slotq._EXPORTS)
    for name in slotq.__all__:
        assert getattr(slotq, name) is getattr(importlib.import_module(slotq._EXPORTS[name]), name)
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        slotq.Engine  # noqa: B018 -- the engine is not part of the producer's import
