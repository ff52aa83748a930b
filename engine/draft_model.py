"""A draft model (``SLOTQ_DRAFT_MODEL``): a second, small GGUF with the served model's vocabulary
drafts greedily for every sequence that got room, in one batch of its own.

The draft context has a KV stream per slot of the target (same ``n_seq_max``, same per-sequence
context, split layout), and remembers which tokens each stream holds. :meth:`DraftModelDrafter.draft`
first brings each wanted slot up to its sequence's tokens: the cells past the common prefix go
(the target rejected a draft, or the slot now runs another sequence) and the missing tokens are
decoded, every sequence's together in as few ``llama_decode`` calls as ``n_batch`` allows. The
logits of each sequence's last token give its first draft token; then one ``llama_decode`` per
depth, one token per sequence, gives the next, until each has the ``n`` it asked for (or drafted
an end-of-generation token). Greedy: the argmax of the draft's logits row. The last draft token is
never decoded: the next call's catch-up decodes whatever the target kept.

A draft costs draft-model decodes, so the planner weighs :meth:`~DraftModelDrafter.draft_seconds`,
measured at start and kept current from every draft step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

from slotq.engine.config import EngineConfig, KVLayout
from slotq.engine.llama_model import ContextShape, LlamaModel
from slotq.engine.sequence import Sequence
from slotq.engine.speculation import Proposal, StepCost

log = logging.getLogger(__name__)

MAX_VOCAB_PADDING = 128
"""Token counts may differ by this much, as llama.cpp's own check allows (``SPEC_VOCAB_MAX_SIZE_DIFFERENCE``):
sizes of one family pad the vocabulary to different lengths (Qwen2.5 0.5B has 151,936 tokens, 7B 152,064). Drafts
use only the ids both have."""

VOCAB_CHECK_FROM = 5
"""Token texts are compared from this id on, as llama.cpp does: conversions name the first few control tokens
differently (the BOS and EOS ids are compared by id)."""

DRAFT_PRIOR = 0.6
"""Why 0.6: a draft model of the served model's family usually agrees with its greedy choice on well over half of
the tokens. Where a step's cost is flat (a GPU batch that is not full) 0.6 drafts from the first step, and
verification replaces the prior within a few steps (the planner counts it as 2 observations), so a draft model that
misses (another family, random weights) stops soon. Where each token costs (a CPU: the bundled model's steps of 1,
4 and 8 tokens take about 6.5, 20 and 34 ms) a draft pays only from an acceptance near 0.9, which no prior should
promise: there the probes (below) are what start drafting, once they find the draft model right."""

PROBE_AFTER = 16
"""A running slot whose drafts went untested for this many proposals gets a probe: :meth:`DraftModelDrafter.propose`
drafts ``spec_k_min`` tokens itself and offers them with their tokens. The planner then either sends them (a real
test) or leaves them out, and the runner compares them with the token it sampled (a shadow test, as for n-gram
lookups). Without probes a draft model whose acceptance fell below what pays would never be tested again, though
the workload may have changed (a reply that starts quoting its prompt)."""

PROBE_SHARE = 0.02
"""Probes may take at most this share of the engine's time (a credit that accrues with wall time), so where drafting
does not pay (a compute-bound batch, a draft model that misses) they cost at most 2 %."""

PROBE_CREDIT_CAP_S = 0.05
"""The most probe time that accrues while the engine idles, so a busy step after an idle hour is not all probes."""


class DraftModelMismatch(ValueError):
    """The draft model cannot draft for the served model: its token ids mean other texts."""


def vocabulary_mismatch(target: LlamaModel, draft: LlamaModel) -> str | None:
    """Why ``draft``'s token ids do not mean what ``target``'s do, or None when they do (llama.cpp's
    rule for draft models: sizes within :data:`MAX_VOCAB_PADDING`, the same BOS and EOS ids, the same
    text for every shared id from :data:`VOCAB_CHECK_FROM` on)."""
    if abs(draft.n_vocab - target.n_vocab) > MAX_VOCAB_PADDING:
        return f"its vocabulary ({draft.n_vocab} tokens) is not the served model's ({target.n_vocab})"
    if (draft.bos_token, draft.eos_token) != (target.bos_token, target.eos_token):
        return (f"its BOS/EOS tokens ({draft.bos_token}, {draft.eos_token}) are not the served model's "
                f"({target.bos_token}, {target.eos_token})")
    for token in range(VOCAB_CHECK_FROM, min(draft.n_vocab, target.n_vocab)):
        theirs, ours = draft.token_text(token), target.token_text(token)
        if theirs != ours:
            return f"its token {token} is {theirs!r} where the served model's is {ours!r}"
    return None


def _common_prefix(a: Tokens[int], b: Tokens[int], start: int = 0) -> int:
    """The length of the common prefix of ``a`` and ``b``, known to be at least ``start``."""
    n = min(len(a), len(b))
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _SlotKV:
    """What one slot's draft KV holds."""

    tokens: list[int] = field(default_factory=list)     # the tokens its cells hold, from position 0
    seq: Sequence | None = None     # the sequence that drafted here last ...
    known: int = 0                  # ... whose first ``known`` tokens are in ``tokens``: a running sequence's
    #                                 tokens only grow, so the catch-up compares only what came after them
    untested: int = 0               # proposals since this slot's drafts were last made


class DraftModelDrafter:
    """The :class:`~slotq.engine.speculation.Drafter` of ``spec=draft``: drafts with ``config.draft_model``.
    Engine thread only (built before the engine thread starts); :meth:`close` frees its context."""

    prior = DRAFT_PRIOR

    def __init__(self, config: EngineConfig, target: LlamaModel) -> None:
        if config.draft_model is None:
            raise ValueError("DraftModelDrafter needs draft_model (SLOTQ_DRAFT_MODEL)")
        self.path = config.draft_model
        n_seq = target.info.n_seq_max
        n_batch = max(config.batch, n_seq)          # a depth decodes one token of every slot at once
        shape = ContextShape(n_ctx=n_seq * config.ctx, n_batch=n_batch, n_ubatch=min(config.ubatch, n_batch),
                             n_seq_max=n_seq, kv_layout=KVLayout.SPLIT)
        try:
            self.model = LlamaModel(config.model_copy(update={"model_path": self.path, "draft_model": None}), shape)
        except RuntimeError as exc:
            raise RuntimeError(f"SLOTQ_DRAFT_MODEL {self.path}: {exc}") from exc
        try:
            mismatch = vocabulary_mismatch(target, self.model)
            if mismatch is not None:
                raise DraftModelMismatch(
                    f"SLOTQ_DRAFT_MODEL {self.path}: {mismatch}; a draft model must share the vocabulary of the "
                    f"served model ({target.info.model_name})")
            self.n_shared_vocab = min(self.model.n_vocab, target.n_vocab)   # drafts are ids the target knows
            self.probe_tokens = max(config.spec_k_min, 1)
            self._slots: dict[int, _SlotKV] = {}
            self._probe_credit, self._credit_at = 0.0, time.monotonic()
            self._n_seq = n_seq
            self.cost = StepCost({1: 0.0})            # timed by prepare(), on the engine thread
        except BaseException:
            self.model.close()
            raise

    # ------------------------------------------------------------ the Drafter protocol
    def prepare(self) -> None:
        """Time one draft decode per sequence count (engine thread: see Drafter.prepare)."""
        self._timed_depth_decode(self._n_seq)          # the first decode sets llama.cpp's buffers up: not a measure
        self.cost = StepCost.calibrate(self._timed_depth_decode, self._n_seq, repeats=3)

    def propose(self, seq: Sequence, k_max: int) -> Proposal:
        """Room for up to ``k_max`` tokens, drafted on demand by :meth:`draft`; now and then a probe (see
        :data:`PROBE_AFTER`) with its tokens."""
        n = min(k_max, self._room(len(seq.tokens)))
        if n <= 0:
            return Proposal(0)
        kv = self._slots.setdefault(seq.slot, _SlotKV())
        kv.untested += 1
        if kv.untested > PROBE_AFTER and self._probe_allowed():
            started = time.perf_counter()
            tokens = self._draft([(seq, min(n, self.probe_tokens))])[0]
            self._probe_credit -= time.perf_counter() - started
            return Proposal(len(tokens), tokens) if tokens else Proposal(0)
        return Proposal(n)

    def draft(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        return self._draft([(seq, min(n, self._room(len(seq.tokens)))) for seq, n in wanted])

    def draft_seconds(self, depth: int, n_seqs: int) -> float:
        """One draft-model decode of ``n_seqs`` tokens per depth: a sequence drafted at the step before brings
        one token to catch up (two when the target kept every draft), which the first depth's decode carries.
        A sequence that was not drafted for a while brings more, once; the estimate leaves that out."""
        if depth <= 0 or n_seqs <= 0:
            return 0.0
        return depth * self.cost.decode_seconds(n_seqs)

    def forget(self, seq: Sequence) -> None:
        """Nothing to drop: the draft KV belongs to the slot, not the sequence, and stays, since the slot's next
        sequence often starts with the same tokens (a system prompt, a chat template's header): the catch-up
        keeps the common prefix and decodes only the rest."""

    def close(self) -> None:
        self.model.close()

    # ------------------------------------------------------------ drafting
    def _room(self, n_tokens: int) -> int:
        """Draft tokens that still fit this sequence's KV stream after ``n_tokens`` tokens."""
        return self.model.info.n_ctx_seq - n_tokens

    def _probe_allowed(self) -> bool:
        now = time.monotonic()
        self._probe_credit = min(PROBE_CREDIT_CAP_S, self._probe_credit + PROBE_SHARE * (now - self._credit_at))
        self._credit_at = now
        return self._probe_credit > 0

    def _draft(self, jobs: list[tuple[Sequence, int]]) -> list[list[int]]:
        """``jobs``: (sequence, draft tokens wanted). Catch-up, then one decode per depth."""
        drafts: list[list[int]] = [[] for _ in jobs]
        pending: list[tuple[int, int, int]] = []            # (job, position, token) still to decode
        for job, (seq, n) in enumerate(jobs):
            tokens = seq.tokens
            if n <= 0 or not tokens:
                continue
            kv = self._slots.setdefault(seq.slot, _SlotKV())
            known = min(kv.known, len(tokens)) if kv.seq is seq else 0
            keep = min(_common_prefix(kv.tokens, tokens, known), len(tokens) - 1)   # the last token's logits draft
            if keep < len(kv.tokens):
                self.model.kv_remove(seq.slot, keep)
                del kv.tokens[keep:]
            kv.seq, kv.known, kv.untested = seq, len(tokens), 0
            pending += [(job, pos, tokens[pos]) for pos in range(keep, len(tokens))]
        n_batch, dropped = self.model.info.n_batch, set[int]()
        for start in range(0, len(pending), n_batch):
            chunk = [entry for entry in pending[start:start + n_batch] if entry[0] not in dropped]
            last = [pos == len(jobs[job][0].tokens) - 1 for job, pos, _ in chunk]
            if chunk and not self._decode_and_draft(jobs, drafts, chunk, last):
                dropped.update(job for job, _, _ in chunk)
        depth = 1
        while True:
            going = [job for job, (_, n) in enumerate(jobs)
                     if len(drafts[job]) == depth and depth < n and not self.model.is_eog(drafts[job][-1])]
            if not going:
                return drafts
            chunk = [(job, len(self._slots[jobs[job][0].slot].tokens), drafts[job][-1]) for job in going]
            self._decode_and_draft(jobs, drafts, chunk, [True] * len(chunk))   # a failure empties their drafts
            depth += 1

    def _decode_and_draft(self, jobs: list[tuple[Sequence, int]], drafts: list[list[int]],
                          chunk: list[tuple[int, int, int]], wants_logits: list[bool]) -> bool:
        """Decode ``chunk`` (job, position, token); each row with logits adds its argmax to its job's draft.
        A failed decode (it should not: every slot has a stream of its own) drops the slots' draft KV and their
        drafts, and says so (False): drafting is an optimisation, never a reason to fail a step."""
        slots = [jobs[job][0].slot for job, _, _ in chunk]
        started = time.perf_counter()
        rc = self.model.decode([token for _, _, token in chunk], [pos for _, pos, _ in chunk], slots, wants_logits)
        if rc != 0:
            log.warning("draft model %s: llama_decode of %d tokens returned %d; dropping those slots' drafts",
                        self.path.name, len(chunk), rc)
            for job, slot in {(job, slot) for (job, _, _), slot in zip(chunk, slots, strict=True)}:
                self.model.kv_remove(slot)
                self._slots[slot] = _SlotKV()
                drafts[job] = []
            return False
        outputs = []
        for (job, _, token), slot, wants in zip(chunk, slots, wants_logits, strict=True):
            self._slots[slot].tokens.append(token)
            if wants:
                outputs.append(job)
        for job, token in zip(outputs, self._argmax(len(outputs)), strict=True):
            drafts[job].append(token)
        self.cost.observe([len(chunk)], time.perf_counter() - started)     # costed as one micro-batch of them
        return True

    def _argmax(self, n_outputs: int) -> list[int]:
        """Greedy: the best id of each of the last decode's ``n_outputs`` logits rows, among the ids the served
        model has."""
        if n_outputs == 0:
            return []
        return [int(token) for token in self.model.logits_rows(n_outputs)[:, :self.n_shared_vocab].argmax(axis=1)]

    def _timed_depth_decode(self, n_seqs: int) -> float:
        """Seconds for one depth of ``n_seqs`` sequences (a decode of one token each, argmax of each row), for
        :meth:`StepCost.calibrate`; the calibration's cells are cleared afterwards."""
        token = max(self.model.bos_token, 0)
        started = time.perf_counter()
        rc = self.model.decode([token] * n_seqs, [0] * n_seqs, list(range(n_seqs)), [True] * n_seqs)
        if rc != 0:
            raise RuntimeError(f"SLOTQ_DRAFT_MODEL {self.path}: llama_decode of {n_seqs} tokens returned {rc}")
        self._argmax(n_seqs)
        seconds = time.perf_counter() - started
        for slot in range(n_seqs):
            self.model.kv_remove(slot)
        return seconds
