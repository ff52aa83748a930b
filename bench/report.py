"""Shared benchmark plumbing: the workload's prompts, progress output, and writing results."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).parent / "results"

TOPICS = ["rivers", "volcanoes", "libraries", "bicycles", "comets", "bridges", "forests", "deserts",
          "orchestras", "glaciers", "lighthouses", "markets", "tunnels", "islands", "gardens", "satellites"]


def distinct_prompt(i: int) -> str:
    """Prompts that share no prefix beyond the first word, so the prefix cache cannot help."""
    topic = TOPICS[i % len(TOPICS)]
    return f"{topic.capitalize()} #{i}: write a short paragraph about {topic} and why people care about them."


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_results(name: str, data: dict[str, Any], table: str, command: str) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS_DIR / f"{name}.md").write_text(
        f"Measured {stamp} on {machine()} with `{command}`.\n\n{table}\n")
    progress(f"wrote {RESULTS_DIR / name}.md and .json")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
