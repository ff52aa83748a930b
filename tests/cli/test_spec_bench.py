"""``slotq bench spec``'s pure parts, which decide what its table says without running it.

* The copy-heavy prompts are the same in every process (a hash seed changes nothing), differ from one
  index to the next, and are 200 to 800 tokens long on the bundled model's tokenizer.
* The ratios the issue's targets name come from the right rows: slotq's n-gram row over slotq off,
  over llama-server's fastest speculative mode (named), and over llama-server without drafting.
* Draft counters are read from Prometheus text as both systems write it.
* ``slotq bench``'s spec-only flags are refused for the other benchmarks, with the flag named.
No timings are asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers_bench import Sample
from bench.spec_bench import LLAMA_COUNTERS, Measured, result_row, scrape, systems, worker_environment
from bench.spec_prompts import MAX_TOKENS, MIN_TOKENS, TASKS, copy_prompt
from bench.spec_report import (
    LLAMA_PLAIN,
    LLAMA_SPEC_PREFIX,
    SLOTQ_DRAFT,
    SLOTQ_NGRAM,
    SLOTQ_OFF,
    VS_BEST,
    VS_OFF,
    VS_PLAIN,
    ratios,
    table,
)
from slotq.engine import EngineConfig
from slotq.engine.llama_model import LlamaModel
from slotq.jobs.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_copy_prompts_are_the_same_in_every_process_and_differ_by_index() -> None:
    script = "from bench.spec_prompts import copy_prompt; print(repr([copy_prompt(i) for i in range(6)]))"
    seen = {subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(seen) == 1
    assert seen.pop().strip() == repr([copy_prompt(i) for i in range(6)])
    assert len({copy_prompt(i) for i in range(60)}) == 60


def test_copy_prompts_are_200_to_800_tokens_on_the_bundled_model(real_model_path: Path) -> None:
    model = LlamaModel(EngineConfig(model_path=real_model_path, slots=1, ctx=256, threads=1))
    try:
        lengths = {i: len(model.tokenize(copy_prompt(i), add_special=False)) for i in range(12 * len(TASKS))}
    finally:
        model.close()
    outside = {i: n for i, n in lengths.items() if not MIN_TOKENS <= n <= MAX_TOKENS}
    assert not outside, f"prompts outside {MIN_TOKENS}..{MAX_TOKENS} tokens: {outside}"
    assert max(lengths.values()) - min(lengths.values()) > 300      # long and short ones, not one size


def _row(workload: str, system: str, clients: int, rate: float, drafted: int | None = None,
         accepted: int | None = None) -> dict[str, object]:
    return {"workload": workload, "system": system, "concurrency": clients, "tokens_per_s": rate,
            "ttft_p50_ms": 100.0, "ttft_p95_ms": 150.0, "tokens_per_request": 128.0,
            "draft_tokens": drafted, "accepted_tokens": accepted}


RESULTS = [
    _row("copy-heavy", SLOTQ_OFF, 1, 100.0),
    _row("copy-heavy", SLOTQ_NGRAM, 1, 250.0, drafted=400, accepted=300),
    _row("copy-heavy", LLAMA_PLAIN, 1, 120.0, drafted=0, accepted=0),
    _row("copy-heavy", LLAMA_SPEC_PREFIX + "ngram-simple", 1, 130.0, drafted=200, accepted=50),
    _row("copy-heavy", LLAMA_SPEC_PREFIX + "ngram-mod", 1, 200.0, drafted=500, accepted=400),
    _row("free-form", SLOTQ_OFF, 4, 160.0),
    _row("free-form", SLOTQ_NGRAM, 4, 150.0),          # no draft counters reported
]


def test_ratios_compare_slotq_spec_with_slotq_off_the_best_llama_server_mode_and_plain() -> None:
    by = {(r["workload"], r["concurrency"]): r for r in ratios(RESULTS)}
    copy = by[("copy-heavy", 1)]
    assert (copy[VS_OFF], copy[VS_BEST], copy[VS_PLAIN]) == (2.5, 1.25, 2.08)
    assert copy["llama-server best spec"] == "ngram-mod"
    free = by[("free-form", 4)]
    assert (free[VS_OFF], free[VS_BEST], free[VS_PLAIN]) == (0.94, None, None)
    assert len(by) == 2                                 # one line per slotq speculative row


def test_the_table_marks_each_target_and_shows_acceptance() -> None:
    text = table(RESULTS, ["a note"])
    assert "| copy-heavy | 1 | slotq spec=ngram | 2.50 (met: ≥ 1.8) | 1.25 (met: ≥ 1.2) (ngram-mod) | 2.08 |" in text
    assert "| free-form | 4 | slotq spec=ngram | 0.94 (missed: ≥ 0.97) | – | – |" in text
    assert "75% (300 / 400)" in text and "0 drafted" in text
    assert text.endswith("a note")


def test_draft_counters_are_read_from_prometheus_text_summed_over_labels() -> None:
    text = ("# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated\n"
            "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter\n"
            "llamacpp:spec_decode_num_draft_tokens_total 75\n"
            "# TYPE slotq_spec_draft_tokens counter\n"
            'slotq_spec_draft_tokens_total{model="a"} 3.0\n'
            'slotq_spec_draft_tokens_total{model="b"} 4.0\n')
    values = scrape(text)
    assert values[LLAMA_COUNTERS[1]] == 75
    assert values["slotq_spec_draft_tokens_total"] == 7


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "peers", "--draft-model", "x.gguf"], "--draft-model apply to `slotq bench spec` only"),
    (["bench", "spec", "--draft-model", "/nonexistent/draft.gguf"], "--draft-model: no such file"),
])
def test_spec_only_flags_are_refused_with_the_flag_named(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_client_counts_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "spec", "--concurrency", "1,0"])
    assert "client counts must be >= 1" in capsys.readouterr().err


def test_a_slotq_rows_draft_source_is_its_own_not_inherited_from_this_environment() -> None:
    environ = {"SLOTQ_DRAFT_MODEL": "/elsewhere/draft.gguf", "SLOTQ_SPEC": "off", "SLOTQ_SPEC_K_MAX": "4", "HOME": "/h"}
    by = {row.name: row for row in systems(server=True, draft_model=Path("/models/draft.gguf"))}
    ngram = worker_environment(environ, by[SLOTQ_NGRAM], {"SLOTQ_SLOTS": "4"})
    assert "SLOTQ_DRAFT_MODEL" not in ngram
    assert (ngram["SLOTQ_SPEC"], ngram["SLOTQ_SPEC_K_MAX"], ngram["SLOTQ_SLOTS"], ngram["HOME"]) \
        == ("ngram", "4", "4", "/h")
    draft = worker_environment(environ, by[SLOTQ_DRAFT], {})
    assert (draft["SLOTQ_SPEC"], draft["SLOTQ_DRAFT_MODEL"]) == ("draft", "/models/draft.gguf")
    assert ngram["SLOTQ_QUEUE_NAME"] != draft["SLOTQ_QUEUE_NAME"]


def test_a_row_gives_tokens_per_second_over_the_rounds_and_each_streams_speed_after_its_first_token() -> None:
    measured = Measured(rates=[10.0, 14.0], samples=[Sample(ttft_s=0.5, latency_s=2.5, tokens=41),
                                                      Sample(ttft_s=1.0, latency_s=2.0, tokens=11)],
                        draft_tokens=40, accepted_tokens=10)
    row = result_row("copy-heavy", SLOTQ_NGRAM, 1, measured)
    assert (row["tokens_per_s"], row["stream_decode_tokens_per_s_p50"], row["acceptance"]) == (12.0, 15.0, 0.25)
    assert (row["ttft_p50_ms"], row["tokens_per_request"]) == (750.0, 26.0)
    assert "| 12.0 | 750 / 975 | 15.0 | 25% (10 / 40) | 26 |" in table([row], [])
