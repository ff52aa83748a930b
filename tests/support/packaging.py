"""Build slotq's wheel for real, from a copy of the checkout, as ``pip install /path/to/slotq`` would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import REPO_ROOT


def build_wheel(work: Path) -> Path:
    """The wheel built from a copy of what the install reads (pyproject, README, engine/, jobs/,
    and bench/, which must stay out of it), in ``work``. No build isolation: setuptools is the
    test environment's, so no download."""
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for folder in ("engine", "jobs", "bench"):
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (work / "dist").glob("slotq-*.whl")
    return wheel
