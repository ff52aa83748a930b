"""``slotq bench lora``'s pure part: where a load's time goes, from the counters read around it."""

from __future__ import annotations

import re

from bench.lora_bench import _costs, _costs_table


def test_switch_cost_and_the_split_of_mixed_over_base() -> None:
    base = {"wall_s": 10.0, "tokens": 1000.0, "steps": 125.0, "decode_s": 8.0, "switches": 0.0, "switch_s": 0.0}
    # twice the steps at half the tokens each; 25 switches whose decodes took 60 ms against 40 ms for the others
    mixed = {"wall_s": 12.5, "tokens": 1000.0, "steps": 250.0, "decode_s": 10.5, "switches": 25.0, "switch_s": 1.5}
    peer = {"wall_s": 11.0, "tokens": 1000.0, "steps": 250.0}
    costs = [{"system": "slotq-redis", "load": "base", **_costs(base)},
             {"system": "slotq-redis", "load": "mixed", **_costs(mixed)},
             {"system": "llama-server", "load": "mixed", **_costs(peer)}]
    m = costs[1]
    assert (m["tokens_per_step"], m["wall_ms_per_step"], m["steps_per_turn"]) == (4.0, 50.0, 10.0)
    assert (m["switch_step_decode_ms"], m["other_step_decode_ms"]) == (60.0, 40.0)
    assert m["switch_extra_share"] == 0.04 and m["decode_share"] == 0.84           # 25 x 20 ms of 12.5 s
    assert costs[0]["steps_per_turn"] is None and "switches" not in costs[2]
    text = _costs_table(costs)
    # mixed / base tokens/s (10 / 12.5 = 0.8) = fewer tokens a step (0.5) x cheaper steps (80 / 50 = 1.6)
    assert re.search(r"slotq-redis: mixed / base tokens/s 0\.80 = 0\.50 .* x 1\.60 ", text)
    assert "llama-server: mixed" not in text                    # no base load of llama-server: no split
