"""``slotq bench peers``' markdown table and PNG plot (matplotlib, imported only to draw)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import markdown_table, progress

REFERENCE = "llama-server"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def table(results: list[dict[str, Any]], concurrency: list[int], skipped: dict[str, str]) -> str:
    """One row per system and concurrency; ratios against llama-server at the same concurrency."""
    by = {(r["system"], r["concurrency"]): r for r in results}
    rows = []
    for c in concurrency:
        ref = by.get((REFERENCE, c))
        for r in (r for r in results if r["concurrency"] == c):
            ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "–"
            ttft_ratio = (f"{r['ttft_p50_ms'] / ref['ttft_p50_ms']:.2f}"
                          if ref and r["ttft_p50_ms"] is not None and ref["ttft_p50_ms"] else "–")
            rows.append([str(c), r["system"], f"{r['tokens_per_s']:.1f}", ratio,
                         f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p95_ms'])}", ttft_ratio,
                         f"{_ms(r['latency_p50_ms'])} / {_ms(r['latency_p95_ms'])}", f"{r['peak_rss_mb']:.0f}"])
    text = markdown_table(["clients", "system", "tok/s", "tok/s vs llama-server", "TTFT p50 / p95 ms",
                           "TTFT p50 vs llama-server", "latency p50 / p95 ms", "peak RSS MB"], rows)
    for system, reason in skipped.items():
        text += f"\n\n{system} was not measured: {reason}"
    return text


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Tokens/s and TTFT p50 against concurrency, one line per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("no plot: matplotlib is not installed (pip install 'slotq[bench]')")
        return
    fig, (rate_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in dict.fromkeys(r["system"] for r in results):
        rows = [r for r in results if r["system"] == system]
        xs = [r["concurrency"] for r in rows]
        rate_ax.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=system)
        if any(r["ttft_p50_ms"] is not None for r in rows):
            ttft_ax.plot(xs, [r["ttft_p50_ms"] for r in rows], marker="o", label=system)
    for ax, label in ((rate_ax, "generated tokens/s"), (ttft_ax, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (= slots)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ttft_ax.set_yscale("log")
    rate_ax.legend(fontsize=8)
    fig.suptitle("slotq bench peers: one workload, every system side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"wrote {path}")
