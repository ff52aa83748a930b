"""Scheduling policy: which sequences hold slots and what goes into the next decode batch.

Pure Python and deterministic: it never touches llama.cpp. The runner executes a
:class:`SchedulerOutput` (KV operations, one ``llama_decode``, sampling) and reports back with
:meth:`Scheduler.commit` or :meth:`Scheduler.on_kv_full`. Tests drive it without a model.

Policy, in order of precedence:

1. Decode first: every sequence that is generating gets exactly one token in every batch, so
   inter-token latency never waits behind someone else's prompt. Decode tokens go in slot order:
   with a KV stream per slot, llama.cpp puts only consecutive seq ids into one micro-batch, so
   slot order keeps a step's decode tokens in as few graph runs as the free slots allow. The one
   exception: the step that computes the last prompt chunk of a sequence lent the reserve (6) is
   that prefill alone, and the others' decode tokens go in the next step (see 3).
2. Admission: waiting sequences (priority class, then priority, then arrival) take free slots (see
   8 for which one, when no idle cache of theirs decides it). With one shared pool
   (``kv_stream_cells`` None) a sequence is admitted when its worst-case KV need fits the pool
   (``kv_cells * overcommit``), and idle prefix caches are evicted before a request is made to
   wait. With a stream per slot a free slot is enough: the stream is the sequence's own, and the
   engine refuses at submit any sequence longer than a stream. In static mode nothing is admitted
   until the running batch drains.
3. Prefill: prompt chunks of admitted sequences fill the rest of the ``n_batch`` budget, at most
   ``prefill_chunk`` tokens per sequence per step, highest priority first, then oldest, so one long
   prompt cannot starve the others. Only the highest priority class that has a prompt to prefill
   gets prefill in a step: a lower class's prompt (a bulk job, a resumed one re-prefilling its
   tokens) waits for the next step rather than make the higher class's first token wait for its
   chunk. The job layer sets the class from the lane (engine.request.GenerationRequest). A
   sequence lent the reserve (6) ranks above the rest of its class here, and its last chunk has a
   step to itself: it was lent the reserve so that its first token would not wait behind the
   batch. On a CPU a step costs about its tokens, so the others' next token then comes about when
   it would have (after the prompt's step and their own, rather than one step holding both), and
   the lent one's first comes a batch's decode sooner (figures: docs/benchmarks.md, "Bulk
   processing", the flooding tenant). On a GPU, where decode tokens ride along with a prompt
   almost free, it costs the others one step per lent sequence -- one per fresh tenant's job on a
   full worker, at most ``reserve_slots`` at a time.
4. Prefix reuse: an admitted sequence starts from the longest prefix of its tokens that any slot
   already holds in KV (a running sequence or an idle cache), copied instead of recomputed. If a
   running sequence is still prefilling a longer shared prefix, the newcomer waits for it and
   copies it when it is computed (the same mechanism forks the n completions of one prompt).
   With a stream per slot a copy duplicates the cells into the newcomer's stream (the ledger
   counts them twice), and llama.cpp copies the whole stream, so a running slot's prefix is copied
   only when it is at least ``min_copy_tokens`` long; reusing a slot's own idle cache costs
   nothing in either layout. What the idle caches hold, and the longest match among them and the
   running slots, is :class:`~slotq.engine.prefix_index.PrefixIndex`'s.
5. KV full (shared pool only; a stream per slot never fills, see 2): halve the prefill budget and
   retry; if a batch with no prefill still does not fit, preempt the youngest sequence of the lowest
   class and priority and requeue it with its progress.
6. Runtime limits (:class:`SchedulerLimits`, set by the owner while it runs, e.g. an elastic worker):
   at most ``active_slots`` sequences hold a slot, and the batch and prefill chunk may be smaller
   than configured. Lowering ``active_slots`` never stops a running sequence: no new one is
   admitted until enough have finished. Decode tokens are never cut by a smaller batch. The one
   exception is the reserve (``reserve_slots``, at most the cache slots): a sequence of a priority
   class above a running sequence's may be admitted beyond ``active_slots`` into a spare KV stream
   and decode beside the others, up to ``active_slots + reserve_slots`` sequences, rather than wait
   for the lower class to finish or to be handed back. The owner may also lend the reserve to a
   sequence of the running class (``Sequence.lent_reserve``): the job layer does for the job of a
   tenant with nothing running while other tenants' jobs hold every slot. A step then decodes one
   sequence more, which costs it about as much as handing a victim back would: the victim's gap
   among the running slots (8) costs every step a micro-batch more until it returns, and the lower
   class loses its slot besides (figures: docs/benchmarks.md, "Bulk processing").
7. Cache slots (``cache_slots``): KV sequences beyond ``n_slots`` that count as active only while
   the reserve (6) lends them to a higher class. When a sequence gives up its slot (its job handed
   back for a higher lane: the runner cancels it) and the newcomer arrives, the newcomer takes a
   spare (rule 8) and the leaver's cells stay in its own slot as an idle cache; when it comes back
   it reuses them (its own idle cache costs nothing) instead of recomputing its prompt and
   delivered tokens. To keep it so, with cache slots a
   newcomer that matches an idle cache by fewer than ``min_copy_tokens`` (a BOS, a chat template's
   header) does not take it over for that: it takes a slot by rule 8 and recomputes those few
   tokens; among caches it matches equally it takes over the least recently used (always).
8. Which free slot a newcomer takes, when no idle cache it matches decides (4, 7): first not the
   cache of a sequence that was cancelled (a job handed back for a higher lane comes back for its
   cells: 7), nor the slot it copies from; then, with a stream per slot, the one with the most
   running neighbours, so the running slots stay in as few runs of consecutive ids as possible
   (each run is a micro-batch of its own in every step, so a gap costs every step a graph run
   more: docs/benchmarks.md, "Bulk processing"); then an uncached slot before an idle cache, the
   least recently used cache first, the lowest id first. Without the neighbour rank, a newcomer
   after a sequence ended in the middle took the spare cache slot at the end, and the gap stayed
   for the rest of the run.
9. Drafts (speculative decoding, with a :class:`~slotq.engine.speculation.DraftPlanner`): a
   generating sequence may follow its decode token with draft tokens, which come last: they take
   only what the batch budget leaves after decode and prompt tokens, and the planner adds them only
   where they raise the step's expected tokens per second (a compute-bound step gets none). A
   sequence never drafts past its ``max_new_tokens``. After the decode the runner verifies the
   drafts and :meth:`Scheduler.settle_drafts` forgets the cells of the rejected ones. A KV-full
   decode that carried drafts is retried without any until a sequence finishes.
10. LoRA adapter groups (above rules 1, 3 and 9, which apply within the group): llama.cpp applies
   adapters to the whole context, so a step computes only sequences of one adapter set (the
   base model is the empty set; ``Sequence.adapters``), and :attr:`SchedulerOutput.adapters` says
   which. Which set runs, in order of precedence: (a) the set whose turn it is keeps it while it
   has work (a token to decode or a prompt to prefill), until it has run ``lora_turn_max_steps``
   steps while another set had work; the steps it runs alone do not count, so a set that was alone
   is not cut off the moment another set's request arrives; (b) then, or when it has no work left,
   the turn passes to the next set with work, round-robin in the order they first had work. So a
   set with work runs within ``(sets - 1) x lora_turn_max_steps`` steps: none starves, whatever its
   priority class (a lane's precedence holds within a set, rules 1 and 3; across sets only
   admission, rule 2, sees it). A lone set keeps the turn for as long as it is alone and pays
   nothing. Nothing else ends a turn: not how many sequences the other sets have ready (no
   hysteresis to tune). Why a turn lasts while its set generates: while it runs, the other sets'
   new requests pile up, so their turn starts with a fuller batch, and where clients alternate
   between sets (every finished request's next one is of the other set) the sets fall into step,
   each turn running nearly every slot (llama-server does the same, without a bound). Passing the
   turn to a set that has more ready sequences was simulated and lost: running a set moves its
   clients to the other set, so comparing counts keeps the sets split about evenly, each step half
   full (docs/architecture.md, "LoRA adapters", has the figures). The cap is large (default 128)
   because a turn cut before its set's requests finish splits the sets the same way. A switch
   also costs: llama.cpp reserves its compute graph again at the next decode. Admission (2) and
   slots (8) ignore sets: a sequence of another set holds its slot and waits for its set's turn.
   The prefix cache (4, 7) is per set: a sequence reuses or waits for only KV computed under its
   own set, since the adapters change every layer's cells.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from slotq.engine.kv_ledger import KVLedger
from slotq.engine.lora import BASE, AdapterSet
from slotq.engine.prefix_index import PrefixIndex
from slotq.engine.request_queue import RequestQueue
from slotq.engine.sequence import SeqState, Sequence
from slotq.engine.speculation import DraftPlanner, Proposal


class KVFullAction(StrEnum):
    DROPPED_DRAFTS = "dropped_drafts"
    EVICTED_CACHE = "evicted_cache"
    SHRUNK_PREFILL = "shrunk_prefill"
    PREEMPTED = "preempted"
    STUCK = "stuck"


class BatchingMode(StrEnum):
    CONTINUOUS = "continuous"
    STATIC = "static"


@dataclass(frozen=True)
class SchedulerConfig:
    n_slots: int                    # sequences that decode at once (the most active_slots can be)
    n_batch: int
    kv_cells: int                   # all cells: the pool, or the sum of the streams
    prefill_chunk: int
    mode: BatchingMode = BatchingMode.CONTINUOUS
    prefix_cache: bool = True
    kv_overcommit: float = 1.0
    min_reuse_tokens: int = 1
    min_wait_tokens: int = 32       # wait for a running prefill only when it saves at least this much
    kv_stream_cells: int | None = None  # cells of each slot's own KV stream; None = one pool shared by all slots
    min_copy_tokens: int = 32       # streams: copy a running slot's prefix only when it saves this much (a copy
                                    # moves the whole stream; docs/architecture.md, "KV layout", has the figures)
    cache_slots: int = 0            # KV sequences beyond n_slots that keep idle caches (rule 7)
    reserve_slots: int = 0          # of those, how many a higher priority class may decode in (rule 6)
    lora_turn_max_steps: int = 128  # steps a set keeps the turn while another set has work (rule 10)


@dataclass(frozen=True)
class SchedulerLimits:
    """What the owner may change while the engine runs, within the configured sizes: active slots
    (1..n_slots), the token budget of one batch (>= 1; decode tokens always go in) and the prefill
    chunk per sequence per step (>= 1)."""

    active_slots: int
    n_batch: int
    prefill_chunk: int

    @classmethod
    def full(cls, config: SchedulerConfig) -> SchedulerLimits:
        return cls(config.n_slots, config.n_batch, config.prefill_chunk)

    def clamped(self, config: SchedulerConfig) -> SchedulerLimits:
        return self.within(SchedulerLimits.full(config))

    def within(self, ceiling: SchedulerLimits) -> SchedulerLimits:
        """Each value between 1 and ``ceiling``'s."""
        return SchedulerLimits(active_slots=min(max(1, self.active_slots), ceiling.active_slots),
                               n_batch=min(max(1, self.n_batch), ceiling.n_batch),
                               prefill_chunk=min(max(1, self.prefill_chunk), ceiling.prefill_chunk))


@dataclass
class Admission:
    """A sequence entering slot ``seq.seq_id``. The runner first drops the slot's KV beyond
    ``keep`` (its own cached prefix), then, if ``copy_from`` is set, copies ``n_reused`` cells
    from that sequence id."""

    seq: Sequence
    keep: int
    copy_from: int | None
    n_reused: int


@dataclass
class BatchItem:
    """``n_tokens`` tokens at positions from ``start``: ``seq.tokens[start:]``'s first ones, then
    ``draft``. ``sample`` when the chunk reaches the end of the sequence (the logits of its last
    token are needed, and of every draft token). ``draft_room`` is how many draft tokens the
    planner gave a generating sequence; the runner fills ``draft`` with at most that many
    (:meth:`set_draft`)."""

    seq: Sequence
    start: int
    n_tokens: int
    sample: bool
    draft_room: int = 0
    draft: list[int] = field(default_factory=list)

    def set_draft(self, tokens: list[int]) -> None:
        self.draft = tokens[:self.draft_room]
        self.n_tokens = 1 + len(self.draft)


@dataclass
class Fork:
    """After the decode: copy ``leader``'s first ``n_tokens`` KV cells to ``seq``."""

    leader: Sequence
    seq: Sequence
    n_tokens: int


@dataclass
class SchedulerOutput:
    admitted: list[Admission] = field(default_factory=list)
    evicted_caches: list[int] = field(default_factory=list)     # freed seq ids whose KV must be cleared first
    items: list[BatchItem] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)     # filled by commit(): KV copies to perform
    adapters: AdapterSet = BASE                         # the LoRA adapters every item runs under (rule 10)

    @property
    def n_tokens(self) -> int:
        return sum(i.n_tokens for i in self.items)


class Scheduler:
    def __init__(self, config: SchedulerConfig, drafts: DraftPlanner | None = None) -> None:
        """``drafts``: speculative decoding's policy (rule 9); None = never draft."""
        if config.prefill_chunk < 1 or config.n_batch < config.n_slots + config.reserve_slots:
            raise ValueError("need prefill_chunk >= 1 and n_batch >= n_slots + reserve_slots (one decode token per "
                             "sequence)")
        if config.reserve_slots > config.cache_slots:
            raise ValueError("reserve_slots are cache slots: need reserve_slots <= cache_slots")
        self.config = config
        self.drafts = drafts
        self.limits = SchedulerLimits.full(config)
        self.waiting = RequestQueue()
        self.running: list[Sequence] = []
        self.ledger = KVLedger(shared_copies=config.kv_stream_cells is None)
        self._free_slots = list(range(config.n_slots + config.cache_slots))
        self._prefixes = PrefixIndex()                  # what the idle caches hold (rules 4, 7, 8)
        self._prefill_scale = 1.0
        self._pending_evictions: list[int] = []         # idle caches dropped, not yet cleared in KV
        self._hold_admissions = False                   # after a preemption, until a sequence finishes
        self._hold_drafts = False                       # after a KV-full decode with drafts, likewise
        self._turns: list[AdapterSet] = []              # adapter sets with work, the one whose turn it is first
        self._turn_steps = 0                            # steps the first has run in its turn while another waited
        self.preemptions = 0
        self.prompt_tokens_reused = 0
        self.prompt_tokens_computed = 0

    # ----------------------------------------------------------------- queue side
    def add(self, seq: Sequence) -> None:
        seq.state = SeqState.WAITING
        self.waiting.push(seq)

    def cancel(self, request_id: str) -> list[Sequence]:
        """Remove a request's waiting sequences (the caller finishes them); running ones are
        finished by the runner through :meth:`finish`."""
        return self.waiting.remove_request(request_id)

    def set_limits(self, limits: SchedulerLimits) -> SchedulerLimits:
        """Apply new runtime limits (clamped to the configured sizes); returns what applies."""
        self.limits = limits.clamped(self.config)
        return self.limits

    # ----------------------------------------------------------------- one step
    def schedule(self, draft_offers: Mapping[Sequence, Proposal] | None = None) -> SchedulerOutput:
        """The next batch. ``draft_offers``: how many draft tokens the drafter could propose for
        each generating sequence (rule 9)."""
        out = SchedulerOutput()
        self._admit(out)
        out.evicted_caches, self._pending_evictions = self._pending_evictions, []
        budget = self.limits.n_batch
        chunk_cap = max(1, int(self.limits.prefill_chunk * self._prefill_scale))
        out.adapters = group = self._take_turn()
        prefilling = [s for s in self.running
                      if s.adapters == group and s.fork_of is None and not s.is_decoding and s.n_pending > 0]
        top_rank = max((_prefill_rank(s) for s in prefilling), default=(0, False))
        lent_prompt_ends = any(s.lent_reserve and _prefill_rank(s) == top_rank and s.n_pending <= min(chunk_cap, budget)
                               for s in prefilling)    # rule 1's exception
        for seq in sorted(self.running, key=_slot):
            if seq.fork_of is None and seq.is_decoding and not lent_prompt_ends and seq.adapters == group:
                out.items.append(BatchItem(seq, seq.n_computed, 1, sample=True))
                budget -= 1
        for seq in sorted(prefilling, key=lambda s: s.queue_order):
            if budget <= 0:
                break
            if _prefill_rank(seq) < top_rank:
                continue
            n = min(budget, chunk_cap, seq.n_pending)
            out.items.append(BatchItem(seq, seq.n_computed, n, sample=n == seq.n_pending))
            budget -= n
        if draft_offers and self.drafts is not None and not self._hold_drafts:
            self._plan_drafts(out, draft_offers, budget)
        return out

    def _take_turn(self) -> AdapterSet:
        """Rule 10: the adapter set this step runs, counted as one step of its turn."""
        ready: list[AdapterSet] = []
        for seq in self.running:
            if seq.fork_of is None and seq.n_pending > 0 and seq.adapters not in ready:
                ready.append(seq.adapters)
        current = self._turns[0] if self._turns else None
        turns = [group for group in self._turns if group in ready]
        turns += [group for group in ready if group not in turns]
        if len(turns) > 1 and turns[0] == current and self._turn_steps >= self.config.lora_turn_max_steps:
            turns.append(turns.pop(0))              # its turn is used up: the next set's
        if not turns or turns[0] != current:
            self._turn_steps = 0
        self._turns = turns
        if len(turns) > 1:
            self._turn_steps += 1                   # only the steps another set waits through count (rule 10 a)
        return turns[0] if turns else BASE

    def _plan_drafts(self, out: SchedulerOutput, offers: Mapping[Sequence, Proposal], budget: int) -> None:
        """Rule 9: the planner's rooms, each capped by what the sequence may still generate."""
        assert self.drafts is not None
        decoding = [item for item in out.items if item.seq.is_decoding]
        offered = [(item.seq, replace(offers[item.seq], n=min(offers[item.seq].n, item.seq.max_new_tokens
                                                               - item.seq.n_generated - 1)))
                   for item in decoding if item.seq in offers]
        prompts = [item.n_tokens for item in out.items if not item.seq.is_decoding]
        rooms = self.drafts.plan(offered, prompt_lengths=prompts, n_generating=len(decoding), budget=budget)
        for item in decoding:
            item.draft_room = rooms.get(item.seq, 0)     # n_tokens grows when the runner fills it (set_draft)

    def settle_drafts(self, seq: Sequence) -> int:
        """After verification: a running sequence keeps the cells of the tokens it kept (all but
        its last, which the next step decodes); returns how many cells from ``seq.n_computed`` on
        the runner must remove from KV (rejected drafts)."""
        dropped = seq.n_computed - (len(seq.tokens) - 1)
        if dropped <= 0 or seq.state != SeqState.RUNNING:
            return 0
        seq.n_computed -= dropped
        self.ledger.truncate(seq.slot, seq.n_computed)
        return dropped

    def commit(self, out: SchedulerOutput) -> None:
        """The batch was decoded: advance each sequence and mirror the KV the decode created."""
        self._prefill_scale = 1.0
        for item in out.items:
            item.seq.n_computed += item.n_tokens
            self.ledger.extend(item.seq.slot, item.n_tokens)
            own = item.n_tokens - len(item.draft)       # the sequence's tokens (drafts are not prompt)
            if item.seq.n_generated == 0 or own > 1:
                self.prompt_tokens_computed += own
        for seq in self.running:
            leader = seq.fork_of
            if leader is not None and leader.n_computed >= seq.fork_len:
                self.ledger.copy_prefix(leader.slot, seq.slot, seq.fork_len)
                self.prompt_tokens_reused += seq.fork_len - seq.n_reused   # a partial reuse was counted at admission
                seq.n_computed = seq.n_reused = seq.fork_len
                seq.fork_of = None
                out.forks.append(Fork(leader, seq, seq.fork_len))

    def on_kv_full(self, out: SchedulerOutput) -> KVFullAction:
        """``llama_decode`` found no KV space; nothing was committed. In order: drop idle prefix
        caches, shrink the prefill share, preempt one sequence (it is requeued with its tokens).
        STUCK means a lone sequence cannot fit: the runner fails it (retryable). Drafts go first (rule 9)."""
        if any(item.draft for item in out.items):
            self._hold_drafts = True
            return KVFullAction.DROPPED_DRAFTS
        if self._prefixes:
            for seq_id in self._prefixes.idle_slots():
                self._evict_cache(seq_id)
            return KVFullAction.EVICTED_CACHE
        had_prefill = any(not i.seq.is_decoding for i in out.items)
        if had_prefill and self._prefill_scale * self.limits.prefill_chunk > 1:
            self._prefill_scale /= 2
            return KVFullAction.SHRUNK_PREFILL
        victim = self._preemption_victim()
        if victim is None:
            return KVFullAction.STUCK
        self.preempt(victim)
        self._hold_admissions = True     # re-admitting the victim at once would thrash (overcommit)
        return KVFullAction.PREEMPTED

    def preempt(self, seq: Sequence) -> None:
        """Give up ``seq``'s slot and KV; it waits again with its tokens (progress is kept)."""
        self._release_slot(seq, keep_cache=False)
        for sib in self.running:
            if sib.fork_of is seq:
                sib.fork_of = None
        seq.n_computed = 0
        seq.n_reused = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, *, reusable: bool = True, cancelled: bool = False) -> None:
        """A sequence is done: free its slot at once (its KV stays as a prefix cache when enabled
        and ``reusable``; a failed decode's KV is not) and let unforked siblings prefill alone.
        ``cancelled``: it did not end by itself and may come back for its cells (rule 8)."""
        if seq.state == SeqState.RUNNING:
            self._release_slot(seq, keep_cache=self.config.prefix_cache and reusable, returning=cancelled)
            self._hold_admissions = self._hold_drafts = False
        for sib in self.running:
            if sib.fork_of is seq:
                sib.fork_of = None
        for sib in self.waiting:
            if sib.fork_of is seq:
                sib.fork_of = None
        seq.state = SeqState.FINISHED

    # ----------------------------------------------------------------- introspection
    @property
    def n_free_slots(self) -> int:
        return len(self._free_slots)

    def idle_cache_ids(self) -> frozenset[int]:
        """Free slots whose KV is kept as a prefix cache (evicted first when space is needed)."""
        return frozenset(self._prefixes.idle_slots())

    def kv_reserved(self) -> int:
        return sum(s.kv_still_needed for s in self.running)

    # ----------------------------------------------------------------- internals
    def _admit(self, out: SchedulerOutput) -> None:
        if self.running and (self._hold_admissions or self.config.mode == BatchingMode.STATIC):
            return
        while self.waiting and self._free_slots:
            seq = self.waiting.peek()
            assert seq is not None
            if len(self.running) >= self._slot_limit(seq):
                return
            if seq.fork_of is not None and (seq.fork_of.state != SeqState.RUNNING
                                            or seq.fork_of.n_computed >= seq.fork_len):
                seq.fork_of = None   # the leader is gone or already past the prompt: reuse its cache instead
            source, n_reuse = self._best_prefix(seq)
            need = seq.kv_still_needed - n_reuse
            if not self._fits(need):
                self._evict_caches_until(need, protect=source)
                if source is not None and source not in self._prefixes and source not in self._running_ids():
                    source, n_reuse = None, 0
                    need = seq.kv_still_needed
                if not self._fits(need) and self.running:
                    return
            self.waiting.pop()
            out.admitted.append(self._place(seq, source, n_reuse))

    def _slot_limit(self, seq: Sequence) -> int:
        """How many sequences may run once ``seq`` is admitted: the active slots, plus the reserve
        when ``seq`` is lent it or a sequence of a lower priority class runs (rule 6)."""
        if self.config.reserve_slots and (seq.lent_reserve
                                          or any(s.priority_class < seq.priority_class for s in self.running)):
            return self.limits.active_slots + self.config.reserve_slots
        return self.limits.active_slots

    def _fits(self, need: int) -> bool:
        if self.config.kv_stream_cells is not None:
            return True         # a free slot's stream is all the sequence needs (see the policy, 2)
        limit = self.config.kv_cells * self.config.kv_overcommit
        return self.ledger.used_cells() + self.kv_reserved() + need <= limit

    def _place(self, seq: Sequence, source: int | None, n_reuse: int) -> Admission:
        if source is not None and source in self._prefixes and source in self._free_slots:
            slot = source                                   # its own cache: keep the shared prefix
            keep, copy_from = n_reuse, None
        else:
            slot = self._newcomers_slot(exclude=source)
            keep, copy_from = 0, (source if n_reuse else None)
        self._free_slots.remove(slot)
        self._prefixes.forget(slot)
        self.ledger.park(slot, False)
        self.ledger.truncate(slot, keep)
        if copy_from is not None:
            self.ledger.copy_prefix(copy_from, slot, n_reuse)
        seq.seq_id = slot
        seq.state = SeqState.RUNNING
        seq.n_computed = n_reuse
        seq.n_reused = n_reuse
        self.prompt_tokens_reused += n_reuse
        self.running.append(seq)
        if seq.fork_of is None:
            self._wait_for_running_prefill(seq, n_reuse)
        return Admission(seq, keep, copy_from, n_reuse)

    def _wait_for_running_prefill(self, seq: Sequence, n_reuse: int) -> None:
        """Share a prefix that a running sequence is still computing instead of computing it twice."""
        if not self.config.prefix_cache:
            return
        others = {other.seq_id: other for other in self.running if other is not seq and other.seq_id is not None}
        match = self._prefixes.longest_running_match(seq.tokens, at_most=len(seq.tokens) - 1, running=(
            (slot, other.tokens, len(other.tokens) if other.adapters == seq.adapters else 0)    # rule 10
            for slot, other in others.items()))
        if match is None:
            return
        best = others[match.slot]
        if match.n_tokens - n_reuse >= self.config.min_wait_tokens and best.n_computed < match.n_tokens:
            seq.fork_of, seq.fork_len = best, match.n_tokens

    def _best_prefix(self, seq: Sequence) -> tuple[int | None, int]:
        """The slot whose KV shares the longest prefix with ``seq`` (capped so at least one
        token is computed: sampling needs fresh logits)."""
        if not self.config.prefix_cache or seq.fork_of is not None:
            return None, 0
        # A running slot's prefix is copied; with a stream per slot that copies its whole stream.
        copy_floor = self.config.min_copy_tokens if self.config.kv_stream_cells is not None else 0
        running = ((s.seq_id, s.tokens, s.n_computed if s.adapters == seq.adapters else 0)    # rule 10
                   for s in self.running if s.seq_id is not None)
        match = self._prefixes.longest_match(seq.tokens, at_most=len(seq.tokens) - 1, running=running,
                                             min_running_tokens=copy_floor, namespace=seq.adapters)
        if match is None or match.n_tokens < self.config.min_reuse_tokens:
            return None, 0
        if self.config.cache_slots and match.idle and match.n_tokens < self.config.min_copy_tokens:
            return None, 0      # rule 7: keep the cache for a sequence that matches it longer; recompute a few
        return match.slot, match.n_tokens

    def _newcomers_slot(self, exclude: int | None) -> int:
        """The free slot for a sequence no idle cache decides for (rule 8)."""
        running = self._running_ids() if self.config.kv_stream_cells is not None else set()
        lru = {seq_id: i for i, seq_id in enumerate(self._prefixes.idle_slots())}

        def rank(slot: int) -> tuple[bool, int, bool, int, int]:
            neighbours = (slot - 1 in running) + (slot + 1 in running)
            return (self._prefixes.is_returning(slot) or slot == exclude, -neighbours, slot in self._prefixes,
                    lru.get(slot, -1), slot)
        return min(self._free_slots, key=rank)

    def _evict_caches_until(self, need: int, protect: int | None) -> None:
        for seq_id in self._prefixes.idle_slots():
            if self._fits(need):
                return
            if seq_id != protect:
                self._evict_cache(seq_id)

    def _evict_cache(self, seq_id: int) -> None:
        self._prefixes.forget(seq_id)
        self.ledger.remove(seq_id)
        self._pending_evictions.append(seq_id)

    def _release_slot(self, seq: Sequence, keep_cache: bool, returning: bool = False) -> None:
        slot = seq.seq_id
        self.running.remove(seq)
        seq.state = SeqState.WAITING
        seq.seq_id = None
        if slot is None:
            return
        if keep_cache and seq.n_computed > 0:
            self._prefixes.keep(slot, seq.tokens[: seq.n_computed], returning=returning, namespace=seq.adapters)
            self.ledger.park(slot)
        else:
            self.ledger.remove(slot)
            self._pending_evictions.append(slot)
        self._free_slots.append(slot)

    def _preemption_victim(self) -> Sequence | None:
        if len(self.running) <= 1:
            return None
        return max(self.running, key=lambda s: s.queue_order)

    def _running_ids(self) -> set[int]:
        return {s.seq_id for s in self.running if s.seq_id is not None}


def _prefill_rank(seq: Sequence) -> tuple[int, bool]:
    """Only the sequences of the highest rank with a prompt to prefill get prefill in a step (rule 3)."""
    return seq.priority_class, seq.lent_reserve


def _slot(seq: Sequence) -> int:
    return seq.seq_id if seq.seq_id is not None else -1
