"""Engine configuration: what to load and how to size the llama.cpp context.

:class:`EngineKnobs` is the one definition of every engine tunable (names, defaults, bounds,
descriptions). The job layer's worker settings inherit it, so ``SLOTQ_<NAME>`` environment
variables and ``slotq worker --<name>`` flags come from these fields and can never drift from what
the engine accepts.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from slotq.engine.grammar_knobs import GrammarKnobs
from slotq.engine.lora import LoraAdapterSpec, parse_lora_setting
from slotq.engine.scheduler import BatchingMode

MAX_KV_SEQUENCES = 256
"""llama.cpp's ``LLAMA_MAX_SEQ`` (``llama_max_parallel_sequences()``): the most sequences one context
holds. The ``slots`` limit is this; cache slots only ever take what the slots leave of it."""


class KVCacheType(StrEnum):
    F16 = "f16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    F32 = "f32"


class FlashAttention(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class KVLayout(StrEnum):
    """How the KV cache is laid out across slots (docs/architecture.md, "KV layout", has the figures).

    ``split``: one KV stream per slot (llama.cpp ``kv_unified=false``). A step's attention covers
    each sequence's own cells only, so its cost grows with the longest context, not with the sum
    of all of them; each slot (and cache slot) owns ``kv_cells / (slots + cache_slots)`` cells, which
    caps its sequence. ``unified``:
    one pool shared by every slot (``kv_unified=true``); every step's attention spans the whole
    pool, but a sequence may use any free cell. ``auto``: ``split`` when every slot gets its full
    ``ctx`` (``kv_cells`` unset or >= slots x ctx), else ``unified``, the only layout that serves
    ``ctx``-long sequences from a smaller pool."""

    AUTO = "auto"
    SPLIT = "split"
    UNIFIED = "unified"


class CpuRepack(StrEnum):
    """Whether llama.cpp may repack CPU weights into its faster layouts (see engine/cpu_features.py)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class SpecMode(StrEnum):
    """Speculative decoding (engine/speculation.py): where drafts come from. Every mode drafts only
    where the step-cost rule says a draft pays (docs/architecture.md, "Speculative decoding")."""

    AUTO = "auto"       # the draft model when draft_model is set, else off (n-gram lookup is asked for: NGRAM)
    OFF = "off"
    NGRAM = "ngram"     # drafts from the sequence's own prompt and output (prompt lookup)
    DRAFT = "draft"     # a second, smaller GGUF with the same vocabulary (draft_model)


class Pooling(StrEnum):
    """How an embedding worker turns a sequence's token vectors into one (llama.cpp's pooling types)."""

    AUTO = "auto"
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


class EngineKnobs(GrammarKnobs):
    """Sizes follow llama-server's meaning where one exists.

    ``ctx`` is the per-sequence context (prompt + generated tokens of one request). The KV cache
    holds ``kv_cells`` cells; it defaults to ``slots * ctx`` so every slot can always reach its full
    context, and then each slot gets a KV stream of its own (``kv_layout``). A smaller pool saves
    memory: it is shared by all slots (unified layout), admission waits for room and preemption
    handles overflow (see the scheduler).
    """

    slots: int = Field(8, ge=1, le=MAX_KV_SEQUENCES, description="concurrent sequences = jobs a worker runs at once")
    ctx: int = Field(4096, ge=64, le=1_048_576, description="per-sequence context in tokens (prompt + output)")
    cache_slots: int = Field(
        1, ge=0, le=16,
        description="spare KV streams beyond slots (one more ctx of KV memory each): a job of a higher lane that "
                    "finds every slot busy with lower-lane work runs in one beside them (the reserve: nothing is "
                    "handed back, a step decodes one sequence more), and so does a request the owner lends it (the "
                    "worker: the first job of a tenant with nothing running); otherwise they keep idle prefix "
                    "caches, and a job handed back for a higher lane leaves its cells there and resumes without "
                    "recomputing them; 0 = off")
    kv_cells: int | None = Field(None, ge=64,
                                 description="total KV cells of all slots; unset = (slots + cache_slots) x ctx (a set "
                                             "value gives cache slots only what is left beyond slots x ctx)")
    kv_layout: KVLayout = Field(
        KVLayout.AUTO,
        description="split = one KV stream per slot (a step pays each sequence's own context; each slot is capped at "
                    "kv_cells / slots); unified = one pool shared by all slots (every step pays every slot's context); "
                    "auto = split when kv_cells >= slots x ctx, else unified")
    batch: int = Field(512, ge=1, le=65_536, description="max tokens in one llama_decode (llama.cpp n_batch); >= slots")
    ubatch: int = Field(512, ge=1, le=65_536, description="llama.cpp n_ubatch (physical micro-batch)")
    prefill_chunk: int = Field(256, ge=1, description="max prompt tokens of one sequence per decode step")
    threads: int | None = Field(None, ge=1, le=1024,
                                description="llama.cpp threads; unset = every core this process may use")
    gpu_layers: Annotated[int, Field(ge=-1)] | Literal["auto"] = Field(
        "auto", description="layers offloaded to the GPU; -1 = all; auto = as many as fit in gpu_memory_fraction of "
                            "the free GPU memory with the KV cache of every slot (0 on a CPU-only build or without a "
                            "GPU)")
    gpu_memory_fraction: float = Field(0.9, gt=0, le=1,
                                       description="with gpu_layers=auto: the share of free GPU memory to fill")
    flash_attention: FlashAttention = Field(FlashAttention.AUTO, description="llama.cpp flash attention")
    kv_type: KVCacheType = Field(KVCacheType.F16, description="KV cache element type")
    batching: BatchingMode = Field(BatchingMode.CONTINUOUS, description="static exists for comparison")
    prefix_cache: bool = Field(True, description="reuse the KV of shared prompt prefixes across slots")
    kv_overcommit: float = Field(1.0, ge=0.1, le=16.0,
                                 description="unified layout: admit while reserved KV <= kv_cells x this (split: "
                                             "every slot owns its stream, nothing to overcommit)")
    cpu_repack: CpuRepack = Field(
        CpuRepack.AUTO,
        description="repack CPU weights into llama.cpp's faster layouts (AVX2/AVX-512, AMX): auto = on unless the "
                    "CPU has AMX, whose repacked kernels crash llama.cpp (llama.cpp #20824); on; off")
    seed: int = Field(0xFFFFFFFF, ge=0, le=0xFFFFFFFF,
                      description="sampler seed of requests that give none; 4294967295 = random")
    pooling: Pooling = Field(
        Pooling.AUTO,
        description="embedding workers: how token vectors become one (llama-server --pooling); auto = the GGUF's "
                    "pooling type, mean for a model that declares none (a text generator)")
    embd_normalize: int = Field(
        2, ge=-1, le=100,
        description="embedding workers: normalisation of each vector, as llama-server's --embd-normalize: -1 none, "
                    "0 max absolute (int16 range), 1 taxicab, 2 euclidean (L2), >2 p-norm")

    spec: SpecMode = Field(
        SpecMode.AUTO,
        description="speculative decoding: auto = the draft model when draft_model is set, else off; off; ngram = "
                    "drafts from each sequence's own prompt and output; draft (needs draft_model). A draft goes into "
                    "a step only where its expected accepted tokens pay for the step time it adds. The default drafts "
                    "only with a draft model: n-gram drafts were not shown never to lose (docs/architecture.md)")
    spec_k_max: int = Field(32, ge=1, le=64, description="most draft tokens one sequence adds to a step")
    spec_k_min: int = Field(2, ge=1, le=64,
                            description="fewest draft tokens worth sending (a shorter draft is not sent)")
    draft_model: Path | None = Field(
        None, description="GGUF of a small model with the served model's vocabulary that drafts for every sequence "
                          "in one batch of its own (spec=auto or draft)")
    lora: str = Field(
        "", description="LoRA adapters loaded at start-up, name=path[:scale] comma-separated (scale: what a request "
                        "naming the adapter without one gets, default 1.0); an adapter applies only to the requests "
                        "that ask for it (the lora field, or the model name base:name)")
    lora_turn_max_steps: int = Field(
        128, ge=1, le=10_000,
        description="most decode steps one adapter set keeps the turn while another set has work (llama.cpp applies "
                    "adapters per context, so one step runs one set; a set keeps the turn while it has work, so the "
                    "others' requests pile up into a fuller batch; engine.scheduler rule 10)")

    @property
    def lora_adapters(self) -> tuple[LoraAdapterSpec, ...]:
        """``lora`` parsed (checked when the settings are read)."""
        return parse_lora_setting(self.lora)

    @model_validator(mode="after")
    def _sizes(self) -> EngineKnobs:
        if self.batch < self.slots:
            raise ValueError(f"batch ({self.batch}) must be >= slots ({self.slots}): "
                             "every slot decodes one token per step")
        if self.kv_cells is not None and self.kv_cells < self.ctx:
            raise ValueError(f"kv_cells ({self.kv_cells}) must be >= ctx ({self.ctx}) "
                             "so one sequence can reach its full context")
        if self.spec_k_min > self.spec_k_max:
            raise ValueError(f"spec_k_min ({self.spec_k_min}, SLOTQ_SPEC_K_MIN) must be <= spec_k_max "
                             f"({self.spec_k_max}, SLOTQ_SPEC_K_MAX)")
        if self.spec == SpecMode.DRAFT and self.draft_model is None:
            raise ValueError("spec=draft needs draft_model (SLOTQ_DRAFT_MODEL): the GGUF that drafts")
        try:
            parse_lora_setting(self.lora)
        except ValueError as exc:
            raise ValueError(f"lora (SLOTQ_LORA): {exc}") from None
        return self


class EngineConfig(EngineKnobs):
    """The knobs plus the model file to load."""

    model_config = ConfigDict(extra="forbid")

    model_path: Path

    @model_validator(mode="after")
    def _model_file(self) -> EngineConfig:
        if not self.model_path.is_file():
            raise ValueError(f"model_path: no such file: {self.model_path}")
        if self.draft_model is not None and not self.draft_model.is_file():
            raise ValueError(f"draft_model: no such file: {self.draft_model}")
        for spec in self.lora_adapters:
            if not spec.path.is_file():
                raise ValueError(f"lora: adapter {spec.name!r}: no such file: {spec.path}")
        return self

    @property
    def spec_source(self) -> SpecMode:
        """``spec`` decided: OFF, NGRAM or DRAFT (never AUTO). AUTO, the default, must never be slower
        than OFF: n-gram drafts could not be shown to keep that promise at every concurrency on a
        shared 2-core machine (docs/architecture.md, "Speculative decoding"), so without a draft
        model AUTO is OFF and n-gram lookup is asked for by name (NGRAM)."""
        if self.spec == SpecMode.AUTO:
            return SpecMode.DRAFT if self.draft_model is not None else SpecMode.OFF
        return self.spec

    @property
    def usable_cache_slots(self) -> int:
        """The cache slots the KV cells allow: with ``kv_cells`` unset each gets ``ctx`` cells of its
        own; a set ``kv_cells`` gives them only what is left beyond ``slots x ctx`` (maybe none), so
        sizing the pool for the slots alone keeps the layout and every slot's full context. Either way
        slots and cache slots together stay within llama.cpp's :data:`MAX_KV_SEQUENCES` (so 256 slots
        have none)."""
        room = MAX_KV_SEQUENCES - self.slots
        if self.kv_cells is None:
            return min(self.cache_slots, room)
        return min(self.cache_slots, room, max(0, self.kv_cells // self.ctx - self.slots))

    @property
    def kv_sequences(self) -> int:
        """llama.cpp's ``n_seq_max``: the decoding slots plus the cache-only ones."""
        return self.slots + self.usable_cache_slots

    @property
    def total_kv_cells(self) -> int:
        return self.kv_cells or self.kv_sequences * self.ctx

    @property
    def resolved_kv_layout(self) -> KVLayout:
        """``auto`` decided: split streams unless the pool is too small for every slot's full ``ctx``."""
        if self.kv_layout != KVLayout.AUTO:
            return self.kv_layout
        return KVLayout.SPLIT if self.total_kv_cells >= self.slots * self.ctx else KVLayout.UNIFIED
