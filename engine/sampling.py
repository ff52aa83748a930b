"""Per-sequence sampler chains on llama.cpp's sampler API.

Each sequence owns one chain (its penalty history, grammar state and RNG are its own). The chain
order follows llama-server: logit bias -> penalties -> grammar -> greedy, or
top-k -> top-p -> min-p -> temperature -> dist(seed).
"""

from __future__ import annotations

import ctypes
import json
import math
import re
import threading

import llama_cpp
from llama_cpp import llama_grammar

from slotq.engine.errors import GrammarError, InvalidRequest
from slotq.engine.request import GenerationRequest

_grammar_lock = threading.Lock()
# llama.cpp logs grammar parse errors but reports them only as NULL; the lock keeps concurrent
# validations from interleaving (grammar init is not documented as thread-safe).

# A "ban" is a huge finite penalty, not -inf: if a grammar allows only banned tokens, every logit
# would be -inf, sampling would pick a token the grammar rejects, and llama.cpp aborts the process.
BAN_BIAS = -1e30


class SamplerChain:
    """Owns one llama_sampler chain; free it exactly once."""

    def __init__(self, handle: llama_cpp.llama_sampler_p) -> None:
        self._handle: llama_cpp.llama_sampler_p | None = handle

    @property
    def handle(self) -> llama_cpp.llama_sampler_p:
        """The live chain. After :meth:`free` it is gone: llama.cpp would be handed a NULL chain."""
        if self._handle is None:
            raise RuntimeError("the sampler chain was used after free()")
        return self._handle

    def accept(self, token: int) -> None:
        """Feed a token the chain did not sample itself (a resumed attempt's delivered tokens)."""
        llama_cpp.llama_sampler_accept(self.handle, token)

    def free(self) -> None:
        if self._handle:
            llama_cpp.llama_sampler_free(self._handle)
            self._handle = None


# llama-cpp-python's converter lets raw control characters into JSON strings, which JSON forbids.
_LOOSE_JSON_CHAR = 'char ::= [^"\\\\] |'
_STRICT_JSON_CHAR = 'char ::= [^"\\\\\\x00-\\x1F\\x7F] |'


def grammar_for(request: GenerationRequest) -> str | None:
    """The GBNF grammar a request asks for, converting a JSON schema if given."""
    params = request.sampling
    if params.json_schema is not None:
        try:
            grammar: str = llama_grammar.json_schema_to_gbnf(json.dumps(params.json_schema))
        except Exception as exc:  # the converter raises assorted errors on unsupported schemas
            raise GrammarError(f"sampling.json_schema: cannot be converted to a grammar: {exc}",
                               field="sampling.json_schema") from exc
        return grammar.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR)
    return params.grammar


def build_chain(request: GenerationRequest, vocab: llama_cpp.llama_vocab_p, n_vocab: int,
                eog_tokens: list[int], grammar: str | None, seed: int) -> SamplerChain:
    """A new chain for one sequence. Raises :class:`GrammarError` for a grammar llama.cpp rejects."""
    params = request.sampling
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    result = SamplerChain(chain)
    try:
        bias = {token: max(value, BAN_BIAS) for token, value in params.logit_bias.items()}
        if request.ignore_eos:
            bias.update(dict.fromkeys(eog_tokens, BAN_BIAS))
        for token in bias:
            if not 0 <= token < n_vocab:
                raise InvalidRequest(f"sampling.logit_bias: token id {token} is outside the vocabulary "
                                     f"(0..{n_vocab - 1})", field="sampling.logit_bias")
        if bias:
            arr = (llama_cpp.llama_logit_bias * len(bias))()
            for i, (token, value) in enumerate(bias.items()):
                arr[i].token = llama_cpp.llama_token(token)
                arr[i].bias = value
            _add(chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
        if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            _add(chain, _penalties(n_vocab, params.penalty_last_n, params.repeat_penalty,
                                   params.frequency_penalty, params.presence_penalty))
        if grammar is not None:
            _add(chain, _grammar_sampler(vocab, grammar))
        if params.temperature <= 0.0:
            _add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                _add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                _add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                _add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            _add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
            _add(chain, llama_cpp.llama_sampler_init_dist(seed))
    except BaseException:
        result.free()
        raise
    return result


_GBNF_LITERALS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')
_GBNF_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
MAX_GRAMMAR_REPEAT = 1000


def check_grammar(vocab: llama_cpp.llama_vocab_p, grammar: str) -> None:
    """Parse a grammar once and throw it away: a bad grammar fails the request at submit time.

    Repetition counts are checked first: llama.cpp expands ``x{m,n}`` into rules, never returns
    from an inverted range such as ``{2,1}`` (it allocates until the host runs out of memory) and
    grows without bound with huge counts.
    """
    for match in _GBNF_REPEAT.finditer(_GBNF_LITERALS.sub('""', grammar)):
        low, high = int(match.group(1)), match.group(2)
        if high not in (None, "") and int(high) < low:
            raise GrammarError(f"sampling.grammar: repetition {match.group(0)} has its maximum below its minimum",
                               field="sampling.grammar")
        if max(low, int(high or 0)) > MAX_GRAMMAR_REPEAT:
            raise GrammarError(f"sampling.grammar: repetition {match.group(0)} exceeds {MAX_GRAMMAR_REPEAT}",
                               field="sampling.grammar")
    llama_cpp.llama_sampler_free(_grammar_sampler(vocab, grammar))


def check_resume_tokens(vocab: llama_cpp.llama_vocab_p, grammar: str, tokens: list[int]) -> None:
    """Walk the grammar through an earlier attempt's tokens before the engine replays them:
    llama.cpp throws a C++ exception (the process aborts) when a sampler chain is made to accept
    a token its grammar forbids, so a forbidden one must be refused here, as a bad request."""
    sampler = _grammar_sampler(vocab, grammar)
    try:
        candidate = llama_cpp.llama_token_data()
        candidates = llama_cpp.llama_token_data_array(data=ctypes.pointer(candidate), size=1, selected=-1, sorted=False)
        for i, token in enumerate(tokens):
            candidate.id, candidate.logit, candidate.p = llama_cpp.llama_token(token), 0.0, 0.0
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
            if math.isinf(candidate.logit):
                raise InvalidRequest(f"resume_tokens: token {token} at position {i} is not allowed by the grammar",
                                     field="resume_tokens")
            llama_cpp.llama_sampler_accept(sampler, token)
    finally:
        llama_cpp.llama_sampler_free(sampler)


def _grammar_sampler(vocab: llama_cpp.llama_vocab_p, grammar: str) -> llama_cpp.llama_sampler_p:
    sampler: llama_cpp.llama_sampler_p     # llama_cpp's ctypes bindings are typed Any; this is their restype
    with _grammar_lock:
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise GrammarError("sampling.grammar: llama.cpp could not parse the GBNF grammar (it needs a 'root' rule)",
                           field="sampling.grammar")
    return sampler


def _penalties(n_vocab: int, last_n: int, repeat: float, freq: float, present: float) -> llama_cpp.llama_sampler_p:
    sampler: llama_cpp.llama_sampler_p     # llama_cpp's ctypes bindings are typed Any; this is their restype
    # The n_vocab first argument exists in some 0.3.x releases and not in others.
    if len(llama_cpp.llama_sampler_init_penalties.argtypes) == 5:
        sampler = llama_cpp.llama_sampler_init_penalties(n_vocab, last_n, repeat, freq, present)
    else:
        sampler = llama_cpp.llama_sampler_init_penalties(last_n, repeat, freq, present)
    return sampler


def _add(chain: llama_cpp.llama_sampler_p, sampler: llama_cpp.llama_sampler_p) -> None:
    if not sampler:
        raise RuntimeError("llama.cpp returned no sampler")
    llama_cpp.llama_sampler_chain_add(chain, sampler)


__all__ = ["SamplerChain", "build_chain", "check_grammar", "check_resume_tokens", "grammar_for"]
