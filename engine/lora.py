"""LoRA adapters: the ones a worker loads at start-up, and the set a request runs under.

llama.cpp applies adapters to a whole context (``llama_set_adapters_lora``), not per sequence, so
one decode step can only compute sequences that want the same adapters at the same scales. A
request's adapters are therefore resolved here, once, into an :data:`AdapterSet` -- a canonical,
hashable value (sorted by adapter index, zero scales dropped) -- which the scheduler groups
sequences by (engine.scheduler, rule 10) and keys the prefix cache with. Two requests that ask for
the same adapters in another order or spelling (a name or an index) land in the same group, and a
request that asks for an adapter at scale 0 runs with the base model, as llama.cpp would.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slotq.engine.errors import InvalidRequest
from slotq.engine.request import LORA_NAME_PATTERN, MAX_LORA_SCALE

AdapterSet = tuple[tuple[int, float], ...]
"""(adapter index, scale) pairs, sorted by index, no zero scale: ``()`` is the base model."""

BASE: AdapterSet = ()
_NAME = re.compile(LORA_NAME_PATTERN)


@dataclass(frozen=True)
class LoraAdapterSpec:
    """One adapter of ``SLOTQ_LORA``: the name requests use, its GGUF, and the scale a request that
    names it without one gets."""

    name: str
    path: Path
    scale: float = 1.0


def parse_lora_setting(text: str) -> tuple[LoraAdapterSpec, ...]:
    """``name=path[:scale]`` entries, comma-separated (``SLOTQ_LORA``); an adapter's index (the
    ``id`` of llama-server's ``lora`` field) is its place in the list. Raises ValueError naming the
    entry at fault."""
    specs: list[LoraAdapterSpec] = []
    for index, entry in enumerate(e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, rest = entry.partition("=")
        name = name.strip()
        if not sep or not rest:
            raise ValueError(f"lora entry {index} ({entry!r}): expected name=path[:scale]")
        if not _NAME.match(name):
            raise ValueError(f"lora entry {index}: name {name!r} must match {LORA_NAME_PATTERN}")
        path, scale = rest, 1.0
        head, colon, tail = rest.rpartition(":")
        if colon and head:
            try:
                scale = float(tail)
            except ValueError:
                pass            # a path with a colon in it, and no scale
            else:
                path = head
        if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
            raise ValueError(f"lora entry {index} ({name}): scale {scale} must be finite and within "
                             f"+-{MAX_LORA_SCALE}")
        if any(s.name == name for s in specs):
            raise ValueError(f"lora entry {index}: the name {name!r} is given twice")
        specs.append(LoraAdapterSpec(name, Path(path.strip()), scale))
    return tuple(specs)


def resolve_adapters(refs: Sequence[tuple[int | str, float | None]],
                     specs: Sequence[LoraAdapterSpec]) -> AdapterSet:
    """A request's ``lora`` entries (id or name, scale or None for the configured one) as an
    :data:`AdapterSet`; raises InvalidRequest naming the entry for an adapter this engine has not
    loaded or one given twice."""
    by_name = {spec.name: i for i, spec in enumerate(specs)}
    chosen: dict[int, float] = {}
    for i, (ref, scale) in enumerate(refs):
        index = by_name.get(ref) if isinstance(ref, str) else ref
        if index is None or not 0 <= index < len(specs):
            loaded = ", ".join(f"{n} ({j})" for j, n in enumerate(by_name)) or "none"
            raise InvalidRequest(f"lora[{i}].id: no adapter {ref!r} is loaded (loaded: {loaded})",
                                 field=f"lora[{i}].id")
        if index in chosen:
            raise InvalidRequest(f"lora[{i}].id: adapter {specs[index].name!r} is named twice", field=f"lora[{i}].id")
        chosen[index] = specs[index].scale if scale is None else scale
    return tuple(sorted((i, s) for i, s in chosen.items() if s != 0.0))
