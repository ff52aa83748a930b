"""What ``pip install slotq`` puts on a machine: one ``slotq`` namespace, no benchmarks.

The repository keeps the folders the design fixes (engine/, jobs/); the wheel installs them as
``slotq.engine`` and ``slotq.jobs`` (pyproject's package-dir), so an application's own ``jobs``
package can't shadow ours. The wheel is built for real, from a copy of the checkout.
"""

from __future__ import annotations

import tomllib
import zipfile
from pathlib import Path
from typing import Any

from tests.support import REPO_ROOT
from tests.support.packaging import build_wheel


def _setuptools() -> dict[str, Any]:
    setuptools: dict[str, Any] = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools


def _installed_name(folder: Path) -> str:
    """The package a source folder installs as: the package-dir entry of the nearest mapped folder
    above it (``jobs/public`` -> ``slotq``, ``jobs/worker`` -> ``slotq.jobs.worker``)."""
    by_folder = {REPO_ROOT / path: package for package, path in _setuptools()["package-dir"].items()}
    mapped = max((f for f in by_folder if folder == f or f in folder.parents), key=lambda f: len(f.parts))
    return ".".join([by_folder[mapped], *folder.relative_to(mapped).parts])


def test_every_source_folder_is_a_listed_package() -> None:
    on_disk = {_installed_name(init.parent)
               for top in ("engine", "jobs") for init in (REPO_ROOT / top).rglob("__init__.py")}
    assert on_disk == set(_setuptools()["packages"])


def test_the_wheel_installs_only_the_slotq_namespace(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"slotq"}
    assert "slotq/jobs/cli/main.py" in names and "slotq/engine/engine.py" in names
    assert "slotq/__init__.py" in names, "the short public import: from slotq import SlotqClient"
    assert not any(n.startswith("slotq/jobs/public/") for n in names), "jobs/public/ installs as slotq, once"
    assert ("slotq/jobs/gateway/static/index.html" in names
            or any(n.startswith("slotq/jobs/gateway/static/") for n in names))
    assert not any("bench" in n.split("/") for n in names), "the benchmarks stay out of the wheel"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "slotq = slotq.jobs.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
