"""Structured output: a request's JSON schema or GBNF grammar, compiled and enforced by llguidance.

Why llguidance and not llama.cpp's grammar sampler (measured on the bundled model, 2 cores; the
figures and the command are in docs/architecture.md, "Structured output"):

* **Cost is bounded by work, not by bytes.** llama-cpp-python's schema converter writes
  ``minItems``, ``maxItems``, ``minLength`` and ``maxLength`` out in full (about 17 bytes of grammar
  per item), so a 200-byte schema with ``minItems: 100000000`` became gigabytes in the worker.
  llguidance keeps repetitions symbolic and computes each token mask lazily, under *fuel* limits:
  one for building the grammar's lexer (``grammar_initial_fuel``), one per token
  (``grammar_step_fuel``), one on the lexer's states (``grammar_max_lexer_states``, about 2 kB
  each) and one on the grammar's size (``grammar_max_size``). A grammar that would exceed one is
  refused, naming the limit; one whose token step runs out of fuel mid-generation ends that
  request with the same error, never the worker.
* **Per token it is 15-25x cheaper.** llama.cpp's sampler tests every candidate of the 49k vocabulary
  against the grammar at every step: 7.4 ms for a small object schema, 300 ms for the first token
  of a 2,000-value enum, against 5.8 ms for the whole decode step of one sequence. Every request
  of the batch waits for it, since sampling runs on the engine thread. llguidance's mask costs
  0.3-0.5 ms for the same schemas, the 20,000-value enum included.
* **It checks without the model.** :func:`check_constraint` compiles and validates the grammar with
  no tokenizer, so producers (the Python client, hence the gateway and the Batch API) refuse a
  schema that the worker would refuse, before it is queued, with the same code and limits.

GBNF grammars (``sampling.grammar``) are translated to llguidance's Lark dialect by the converter
llguidance ships (``llguidance.gbnf_to_lark``, the one llama.cpp's own llguidance build uses). JSON
schemas compile with compact separators and no free whitespace (``whitespace_flexible`` off): a
small model otherwise fills its budget with newlines.

This module does not load llama.cpp: only :class:`ConstraintCompiler` needs a model's vocabulary,
and it imports ``llguidance.llamacpp`` when first used.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from slotq.engine.errors import GrammarError, InvalidRequest
from slotq.engine.grammar_knobs import GrammarKnobs

if TYPE_CHECKING:
    from slotq.engine.request import SamplingParams

COMPACT_JSON: Any = {"whitespace_flexible": False}   # llguidance's JsonCompileOptions (a TypedDict): see above
_SPARSE_WORDS = 4                           # forbid(): the sparse way when at most 1 in this many words allows a token
_BIT_OFFSETS = np.arange(32)


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12
# and draft 7): what with_subschemas rewrites. Anything else (const, enum, default,
# examples, a property's name) is data and stays as it is.
_SUBSCHEMA = frozenset({"items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                        "additionalProperties", "unevaluatedProperties", "unevaluatedItems"})
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})   # items: draft 7's tuples
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def with_subschemas(schema: Any, rewrite: Callable[[Any], Any]) -> Any:
    """``schema`` (a dict, or a list of them) with ``rewrite`` applied to each of its direct
    subschemas, the rest (data such as ``const`` or ``enum``, a property's name) as it is."""
    if isinstance(schema, list):
        return [rewrite(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rewrite(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [rewrite(item) for item in value]
        elif key in _SUBSCHEMA:
            out[key] = rewrite(value)
        else:
            out[key] = value
    return out


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing of other keys, as llama.cpp's grammar converter (llama-server)
    reads it: what pydantic, LangChain, instructor and pydantic-ai send without ``strict`` would let
    the model invent keys, and a small model does (6 of 6 replies on the bundled model, often
    padding until ``max_tokens``). A schema that wants other keys says ``additionalProperties: true``
    (or gives ``patternProperties``)."""
    out = with_subschemas(schema, closed_objects)
    if isinstance(out, dict) and isinstance(out.get("properties"), dict) and not {
            "additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint compiled to llguidance's grammar; ``field`` names the request
    field it came from, for errors."""

    field: str
    grammar: str


def constraint_for(sampling: SamplingParams) -> Constraint | None:
    """The constraint a request's sampling asks for (None: unconstrained). Raises
    :class:`GrammarError` naming the field for a schema or grammar that cannot be compiled."""
    if sampling.json_schema is not None:
        try:
            return Constraint("sampling.json_schema",
                              llguidance.LLMatcher.grammar_from_json_schema(closed_objects(sampling.json_schema),
                                                                            COMPACT_JSON))
        except Exception as exc:  # llguidance raises ValueError, and its converter assorted errors
            raise GrammarError(f"sampling.json_schema: cannot be compiled: {exc}",
                               field="sampling.json_schema") from None
    if sampling.grammar is not None:
        try:
            lark = gbnf_to_lark(sampling.grammar)
            return Constraint("sampling.grammar", llguidance.LLMatcher.grammar_from_lark(lark))
        except Exception as exc:  # gbnf_to_lark raises its own error class and plain Exceptions
            raise GrammarError(f"sampling.grammar: not a valid GBNF grammar (it needs a 'root' rule): {exc}",
                               field="sampling.grammar") from None
    return None


def check_constraint(sampling: SamplingParams, knobs: GrammarKnobs) -> None:
    """Refuse, before anything is queued, a schema or grammar the worker would refuse: it is
    compiled and validated under the same limits, without a tokenizer (no model needed)."""
    constraint = constraint_for(sampling)
    if constraint is not None:
        validate_constraint(constraint, knobs)


def validate_constraint(constraint: Constraint, knobs: GrammarKnobs) -> None:
    """Raise :class:`GrammarError` naming the constraint's field if it breaks the limits."""
    _raise_if_error(constraint, llguidance.LLMatcher.validate_grammar(constraint.grammar, None,
                                                                      limits=knobs.parser_limits()), knobs)


def _raise_if_error(constraint: Constraint, message: str, knobs: GrammarKnobs) -> None:
    """llguidance reports a limit it hit in words ("... too big (limit for this grammar: N)", "...
    fuel ..."); such a refusal also names the settings that set the limits."""
    if message:
        message = message.strip()
        if any(word in message.lower() for word in ("limit", "fuel", "too big", "too many")):
            message += f" (limits: {knobs.describe()})"
        raise GrammarError(f"{constraint.field}: {message}", field=constraint.field)


class TokenMatcher:
    """One sequence's constraint state: masks its logits row before each sample, then follows the
    token sampled. Owned by that sequence's sampler chain (engine thread only)."""

    def __init__(self, matcher: llguidance.LLMatcher, constraint: Constraint, knobs: GrammarKnobs,
                 n_vocab: int) -> None:
        self._matcher = matcher
        self._constraint = constraint
        self._knobs = knobs
        self._n_vocab = n_vocab
        self._bitmask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._masked_row: int | None = None     # the address of a row StepMasks masked for this matcher's next token

    def mask(self, logits: ctypes._Pointer[ctypes.c_float]) -> None:
        """Set every token the constraint forbids next to -inf in this logits row (llama.cpp's own
        grammar sampler does the same); the chain's samplers then choose among the rest. A row
        :class:`StepMasks` already masked for this matcher is left as it is."""
        if self._masked_row is not None and self._masked_row == ctypes.cast(logits, ctypes.c_void_p).value:
            self._masked_row = None
            return
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        self.raise_if_error()
        forbid(np.ctypeslib.as_array(logits, shape=(self._n_vocab,)), self._bitmask)

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)
        self.raise_if_error()

    def follows(self, tokens: list[int]) -> bool:
        """Walk past ``tokens`` the model wrote before this matcher was armed (a lazy grammar's
        trigger); False when the constraint refuses them."""
        return bool(self._matcher.consume_tokens(tokens)) and not self._matcher.is_error()

    def raise_if_error(self) -> None:
        if self._matcher.is_error():
            _raise_if_error(self._constraint, self._matcher.get_error(), self._knobs)

    def fork(self) -> TokenMatcher:
        """An independent copy in the same state (another choice of the same request)."""
        return TokenMatcher(self._matcher.deep_copy(), self._constraint, self._knobs, self._n_vocab)


class StepMasks:
    """Masks the rows of a step's constrained sequences together, before any of them samples:
    llguidance's executor computes every mask at once (in its own threads, without the GIL,
    instead of one sequence after another on the engine thread), then each row is written as a
    matcher's own mask writes it (:func:`forbid`). The row a
    matcher's next :meth:`TokenMatcher.mask` call gets is then left as it is. A matcher whose
    mask step failed is not marked: its own call fails at its sample, ending only its request.

    Called once per step (marks of the step before are cleared first, so a mark never outlives
    its step, whether or not its sequence sampled); a draft row's mask depends on the token
    sampled before it, so only each sequence's first row is masked here."""

    def __init__(self, n_vocab: int) -> None:
        self._n_vocab = n_vocab
        self._executor: llguidance.LLExecutor | None = None     # its threads start on first use
        self._marked: list[TokenMatcher] = []

    def apply(self, rows: list[tuple[TokenMatcher, np.ndarray]]) -> None:
        """Mask each logits row (a float32 view of ``n_vocab`` entries) for its matcher's next token."""
        for matcher in self._marked:
            matcher._masked_row = None
        self._marked = []
        if not rows:
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = np.empty((len(rows), (self._n_vocab + 31) // 32), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(matcher._matcher, i) for i, (matcher, _) in enumerate(rows)],
                                               bitmask.ctypes.data, bitmask.shape[1] * 4, len(rows))
        for (matcher, row), words in zip(rows, bitmask, strict=True):
            if matcher._matcher.is_error():
                continue
            forbid(row, words)          # row by row: each row's unpacked mask stays in cache
            matcher._masked_row = row.ctypes.data
            self._marked.append(matcher)


def forbid(row: np.ndarray, allowed_bits: np.ndarray) -> None:
    """Set the entries of a logits ``row`` whose bit in llguidance's ``allowed_bits`` (int32 words,
    token ``t`` at bit ``t % 32`` of word ``t // 32``) is clear to -inf.

    A grammar usually allows few tokens (a JSON key, a digit, a closing bracket), so when at most
    a quarter of the words hold an allowed token the row is filled with -inf (a memset) and only
    the allowed entries are put back: about 40% cheaper at 151k than unpacking every bit and
    writing through a boolean mask, which is still the way when much is allowed (free text)."""
    words = np.flatnonzero(allowed_bits)
    if len(words) * _SPARSE_WORDS > len(allowed_bits):
        forbidden = np.unpackbits((~allowed_bits).view(np.uint8), bitorder="little", count=len(row)).view(np.bool_)
        np.copyto(row, -np.inf, where=forbidden)
        return
    bits = np.unpackbits(allowed_bits[words].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little").view(np.bool_)
    allowed = (words[:, None] * 32 + _BIT_OFFSETS)[bits]
    allowed = allowed[allowed < len(row)]
    kept = row[allowed]
    row.fill(-np.inf)
    row[allowed] = kept


class ConstraintCompiler:
    """Builds :class:`TokenMatcher` objects for one model. The tokenizer llguidance needs (every
    token's bytes, about 0.4 s for a 49k vocabulary) is made on first use, so an engine that never
    sees a constrained request never pays for it."""

    def __init__(self, vocab: Any, n_vocab: int, eog_tokens: list[int], knobs: GrammarKnobs) -> None:
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._eog_tokens = eog_tokens
        self.knobs = knobs
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab  # imports llama_cpp: engine side only

                with warnings.catch_warnings():     # it calls llama_token_get_attr, deprecated, once per token
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(self._vocab, n_vocab=self._n_vocab,
                                                             eos_token=self._eog_tokens or None)
            return self._tokenizer

    def tokenize(self, text: bytes) -> list[int]:
        """``text`` as tokens a matcher can follow, control tokens' names spelled as plain text."""
        return list(self.tokenizer().tokenize_bytes(text))

    def matcher(self, constraint: Constraint, resume_tokens: list[int]) -> TokenMatcher:
        """A matcher for a new request, already past ``resume_tokens`` (an earlier attempt's
        output). Raises :class:`GrammarError` for a grammar over the limits and
        :class:`InvalidRequest` (field ``resume_tokens``) for tokens the constraint forbids."""
        matcher = llguidance.LLMatcher(self.tokenizer(), constraint.grammar, log_level=0,
                                       limits=self.knobs.parser_limits())
        result = TokenMatcher(matcher, constraint, self.knobs, self._n_vocab)
        result.raise_if_error()
        for i, token in enumerate(resume_tokens):
            if not matcher.consume_token(token):      # False: the matcher is in its error state
                raise InvalidRequest(f"resume_tokens: token {token} at position {i} is not allowed by "
                                     f"{constraint.field}", field="resume_tokens")
        return result


__all__ = ["Constraint", "ConstraintCompiler", "GrammarKnobs", "StepMasks", "TokenMatcher", "check_constraint",
           "constraint_for", "validate_constraint"]
