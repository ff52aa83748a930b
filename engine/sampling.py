"""Per-sequence sampler chains on llama.cpp's sampler API.

Each sequence owns one chain (its penalty history, constraint state and RNG are its own). The
chain order follows llama-server: the constraint's mask (a JSON schema or grammar, enforced by
llguidance: see ``slotq.engine.constraints``) -> logit bias -> penalties -> greedy, or top-k ->
top-p -> min-p -> temperature -> dist(seed). The mask comes first, as a grammar sampler placed
before the others would: it sets forbidden tokens to -inf in the logits row itself.
"""

from __future__ import annotations

from typing import Any

import llama_cpp

from slotq.engine.constraints import TokenMatcher
from slotq.engine.errors import InvalidRequest
from slotq.engine.request import GenerationRequest

# A "ban" is a huge finite penalty, not -inf: if a constraint allows only banned tokens, they must
# still outrank the -inf of the forbidden ones, or sampling would pick a token the constraint rejects.
BAN_BIAS = -1e30


class SamplerChain:
    """Owns one llama_sampler chain; free it exactly once."""

    def __init__(self, handle: llama_cpp.llama_sampler_p, matcher: TokenMatcher | None = None) -> None:
        self._handle: llama_cpp.llama_sampler_p | None = handle
        self._matcher = matcher

    @property
    def matcher(self) -> TokenMatcher | None:
        """The constraint the chain masks each row with (None: unconstrained)."""
        return self._matcher

    def arm(self, matcher: TokenMatcher) -> None:
        """Constrain the chain from its next sample on (a grammar armed lazily, at a tool call's marker)."""
        if self._matcher is not None:
            raise RuntimeError("the sampler chain is already constrained")
        self._matcher = matcher

    @property
    def handle(self) -> llama_cpp.llama_sampler_p:
        """The live chain. After :meth:`free` it is gone: llama.cpp would be handed a NULL chain."""
        if self._handle is None:
            raise RuntimeError("the sampler chain was used after free()")
        return self._handle

    def sample(self, ctx: Any, batch_index: int) -> int:
        """Sample (and accept) a token from the logits row of ``batch_index`` of the last decode.
        Raises :class:`~slotq.engine.errors.GrammarError` when the constraint fails (a mask step
        over its fuel): the caller ends this sequence."""
        if self._matcher is not None:
            self._matcher.mask(llama_cpp.llama_get_logits_ith(ctx, batch_index))
        token = int(llama_cpp.llama_sampler_sample(self.handle, ctx, batch_index))
        if self._matcher is not None:
            self._matcher.accept(token)
        return token

    def accept(self, token: int) -> None:
        """Feed a token the chain did not sample itself (a resumed attempt's delivered tokens; the
        constraint, if any, was walked past them when the request was checked)."""
        llama_cpp.llama_sampler_accept(self.handle, token)

    def free(self) -> None:
        if self._handle:
            llama_cpp.llama_sampler_free(self._handle)
            self._handle = None


def build_chain(request: GenerationRequest, vocab: llama_cpp.llama_vocab_p, n_vocab: int,
                eog_tokens: list[int], matcher: TokenMatcher | None, seed: int) -> SamplerChain:
    """A new chain for one sequence, constrained by ``matcher`` when given (the chain owns it)."""
    params = request.sampling
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    result = SamplerChain(chain, matcher)
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


__all__ = ["SamplerChain", "build_chain"]
