"""The draft planner's own cost per engine step, in CPU time: what speculation costs where it decides
not to draft (free text), and where it drafts (copying sequences), at 1, 16, 64 and 256 sequences.

No model: the step's work is the runner's (``Runner._propose_drafts``, the scheduler's
``_plan_drafts``, the shadow tests of ``Runner._generate``) on sequences whose tokens the script
appends itself, with the step cost of the bundled model on this 2-core CPU (``CPU``, as
tests/engine/test_speculation.py) or a GPU-like flat one (``GPU``). Free-text sequences get random
tokens (their n-gram lookups rarely match), copying ones repeat their 1,000-token prompt. Each
sequence starts with a ``--prompt``-token context, so the n-gram index's first build is timed too
(reported apart: ``first step``).

    .venv/bin/python -m bench.planner_bench [--steps 200] [--prompt 1000]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from slotq.engine.sequence import Sequence
from slotq.engine.speculation import DraftPlanner, NgramDrafter, StepCost, propose_drafts

CPU = {1: 0.0065, 2: 0.014, 4: 0.020, 8: 0.034, 16: 0.047, 32: 0.085, 64: 0.17}
GPU = {1: 0.010, 64: 0.0105, 128: 0.011, 256: 0.020, 512: 0.040}
CTX = 32_768
BUDGET = 512


def _sequences(n: int, prompt: int, copying: bool, rng: random.Random) -> list[Sequence]:
    seqs = []
    for i in range(n):
        tokens = [rng.randrange(150_000) for _ in range(prompt)]
        seq = Sequence(request_id=f"r{i}", tokens=tokens, n_prompt=prompt, max_new_tokens=1 << 20, seq_id=i)
        seq.tokens.append(_next_token(seq, copying, rng))     # the first generated token: it decodes now
        seq.n_computed = len(seq.tokens) - 1
        seqs.append(seq)
    return seqs


def _next_token(seq: Sequence, copying: bool, rng: random.Random) -> int:
    if copying:
        return seq.tokens[(len(seq.tokens) - seq.n_prompt) % seq.n_prompt]   # the prompt again, token by token
    return rng.randrange(150_000)


def run(n_seqs: int, steps: int, prompt: int, copying: bool, table: dict[int, float]) -> tuple[float, float, float]:
    """Per step: (first step's CPU ms, mean CPU ms of the rest, draft tokens planned per step)."""
    rng = random.Random(n_seqs)
    seqs = _sequences(n_seqs, prompt, copying, rng)
    drafter = NgramDrafter()
    planner = DraftPlanner(StepCost(dict(table), rate=0.0), k_min=2, k_max=32)
    first = rest = 0.0
    drafted = 0
    for step in range(steps):
        started = time.process_time()
        proposals = propose_drafts(drafter, planner, seqs, CTX)
        rooms = planner.plan(list(proposals.items()), prompt_lengths=[], n_generating=len(seqs),
                             budget=BUDGET - len(seqs))
        seconds = time.process_time() - started
        tests: list[tuple[Sequence, int, int, int]] = []       # what verification reports
        for seq in seqs:
            proposal = proposals.get(seq)
            room = rooms.get(seq, 0)
            seq.tokens.append(_next_token(seq, copying, rng))
            if room and proposal is not None and proposal.tokens:
                kept = 0
                while kept < room and _next_token(seq, copying, rng) == proposal.tokens[kept]:
                    seq.tokens.append(proposal.tokens[kept])
                    kept += 1
                tests.append((seq, min(kept + 1, room), kept, proposal.match))
                drafted += room
            elif proposal is not None and proposal.tokens:
                tests.append((seq, 1, int(seq.tokens[-1] == proposal.tokens[0]), proposal.match))
            seq.n_computed = len(seq.tokens) - 1
        started = time.process_time()
        for seq, tested, accepted, match in tests:
            planner.observe(seq, tested, accepted, match)
        seconds += time.process_time() - started
        if step == 0:
            first = seconds
        else:
            rest += seconds
    return first * 1000, rest / (steps - 1) * 1000, drafted / steps


def index_bytes(prompt: int) -> int:
    """Bytes the n-gram index of one sequence of ``prompt`` random tokens holds."""
    seq = _sequences(1, prompt, False, random.Random(0))[0]
    drafter = NgramDrafter()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(prompt // 1000 + 2):          # as many steps as an incremental build takes
        drafter.propose(seq, 8)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=1000)
    args = parser.parse_args()
    print("| step cost | workload | sequences | first step CPU ms | CPU ms per step | per sequence us "
          "| drafts per step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, table in (("CPU", CPU), ("GPU", GPU)):
        for copying in (False, True):
            for n in (1, 16, 64, 256):
                first, per_step, drafted = run(n, args.steps, args.prompt, copying, table)
                print(f"| {name} | {'copy' if copying else 'free'} | {n} | {first:.2f} | {per_step:.3f} | "
                      f"{per_step * 1000 / n:.1f} | {drafted:.1f} |")
    for prompt in (1000, 32_768):
        print(f"n-gram index of one {prompt}-token context: {index_bytes(prompt) / prompt:.0f} bytes per token")


if __name__ == "__main__":
    main()
