"""``slotq bench spec``'s tables: every row's figures, then the ratios issue 34's targets name.

Pure functions of the measured rows (dicts, as ``--json`` writes them), so they are tested without
running anything (tests/cli/test_spec_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.report import markdown_table

SLOTQ_OFF = "slotq spec=off"
SLOTQ_NGRAM = "slotq spec=ngram"
SLOTQ_DRAFT = "slotq spec=draft"
LLAMA_PLAIN = "llama-server"
LLAMA_SPEC_PREFIX = "llama-server --spec-type "
SLOTQ_SPEC_ROWS = (SLOTQ_NGRAM, SLOTQ_DRAFT)


@dataclass(frozen=True)
class Target:
    """A ratio the issue asks for: ``ratio`` >= ``at_least`` on ``workload`` at ``clients`` (None: every count)."""
    workload: str
    ratio: str
    clients: int | None
    at_least: float


VS_OFF = "spec / slotq off"
VS_BEST = "spec / llama-server best spec"
VS_PLAIN = "spec / llama-server plain"
TARGETS = (
    Target("copy-heavy", VS_OFF, 1, 1.8),
    Target("copy-heavy", VS_BEST, 1, 1.2),
    Target("copy-heavy", VS_BEST, 4, 1.0),
    Target("free-form", VS_OFF, None, 0.97),
    *(Target("free-form", VS_PLAIN, c, 1.0) for c in (1, 4, 8)),
)


def acceptance(drafted: int | None, accepted: int | None) -> float | None:
    """Accepted / drafted tokens; None where nothing was drafted or the system does not report it."""
    return accepted / drafted if drafted and accepted is not None else None


def best_spec_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """llama-server's fastest speculative mode among ``rows`` (one workload and client count)."""
    spec = [r for r in rows if r["system"].startswith(LLAMA_SPEC_PREFIX)]
    return max(spec, key=lambda r: r["tokens_per_s"]) if spec else None


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, client count and slotq speculative row: its tokens/s over slotq off, over
    llama-server's best speculative mode (named) and over llama-server without drafting."""
    out = []
    for workload, clients in dict.fromkeys((r["workload"], r["concurrency"]) for r in results):
        rows = [r for r in results if r["workload"] == workload and r["concurrency"] == clients]
        by = {r["system"]: r for r in rows}
        best = best_spec_row(rows)
        for system in (s for s in SLOTQ_SPEC_ROWS if s in by):
            rate = by[system]["tokens_per_s"]
            out.append({"workload": workload, "concurrency": clients, "system": system,
                        VS_OFF: _over(rate, by.get(SLOTQ_OFF)), VS_BEST: _over(rate, best),
                        "llama-server best spec": best["system"].removeprefix(LLAMA_SPEC_PREFIX) if best else None,
                        VS_PLAIN: _over(rate, by.get(LLAMA_PLAIN))})
    return out


def _over(rate: float, reference: dict[str, Any] | None) -> float | None:
    return round(rate / reference["tokens_per_s"], 2) if reference and reference["tokens_per_s"] else None


def target_for(workload: str, ratio: str, clients: int) -> float | None:
    return next((t.at_least for t in TARGETS
                 if t.workload == workload and t.ratio == ratio and t.clients in (None, clients)), None)


def _ratio_cell(row: dict[str, Any], ratio: str, system: str) -> str:
    value = row[ratio]
    if value is None:
        return "–"
    # the targets are about n-gram drafting (SLOTQ_SPEC=ngram); a draft-model row is shown beside it
    target = target_for(row["workload"], ratio, row["concurrency"]) if system == SLOTQ_NGRAM else None
    if target is None:
        return f"{value:.2f}"
    return f"{value:.2f} ({'met' if value >= target else 'missed'}: ≥ {target})"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _one_decimal(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _acceptance_cell(r: dict[str, Any]) -> str:
    rate = acceptance(r.get("draft_tokens"), r.get("accepted_tokens"))
    if rate is None:
        return "–" if r.get("draft_tokens") is None else "0 drafted"
    return f"{rate:.0%} ({r['accepted_tokens']} / {r['draft_tokens']})"


def table(results: list[dict[str, Any]], notes: list[str]) -> str:
    """Every row, then the ratios with the issue's targets, then what was skipped or not reported."""
    rows = [[r["workload"], str(r["concurrency"]), r["system"], f"{r['tokens_per_s']:.1f}",
             f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p95_ms'])}",
             _one_decimal(r.get("stream_decode_tokens_per_s_p50")), _acceptance_cell(r),
             f"{r['tokens_per_request']:.0f}" if r.get("tokens_per_request") is not None else "–"]
            for r in results]
    text = markdown_table(["workload", "clients", "system", "tok/s", "TTFT p50 / p95 ms",
                           "a stream's tok/s after its first token, p50", "draft acceptance (accepted / drafted)",
                           "tokens / request"], rows)
    ratio_rows = [[r["workload"], str(r["concurrency"]), r["system"], _ratio_cell(r, VS_OFF, r["system"]),
                   _ratio_cell(r, VS_BEST, r["system"]) + (f" ({r['llama-server best spec']})"
                                                           if r["llama-server best spec"] else ""),
                   _ratio_cell(r, VS_PLAIN, r["system"])] for r in ratios(results)]
    if ratio_rows:
        text += "\n\n" + markdown_table(["workload", "clients", "slotq", "tok/s vs slotq off",
                                         "tok/s vs llama-server's best spec mode", "tok/s vs llama-server plain"],
                                        ratio_rows)
    for note in notes:
        text += f"\n\n{note}"
    return text
