"""The draft model drafter (engine/draft_model.py, SLOTQ_DRAFT_MODEL) on the bundled SmolLM2-135M-Instruct:
drafts are the draft model's own greedy continuation of each sequence's tokens, whatever the slot held before,
and a model with another vocabulary is refused at start."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotq.engine import EngineConfig
from slotq.engine.draft_model import MAX_VOCAB_PADDING, PROBE_AFTER, DraftModelDrafter, DraftModelMismatch
from slotq.engine.llama_model import LlamaModel
from slotq.engine.sequence import SeqState, Sequence
from tests.support.engine import collect, running_engine
from tests.support.engine import greedy as greedy_request
from tests.support.tiny_model import write_draft_model

pytestmark = pytest.mark.real_model

CTX = 256
DRAFT_BATCH = 16        # the drafter's n_batch: a prompt's catch-up takes several decodes


def drafter_config(target_path: Path, draft_path: Path) -> EngineConfig:
    return EngineConfig(model_path=target_path, draft_model=draft_path, slots=3, cache_slots=1, ctx=CTX,
                        batch=DRAFT_BATCH, threads=1)


@pytest.fixture(scope="module")
def target(real_model_path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(EngineConfig(model_path=real_model_path, slots=3, cache_slots=1, ctx=CTX, threads=1))
    yield model
    model.close()


@pytest.fixture(scope="module")
def draft_alone(draft_model_path: Path) -> Iterator[LlamaModel]:
    """The draft model in a context of its own, one sequence at a time: what its drafts must equal."""
    model = LlamaModel(EngineConfig(model_path=draft_model_path, slots=1, cache_slots=0, ctx=CTX, threads=1))
    yield model
    model.close()


@pytest.fixture(scope="module")
def drafter(real_model_path: Path, draft_model_path: Path, target: LlamaModel) -> Iterator[DraftModelDrafter]:
    """One for the module: each test's drafts must be right whatever the slots hold from the tests before."""
    made = DraftModelDrafter(drafter_config(real_model_path, draft_model_path), target)
    made.prepare()          # the engine thread's first work (it times the draft decodes)
    yield made
    made.close()


def greedy(model: LlamaModel, tokens: list[int], n: int, vocabulary: int | None = None) -> list[int]:
    """``n`` argmax tokens (among the first ``vocabulary`` ids) after ``tokens``, decoded alone in sequence 0."""
    model.kv_remove(0)
    assert model.decode(tokens, range(len(tokens)), [0] * len(tokens), [False] * (len(tokens) - 1) + [True]) == 0
    out = [int(model.logits_row(len(tokens) - 1)[:vocabulary].argmax())]
    while len(out) < n:
        assert model.decode([out[-1]], [len(tokens) + len(out) - 1], [0], [True]) == 0
        out.append(int(model.logits_row(0)[:vocabulary].argmax()))
    model.kv_remove(0)
    return out


def running(model: LlamaModel, text: str, slot: int) -> Sequence:
    tokens = model.tokenize(text)
    seq = Sequence(f"request-{slot}-{text[:8]}", tokens, n_prompt=len(tokens), max_new_tokens=64)
    seq.seq_id, seq.state = slot, SeqState.RUNNING
    return seq


def test_drafts_for_sequences_of_different_lengths_in_one_batch(drafter: DraftModelDrafter, target: LlamaModel,
                                                                  draft_alone: LlamaModel) -> None:
    """Each draft is the draft model's greedy continuation, as if decoded alone. The catch-up of both prompts
    (more tokens than one draft batch holds) shares decodes, and then each depth is one decode for every
    sequence still drafting: 34 prompt tokens take 3 decodes of up to 16 (the last two give each sequence its
    first token), depths 2..5 take 4 more, the short draft dropping out after its third."""
    long_seq = running(target, "Rewrite this sentence with one change: the quick brown fox jumps over the lazy "
                               "dog while the cat sleeps on the warm windowsill.", slot=0)
    short_seq = running(target, "The capital of France is", slot=3)      # the cache slot (a reserve job's)
    assert len(long_seq.tokens) + len(short_seq.tokens) == 34

    decodes = []
    real_decode = drafter.model.decode

    def counted(*args: object, **kwargs: object) -> int:
        decodes.append(len(args[0]))                             # type: ignore[arg-type]
        return real_decode(*args, **kwargs)                      # type: ignore[arg-type]

    drafter.model.decode = counted                               # type: ignore[method-assign]
    assert drafter.propose(long_seq, 5).n == 5 and drafter.propose(long_seq, 5).tokens is None
    drafts = drafter.draft([(long_seq, 5), (short_seq, 3)])
    assert drafts == [greedy(draft_alone, long_seq.tokens, 5), greedy(draft_alone, short_seq.tokens, 3)]
    assert decodes == [16, 16, 2, 2, 2, 1, 1]
    assert 0 < drafter.draft_seconds(1, 2) < drafter.draft_seconds(4, 2) and drafter.draft_seconds(0, 2) == 0


def test_after_verification_the_draft_continues_what_the_target_kept(drafter: DraftModelDrafter,
                                                                     target: LlamaModel,
                                                                     draft_alone: LlamaModel) -> None:
    """The target kept two draft tokens and sampled another third one: the draft KV drops the cells past
    them (the rejected drafts) and drafts on from the target's token."""
    seq = running(target, "Once upon a time, in a small village,", slot=1)
    first = drafter.draft([(seq, 5)])[0]
    own_token = next(t for t in range(100, 200) if t != first[2])
    seq.tokens += first[:2] + [own_token]
    assert drafter.draft([(seq, 4)]) == [greedy(draft_alone, seq.tokens, 4)]
    seq.tokens += greedy(draft_alone, seq.tokens, 4) + [own_token]    # every draft kept, and one token more
    assert drafter.draft([(seq, 4)]) == [greedy(draft_alone, seq.tokens, 4)]


def test_a_reused_slot_drafts_for_its_new_sequence(drafter: DraftModelDrafter, target: LlamaModel,
                                                   draft_alone: LlamaModel) -> None:
    """The slot's next sequence shares the start of the chat template with the one before (kept) and not
    the rest (dropped)."""
    before = running(target, "<|im_start|>user\nName three rivers in Europe.<|im_end|>", slot=2)
    drafter.draft([(before, 6)])
    drafter.forget(before)
    after = running(target, "<|im_start|>user\nWhat is two plus two?<|im_end|>", slot=2)
    assert drafter.draft([(after, 6)]) == [greedy(draft_alone, after.tokens, 6)]
    shorter = running(target, "<|im_start|>user\nWhat is", slot=2)     # all of it is held already
    assert drafter.draft([(shorter, 3)]) == [greedy(draft_alone, shorter.tokens, 3)]


def test_untested_drafts_get_a_probe(drafter: DraftModelDrafter, target: LlamaModel,
                                     draft_alone: LlamaModel) -> None:
    """A sequence the planner sends no drafts to is offered k_min drafted tokens now and then, so the runner's
    shadow test keeps measuring a draft model whose acceptance fell (the planner would never test it again)."""
    seq = running(target, "The three primary colors are", slot=0)
    for _ in range(PROBE_AFTER):
        assert drafter.propose(seq, 8).tokens is None
    probe = drafter.propose(seq, 8)
    assert probe.tokens == greedy(draft_alone, seq.tokens, 2) and probe.n == 2     # spec_k_min
    assert drafter.propose(seq, 8).tokens is None


def test_the_served_model_drafting_for_itself_drafts_its_greedy_continuation(real_model_path: Path,
                                                                            target: LlamaModel) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):\n    if n"]
    seqs = [running(target, prompt, slot) for slot, prompt in enumerate(prompts)]
    drafter = DraftModelDrafter(drafter_config(real_model_path, real_model_path), target)
    try:
        drafts = drafter.draft([(seq, 6) for seq in seqs])
    finally:
        drafter.close()
    assert drafts == [greedy(target, seq.tokens, 6) for seq in seqs]


def test_a_draft_model_that_is_no_gguf_is_refused_naming_the_setting(tmp_path: Path, real_model_path: Path,
                                                                     target: LlamaModel) -> None:
    not_a_model = tmp_path / "draft.gguf"
    not_a_model.write_text("not a model")
    with pytest.raises(RuntimeError, match=f"^SLOTQ_DRAFT_MODEL {not_a_model}: llama.cpp could not load"):
        DraftModelDrafter(drafter_config(real_model_path, not_a_model), target)


def test_a_draft_model_with_another_vocabulary_is_refused(real_model_path: Path, tiny_model_path: Path,
                                                          target: LlamaModel) -> None:
    with pytest.raises(DraftModelMismatch) as refused:
        DraftModelDrafter(drafter_config(real_model_path, tiny_model_path), target)
    assert str(refused.value).startswith(f"SLOTQ_DRAFT_MODEL {tiny_model_path}: its vocabulary (286 tokens) is not "
                                         "the served model's (49152)")


def test_a_padded_vocabulary_drafts_only_ids_the_served_model_has(tmp_path: Path, real_model_path: Path,
                                                                  target: LlamaModel) -> None:
    """Sizes of one family pad the vocabulary differently (Qwen2.5 0.5B and 7B): up to 128 more tokens are
    accepted, as llama.cpp does, and drafts stay among the served model's ids though this model's padding
    always wins the whole row's argmax. One more token is refused."""
    padded = write_draft_model(tmp_path / "padded.gguf", padded_to=target.n_vocab + MAX_VOCAB_PADDING)
    drafter = DraftModelDrafter(drafter_config(real_model_path, padded), target)
    alone = LlamaModel(EngineConfig(model_path=padded, slots=1, cache_slots=0, ctx=CTX, threads=1))
    try:
        seq = running(target, "The capital of France is", slot=0)
        assert drafter.draft([(seq, 4)]) == [greedy(alone, seq.tokens, 4, vocabulary=target.n_vocab)]
        assert greedy(alone, seq.tokens, 1)[0] >= target.n_vocab
    finally:
        alone.close()
        drafter.close()
    too_big = write_draft_model(tmp_path / "too_big.gguf", padded_to=target.n_vocab + MAX_VOCAB_PADDING + 1)
    with pytest.raises(DraftModelMismatch, match=r"its vocabulary \(49281 tokens\) is not the served model's "
                                                 r"\(49152\)"):
        DraftModelDrafter(drafter_config(real_model_path, too_big), target)


def test_a_draft_model_whose_token_means_another_text_is_refused(tmp_path: Path, real_model_path: Path,
                                                                 target: LlamaModel) -> None:
    renamed = write_draft_model(tmp_path / "renamed.gguf", renamed={1000: "\u0120slotq"})
    with pytest.raises(DraftModelMismatch) as refused:
        DraftModelDrafter(drafter_config(real_model_path, renamed), target)
    assert str(refused.value).startswith(f"SLOTQ_DRAFT_MODEL {renamed}: its token 1000 is 'Ġslotq' where the served "
                                         f"model's is {target.token_text(1000)!r}")


async def test_an_engine_drafting_with_a_draft_model_serves_the_same_greedy_tokens(real_model_path: Path) -> None:
    """The engine with SLOTQ_SPEC=draft and the served model as its own draft model gives every request the
    tokens it gets without speculation (one slot: the drafts are the only difference). Its probes are
    accepted, so the planner learns to send drafts; whether a draft pays depends on this machine's step times,
    so the test counts them but does not require them."""
    requests = [greedy_request("Copy this text exactly: the committee met on Tuesday to review the budget.", 40),
                greedy_request("The capital of France is", 24), greedy_request("def fibonacci(n):", 32)]

    async def tokens(**spec: object) -> tuple[list[list[int]], int, int]:
        async with running_engine(real_model_path, slots=1, **spec) as engine:
            results = await asyncio.gather(*(collect(engine.submit(request)) for request in requests))
            stats = engine.stats()
        return [result[1] for result in results], stats.spec_draft_tokens, stats.spec_accepted_tokens

    plain, _, _ = await tokens(spec="off")
    drafted_tokens, drafted, accepted = await tokens(spec="draft", draft_model=real_model_path)
    assert drafted_tokens == plain and accepted <= drafted
