"""Speculative decoding: the n-gram drafter, the step cost, the draft planner and the scheduler's
rule 9 (pure), then verification on real llama.cpp: output is the same token for token with and
without drafts, whatever the request asks for."""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from pathlib import Path

import pytest

from slotq.engine import ChatMessage, Engine, EngineStats, Finished, FinishReason, GenerationRequest, SamplingParams
from slotq.engine.config import EngineConfig, SpecMode
from slotq.engine.scheduler import KVFullAction, Scheduler
from slotq.engine.sequence import Sequence
from slotq.engine.speculation import (
    INDEX_CHUNK,
    INDEX_TABLE_SIZE,
    MAX_PENALTY,
    MIN_GAIN,
    PROBE_SEQS,
    DraftPlanner,
    NgramDrafter,
    Proposal,
    StepCost,
    propose_drafts,
)
from tests.support.engine import collect, collect_choices, greedy, running_engine
from tests.support.scheduler_sim import config, make_seq

# A CPU-like step: the first token is cheap (one matrix-vector pass), each further one costs a
# third of it (this machine's bundled model: 1 token 6.5 ms, 8 tokens 34 ms, 32 tokens 85 ms).
CPU = {1: 0.0065, 2: 0.014, 4: 0.020, 8: 0.034, 16: 0.047, 32: 0.085, 64: 0.17}
# A GPU-like step: flat until the batch fills the device.
GPU = {1: 0.010, 64: 0.0105, 128: 0.011, 256: 0.020, 512: 0.040}


# ----------------------------------------------------------------------------- the default
def test_the_default_drafts_only_with_a_draft_model(tiny_model_path: Path) -> None:
    """SLOTQ_SPEC=auto must never be slower than off; n-gram drafts are not shown to keep that at
    every concurrency, so auto without a draft model is off, and n-gram lookup is asked for by name."""
    assert EngineConfig(model_path=tiny_model_path).spec == SpecMode.AUTO
    assert EngineConfig(model_path=tiny_model_path).spec_source == SpecMode.OFF
    assert EngineConfig(model_path=tiny_model_path, draft_model=tiny_model_path).spec_source == SpecMode.DRAFT
    assert EngineConfig(model_path=tiny_model_path, spec=SpecMode.NGRAM).spec_source == SpecMode.NGRAM


# ----------------------------------------------------------------------------- n-gram drafter
def test_ngram_drafts_what_followed_the_latest_occurrence_of_the_last_tokens() -> None:
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4])    # "2 3 4" was followed by "5 6 7 ..."
    proposal = drafter.propose(seq, 4)
    assert proposal.tokens == [5, 6, 7, 8] and proposal.n == 4
    seq.tokens += [5, 6]                                      # the copy goes on: the index follows it
    assert drafter.propose(seq, 3).tokens == [7, 8, 9]
    seq.tokens += [40, 41, 42, 5, 6]                          # "5 6" now occurred twice: the latest wins
    assert drafter.propose(seq, 2).tokens == [40, 41]


def test_ngram_prefers_the_longest_match_and_offers_nothing_without_one() -> None:
    drafter = NgramDrafter(n_min=2, n_max=4)
    seq = make_seq([9, 3, 4, 50, 7, 8, 3, 4, 60, 7, 8, 3, 4])   # "3 4" -> 60 most recently; "8 3 4" -> 60 too
    assert drafter.propose(seq, 1).tokens == [60]
    other = make_seq([1, 2, 3, 4, 5])
    assert drafter.propose(other, 8).n == 0
    drafter.forget(other)


def test_ngram_draft_stops_at_the_end_of_the_tokens() -> None:
    seq = make_seq([7, 7, 7, 7])                              # a loop drafts itself, up to what exists
    assert NgramDrafter().propose(seq, 16).tokens == [7]


def test_a_long_run_is_indexed_as_token_by_token_indexing_would() -> None:
    """The index takes a long run (a prompt) at once with numpy and a step's few tokens one by one:
    both give the same chains, so a prompt's index does not depend on how it arrived."""
    rng = random.Random(3)
    tokens = [rng.randrange(40) for _ in range(3000)]       # a small vocabulary: many repeats and collisions
    at_once, one_by_one = NgramDrafter(), NgramDrafter()
    whole, grown = make_seq(tokens), make_seq(tokens[:3])
    at_once.propose(whole, 8)
    for token in tokens[3:]:
        one_by_one.propose(grown, 8)
        grown.tokens.append(token)
    one_by_one.propose(grown, 8)
    a, b = at_once._indexes[whole], one_by_one._indexes[grown]
    assert a.indexed == b.indexed == len(tokens)
    assert a.prev == b.prev and (a.head == b.head).all()
    assert at_once.propose(whole, 8) == one_by_one.propose(grown, 8)


def test_the_ngram_index_stays_within_its_bound_and_takes_a_long_prompt_over_steps() -> None:
    """A 32k-token context: the index holds its 64 KiB table and 4 bytes a token (the tuple-keyed
    maps it replaced held several hundred), and one proposal indexes at most INDEX_CHUNK tokens."""
    rng = random.Random(5)
    seq = make_seq([rng.randrange(150_000) for _ in range(32_768)])
    drafter = NgramDrafter()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        drafter.propose(seq, 8)
        assert drafter._indexes[seq].indexed <= INDEX_CHUNK + drafter.n_min
        for _ in range(len(seq.tokens) // INDEX_CHUNK + 1):
            drafter.propose(seq, 8)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert drafter._indexes[seq].indexed == len(seq.tokens)
    bound = INDEX_TABLE_SIZE * 4 + 5 * len(seq.tokens) + 4096
    assert drafter.index_bytes(seq) <= bound and held <= bound, (drafter.index_bytes(seq), held)


def test_a_copy_far_back_is_found_past_recent_chance_matches() -> None:
    """The chain walk passes recent two-token matches to reach an older four-token one."""
    copied = [1, 2, 3, 4, 5, 6, 7]
    noise = [x for i in range(10) for x in (3, 4, 100 + i)]        # "3 4" ten times, each followed by another token
    seq = make_seq(copied + noise + [1, 2, 3, 4])
    proposal = NgramDrafter().propose(seq, 3)
    assert proposal.tokens == [5, 6, 7] and proposal.match == 4


# ----------------------------------------------------------------------------- step cost
def test_step_cost_interpolates_and_extrapolates_the_measured_sizes() -> None:
    cost = StepCost({1: 1.0, 4: 4.0, 8: 6.0}, overhead_s=0.5)
    assert cost.decode_seconds(4) == 4.0
    assert cost.decode_seconds(2) == pytest.approx(2.0)
    assert cost.decode_seconds(6) == pytest.approx(5.0)
    assert cost.decode_seconds(16) == pytest.approx(10.0)    # the last slope, on
    assert cost.step_seconds([8]) == 6.5


def test_a_step_is_costed_by_the_micro_batches_llama_cpp_runs() -> None:
    split = StepCost({1: 1.0, 64: 64.0}, ubatch=16)
    assert split.micro_batches([17, 9, 5, 1]) == [4, 12, 8, 8]    # split_equal: the same count from each stream
    assert split.micro_batches([9, 9, 9, 9]) == [16, 16, 4]       # at most ubatch tokens a run
    unified = StepCost({1: 1.0, 64: 64.0}, split_streams=False, ubatch=16)
    assert unified.micro_batches([17, 9, 5, 1]) == [16, 16]


def test_uneven_drafts_cost_more_than_even_ones_with_streams() -> None:
    """Measured on the bundled model (split streams, 2 cores): sequences of 17, 9, 5 and 1 tokens in one
    decode took as long as four of 17; the planner therefore gives every drafting sequence one room."""
    cost = StepCost(CPU)
    assert cost.step_seconds([17, 9, 5, 1]) > cost.step_seconds([8, 8, 8, 8])
    planner = DraftPlanner(cost, k_min=2, k_max=16)
    seqs = [make_seq(10) for _ in range(4)]
    for seq, hits in zip(seqs, (40, 39, 38, 37)):
        planner.observe(seq, 40, hits, match=32)
    rooms = planner.plan([(s, _free(16)) for s in seqs], prompt_lengths=[], n_generating=4, budget=500)
    assert len(set(rooms.values())) <= 1


def test_step_cost_follows_what_real_steps_take() -> None:
    cost = StepCost({1: 1.0, 8: 8.0}, rate=0.5)
    for _ in range(20):
        cost.observe([8], decode_s=16.0, step_s=17.0)
    assert cost.decode_seconds(8) > 15.0 and cost.decode_seconds(1) > 1.9     # the whole table moved, its shape kept
    assert cost.overhead_s == pytest.approx(1.0, rel=0.01)
    cost.observe([8], decode_s=1000.0)                                            # one stall moves it at most 4x * rate
    assert cost.decode_seconds(8) < 16.0 * 2.6


def test_a_noisy_measurement_never_makes_more_tokens_cheaper() -> None:
    cost = StepCost({1: 1.0, 2: 5.0, 4: 3.0, 8: 6.0})      # 2 tokens were timed while a neighbour was busy
    assert cost.decode_seconds(4) >= cost.decode_seconds(2) and cost.decode_seconds(3) >= cost.decode_seconds(2)


def test_calibration_times_powers_of_two() -> None:
    timed: list[int] = []

    def decode(n: int) -> float:
        timed.append(n)
        return n / 1000
    cost = StepCost.calibrate(decode, max_tokens=20, repeats=1)
    assert timed == [1, 2, 4, 8, 16] and cost.sizes == [1, 2, 4, 8, 16]


# ----------------------------------------------------------------------------- planner
def _free(n: int, match: int = 32) -> Proposal:
    """An offer whose tokens are known (an n-gram lookup, its copy agreeing over ``match`` tokens):
    it costs nothing to make."""
    return Proposal(n, list(range(n)), match=match)


def _copying(planner: DraftPlanner, seq: Sequence, tests: int = 40) -> None:
    planner.observe(seq, tests, tests, match=32)


def test_a_sequence_that_copies_drafts_on_a_cpu_and_one_that_misses_does_not() -> None:
    planner = DraftPlanner(StepCost(CPU), k_min=2, k_max=16)
    copier, free = make_seq(10), make_seq(10)
    _copying(planner, copier)
    planner.observe(free, 40, 8, match=2)
    offers = [(copier, _free(16)), (free, _free(16, match=2))]
    rooms = planner.plan(offers, prompt_lengths=[], n_generating=2, budget=500)
    assert rooms.get(copier, 0) >= 8 and free not in rooms


def test_a_compute_bound_cpu_step_gets_no_drafts() -> None:
    planner = DraftPlanner(StepCost(CPU), k_min=2, k_max=16)
    seqs = [make_seq(10) for _ in range(64)]
    for seq in seqs:
        planner.observe(seq, 40, 36, match=32)                # 90 % acceptance
    assert planner.plan([(s, _free(16)) for s in seqs], prompt_lengths=[], n_generating=64, budget=500) == {}


def test_a_gpu_step_drafts_until_the_batch_is_full() -> None:
    planner = DraftPlanner(StepCost(GPU), k_min=2, k_max=8)
    seqs = [make_seq(10) for _ in range(16)]
    for seq in seqs:
        planner.observe(seq, 40, 28, match=32)                # 70 %: too low to pay on the CPU above
    rooms = planner.plan([(s, _free(8)) for s in seqs], prompt_lengths=[], n_generating=16, budget=500)
    assert len(rooms) == 16 and all(k >= 4 for k in rooms.values())
    assert sum(rooms.values()) <= 128 - 16 + 8                # it stopped where the step's cost starts to climb


def test_the_plan_keeps_the_budget_k_min_and_the_offer() -> None:
    planner = DraftPlanner(StepCost(GPU), k_min=3, k_max=8)
    a, b = make_seq(10), make_seq(10)
    _copying(planner, a)
    _copying(planner, b)
    # b's offer is below k_min
    assert planner.plan([(a, _free(8)), (b, _free(2))], prompt_lengths=[], n_generating=2, budget=500) == {a: 8}
    assert sum(planner.plan([(a, _free(8)), (b, _free(8))], prompt_lengths=[], n_generating=2, budget=6).values()) <= 6
    assert planner.plan([(a, _free(8))], prompt_lengths=[], n_generating=2, budget=2) == {}


def test_a_draft_models_time_counts_against_its_drafts() -> None:
    def planner(draft_ms: float) -> DraftPlanner:
        p = DraftPlanner(StepCost(GPU), k_min=2, k_max=8, draft_seconds=lambda depth, n: depth * draft_ms / 1000)
        p.observe(seq, 40, 40)        # a draft model's proposals copy nothing: match 0
        return p
    seq = make_seq(10)
    assert planner(0.5).plan([(seq, Proposal(8))], prompt_lengths=[], n_generating=1, budget=64) == {seq: 8}
    assert planner(20).plan([(seq, Proposal(8))], prompt_lengths=[], n_generating=1, budget=64) == {}
    assert planner(20).plan([(seq, _free(8))], prompt_lengths=[], n_generating=1, budget=64) == {seq: 8}


def test_a_plan_promises_at_least_min_gain() -> None:
    # a step twice as long for one more expected token at 1 client: 1.5 / 2 < 1 / 1 * MIN_GAIN
    planner = DraftPlanner(StepCost({1: 1.0, 2: 2.0, 3: 3.0}), k_min=1, k_max=2)
    seq = make_seq(10)
    planner.observe(seq, 40, 20, match=32)
    assert planner.plan([(seq, _free(2))], prompt_lengths=[], n_generating=1, budget=8) == {}
    assert MIN_GAIN > 1


def test_acceptance_is_learned_by_how_long_the_copy_has_agreed() -> None:
    """Long agreement predicts a copy (a sequence copying its prompt); a chance two-token match does
    not. A new sequence starts from what the model's proposals of that agreement did, and a
    sequence's own misses lower its estimate at any agreement."""
    planner = DraftPlanner(StepCost(CPU), prior=0.5)
    seen = make_seq(10)
    assert planner.acceptance(seen, match=40) == 0.5
    planner.observe(seen, 100, 98, match=40)
    planner.observe(seen, 100, 20, match=2)
    fresh = make_seq(10)
    assert planner.acceptance(fresh, match=33) > 0.9 and planner.acceptance(fresh, match=3) < 0.3
    missing = make_seq(10)
    planner.observe(missing, 30, 3, match=40)
    assert planner.acceptance(missing, match=40) < 0.5
    planner.forget(missing)
    assert planner.acceptance(missing, match=40) == planner.acceptance(fresh, match=40)


def test_ngram_proposals_say_how_long_their_copy_agreed() -> None:
    seq = make_seq([5, 1, 2, 3, 4, 9, 9, 0, 1, 2, 3, 4])     # "1 2 3 4" agrees, "5" vs "0" does not
    proposal = NgramDrafter().propose(seq, 2)
    assert proposal.tokens == [9, 9] and proposal.match == 4


class _CountedCost(StepCost):
    """A real step cost that counts the step prices asked of it: what a plan costs."""

    prices = 0

    def step_seconds_of(self, counts: dict[int, int]) -> float:
        self.prices += 1
        return super().step_seconds_of(counts)


def test_the_planner_declines_cheaply_at_high_concurrency() -> None:
    """256 copying sequences on a CPU: no draft pays (the step is compute-bound). The first full plan
    finds that; afterwards a step offers only PROBE_SEQS sequences to the drafter and prices a few
    plans, not every (sequences, room) pair, while the probes keep shadow tests going."""
    cost = _CountedCost(CPU)
    planner = DraftPlanner(cost, k_min=2, k_max=32)
    drafter = NgramDrafter()
    seqs = [make_seq([i % 50 for i in range(200)] + [0]) for _ in range(256)]      # each copies its own loop
    for seq in seqs:
        seq.n_prompt, seq.n_computed = 200, 200          # one token generated: it decodes
        _copying(planner, seq)
    offered, prices = [], []
    for _ in range(100):
        cost.prices = 0
        proposals = propose_drafts(drafter, planner, seqs, 4096)
        assert planner.plan(list(proposals.items()), prompt_lengths=[], n_generating=256, budget=2048) == {}
        offered.append(len(proposals))
        prices.append(cost.prices)
        for seq in seqs:
            seq.tokens.append(seq.tokens[-50])
            seq.n_computed += 1
    assert offered[0] == 256 and prices[0] > 100                 # the first step prices it in full
    full = [i for i, n in enumerate(offered) if n > PROBE_SEQS]
    assert len(full) <= 4, full                                  # then at growing intervals (16, 32, 64 steps)
    assert sum(prices) < 8 * prices[0], prices                    # 100 steps cost less than 8 full plans
    assert max(n for n in offered[1:]) <= 256 and min(offered) == PROBE_SEQS


def test_the_planner_backs_off_where_steps_with_drafts_realise_less() -> None:
    """One sequence on a flat (GPU-like) step: drafts pay on paper. Measured, steps with drafts
    deliver fewer tokens per second than steps without (their tokens' delivery costs what the table
    does not see): the required gain rises until the plan stops drafting, and it falls back once
    drafted steps realise more."""
    planner = DraftPlanner(StepCost(GPU, rate=0.0), k_min=2, k_max=8)
    seq = make_seq(10)
    planner.observe(seq, 40, 26, match=32)                      # 65 %: pays on the table
    assert planner.plan([(seq, _free(8))], prompt_lengths=[], n_generating=1, budget=64)
    now = 0.0
    for i in range(400):
        drafted = i % 2 == 1
        seconds = 0.050 if drafted else 0.010                    # 3 tokens in 50 ms against 1 in 10 ms
        step_s = 0.020 if drafted else 0.009                     # (the rest of the period: their delivery)
        planner.observe_step([4 if drafted else 1], step_s, step_s, started=now, n_generating=1,
                             tokens=3 if drafted else 1, drafted=drafted)
        now += seconds
    assert planner.required_gain(1) > 2 * MIN_GAIN
    assert planner.plan([(seq, _free(8))], prompt_lengths=[], n_generating=1, budget=64) == {}
    assert planner.required_gain(64) == MIN_GAIN                 # another concurrency keeps its own record
    for i in range(400):
        drafted = i % 2 == 1
        planner.observe_step([4 if drafted else 1], 0.009, 0.009, started=now, n_generating=1,
                             tokens=6 if drafted else 1, drafted=drafted)
        now += 0.010
    assert planner.required_gain(1) < MIN_GAIN * 1.2 and planner.required_gain(1) <= MIN_GAIN * MAX_PENALTY


def test_an_idle_gap_prices_nothing() -> None:
    planner = DraftPlanner(StepCost(GPU, rate=0.0))
    for i in range(200):
        planner.observe_step([1], 0.009, 0.009, started=i * 1.0, n_generating=1, tokens=3, drafted=i % 2 == 1)
    assert planner.required_gain(1) == MIN_GAIN                  # every period was mostly waiting for work


# ----------------------------------------------------------------------------- scheduler rule 9
def _decoding_scheduler(max_new: int = 50) -> tuple[Scheduler, DraftPlanner, Sequence]:
    planner = DraftPlanner(StepCost(GPU), k_min=2, k_max=8)
    s = Scheduler(config(n_slots=2, n_batch=64, prefill_chunk=16), drafts=planner)
    seq = make_seq(5, max_new=max_new)
    s.add(seq)
    out = s.schedule()
    s.commit(out)
    seq.tokens.append(7)                                      # its first token: it decodes from now on
    _copying(planner, seq)
    return s, planner, seq


def test_drafts_go_only_to_generating_sequences_after_the_prompts() -> None:
    s, _, seq = _decoding_scheduler()
    newcomer = make_seq(30)
    s.add(newcomer)
    out = s.schedule({seq: _free(8), newcomer: _free(8)})
    decode, prefill = out.items
    assert decode.seq is seq and decode.draft_room == 8 and decode.n_tokens == 1    # the runner fills it
    assert prefill.seq is newcomer and prefill.draft_room == 0 and prefill.n_tokens == 16
    decode.set_draft(list(range(100, 120)))
    assert decode.draft == list(range(100, 108)) and decode.n_tokens == 9


def test_a_sequence_never_drafts_past_its_max_tokens() -> None:
    s, _, seq = _decoding_scheduler(max_new=4)               # 1 generated: 3 more at most, 1 sampled for sure
    out = s.schedule({seq: _free(8)})
    assert out.items[0].draft_room == 2


def test_settling_forgets_the_rejected_drafts_cells() -> None:
    s, _, seq = _decoding_scheduler()
    out = s.schedule({seq: _free(8)})
    item = out.items[0]
    item.set_draft([11, 12, 13, 14])
    s.commit(out)
    assert seq.n_computed == 10 and s.ledger.used_cells() == 10      # 5 prompt + 1 token + 4 drafts
    seq.tokens += [11, 12, 99]                                         # two drafts kept, then a different token
    assert s.settle_drafts(seq) == 2
    assert seq.n_computed == 8 == len(seq.tokens) - 1 and s.ledger.used_cells() == 8
    assert s.settle_drafts(seq) == 0
    assert s.prompt_tokens_computed == 5                               # drafts are not prompt


def test_a_kv_full_decode_with_drafts_drops_them_until_a_sequence_finishes() -> None:
    s, _, seq = _decoding_scheduler()
    out = s.schedule({seq: _free(8)})
    out.items[0].set_draft([1, 2, 3])
    assert s.on_kv_full(out) == KVFullAction.DROPPED_DRAFTS
    assert s.schedule({seq: _free(8)}).items[0].draft_room == 0
    other = make_seq(3)
    s.add(other)
    s.schedule()
    s.finish(other)
    assert s.schedule({seq: _free(8)}).items[0].draft_room == 8


# ----------------------------------------------------------------------------- verification on llama.cpp
COPY_TEXT = ("The committee met on Tuesday to review the budget for the new library. Members agreed that the "
             "reading room needs better lighting, that the children's section should move to the ground floor, "
             "and that the archive must be digitised before the end of next year.")
COPY_PROMPTS = [f"{verb} this text{how}:\n\n{COPY_TEXT}" for verb in ("Copy", "Repeat", "Rewrite", "Quote")
                for how in ("", " exactly", " word for word", " with one change", " in full")]
FREE_PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
                "List five uses of salt.", "What makes a good cup of tea?", "Describe the moon to a child."]


def _chat(prompt: str, max_tokens: int, **kw: object) -> GenerationRequest:
    return GenerationRequest(messages=[ChatMessage(role="user", content=prompt)], max_tokens=max_tokens,
                             **{"sampling": SamplingParams(temperature=0.0), **kw})  # type: ignore[arg-type]


async def _outputs(path: Path, spec: str, requests: list[GenerationRequest], **config: object) \
        -> tuple[list[tuple[str, list[int], list[Finished]]], EngineStats]:
    async with running_engine(path, spec=spec, **{"slots": 1, "ctx": 1024, **config}) as engine:
        _flat_step_cost(engine)
        results = await asyncio.gather(*(collect(engine.submit(r)) for r in requests))
        stats = engine.stats()
    return list(results), stats


def _flat_step_cost(engine: Engine) -> None:
    """Verification is under test here, not the policy: a step cost as flat as a GPU's (and fixed,
    whatever this machine's load) makes the planner send every draft it can."""
    if engine.scheduler.drafts is not None:
        engine.scheduler.drafts.cost = StepCost(GPU, rate=0.0)


async def test_on_the_tiny_model_drafts_are_rejected_the_planner_backs_off_and_output_is_unchanged(
        tiny_model_path: Path) -> None:
    """The tiny random model never continues what came before, so each n-gram draft is rejected: its
    greedy tokens are the same with drafts as without (rejected drafts' cells are forgotten), and the
    planner, learning each sequence's misses, soon stops sending drafts even on a flat step cost."""
    prompts = ["abc abc abc abc abc abc abc", "the cat the cat the cat the cat", "one two one two one two"]
    requests = [greedy(p, 300) for p in prompts]
    plain, _ = await _outputs(tiny_model_path, "off", requests)
    spec, stats = await _outputs(tiny_model_path, "ngram", requests)
    assert [tokens for _, tokens, _ in spec] == [tokens for _, tokens, _ in plain]
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens <= stats.spec_draft_tokens // 4, stats
    assert stats.spec_draft_tokens < stats.generated_tokens // 20, stats


@pytest.mark.real_model
async def test_greedy_output_is_identical_with_and_without_speculation(real_model_path: Path) -> None:
    """11 prompts on the bundled model: 8 that copy a text (drafts are accepted) and 3 free ones.
    Every token and finish reason is the same, and drafts were kept. One slot, so
    that the only difference between the runs is the drafts: sequences batched together may flip a
    near-tie of the quantized model with or without drafts (test_real_model.py,
    test_batched_equals_alone_on_the_real_model), while a sequence's own draft rows give exactly
    the logits its one-token steps would."""
    requests = [_chat(p, 120) for p in COPY_PROMPTS[:15:2] + FREE_PROMPTS[:3]]
    plain, plain_stats = await _outputs(real_model_path, "off", requests)
    spec, stats = await _outputs(real_model_path, "ngram", requests)
    assert plain_stats.spec_draft_tokens == 0 and stats.spec_accepted_tokens > 100, stats
    # A stream's speed (the elastic controller's signal) counts every token its steps gave it, kept drafts
    # included: all tokens but each request's first, which its prompt's step gave (one slot: no decode beside it).
    assert plain_stats.stream_tokens == plain_stats.generating_steps == plain_stats.generated_tokens - len(requests)
    assert stats.stream_tokens == stats.generated_tokens - len(requests) > stats.generating_steps + 100
    for request, (p_text, p_tokens, p_fin), (s_text, s_tokens, s_fin) in zip(requests, plain, spec):
        assert s_tokens == p_tokens, (request.messages, p_text, s_text)
        assert s_text == p_text
        assert [f.finish_reason for f in s_fin] == [f.finish_reason for f in p_fin]
        assert s_fin[0].usage == p_fin[0].usage


@pytest.mark.real_model
async def test_what_a_request_asks_for_holds_under_speculation(real_model_path: Path) -> None:
    """Stop strings, max_tokens, logprobs, a JSON schema, n > 1 and seeded sampling: each gives the
    same stream with drafts as without (a stop string or the length limit inside a run of accepted
    drafts cuts it there; a seeded sampler draws one number per delivered token either way)."""
    requests = [
        _chat(f"Copy this text exactly:\n\n{COPY_TEXT}", 200, stop=["ground floor"]),
        _chat(f"Copy this text exactly:\n\n{COPY_TEXT}", 23),
        _chat(f"Copy this text exactly:\n\n{COPY_TEXT}", 40, logprobs=3),
        _chat(f"Copy this text exactly:\n\n{COPY_TEXT}", 60,
              sampling=SamplingParams(temperature=0.8, seed=7)),
        _chat(f"Give the budget fields of this text as JSON:\n\n{COPY_TEXT}", 80,
              sampling=SamplingParams(temperature=0.0, json_schema={
                  "type": "object", "properties": {"topic": {"type": "string"}, "rooms": {"type": "array",
                                                                                       "items": {"type": "string"}}},
                  "required": ["topic", "rooms"]})),
    ]
    plain, _ = await _outputs(real_model_path, "off", requests)
    spec, stats = await _outputs(real_model_path, "ngram", requests)
    assert stats.spec_draft_tokens > 0
    for (p_text, p_tokens, p_fin), (s_text, s_tokens, s_fin) in zip(plain, spec):
        assert (s_text, s_tokens) == (p_text, p_tokens)
        assert [f.finish_reason for f in s_fin] == [f.finish_reason for f in p_fin]
    assert plain[0][0].endswith("children's section should move to the") or "ground floor" not in plain[0][0]
    assert spec[1][2][0].finish_reason == FinishReason.LENGTH and len(spec[1][1]) == 23

    prompt = f"Copy this text exactly:\n\n{COPY_TEXT}"
    n_request = _chat(prompt, 50, n=3, sampling=SamplingParams(temperature=0.7, seed=3))
    async with running_engine(real_model_path, spec="off", slots=4, ctx=1024) as engine:
        plain_choices, _ = await collect_choices(engine.submit(n_request))
    async with running_engine(real_model_path, spec="ngram", slots=4, ctx=1024) as engine:
        _flat_step_cost(engine)
        spec_choices, _ = await collect_choices(engine.submit(n_request))
    assert {i: c.token_ids for i, c in spec_choices.items()} == {i: c.token_ids for i, c in plain_choices.items()}


@pytest.mark.real_model
async def test_a_resumed_request_continues_the_same_under_speculation(real_model_path: Path) -> None:
    """A job resumed from 30 delivered tokens (a worker died) drafts from its prompt and those
    tokens at once, and finishes with the tokens the uninterrupted run made."""
    prompt = f"Copy this text exactly:\n\n{COPY_TEXT}"
    whole, _ = await _outputs(real_model_path, "off", [greedy(prompt, 80)])
    tokens = whole[0][1]
    resumed, stats = await _outputs(real_model_path, "ngram", [greedy(prompt, 80, resume_tokens=tokens[:30])])
    assert tokens[:30] + resumed[0][1] == tokens
    assert stats.spec_accepted_tokens > 0
