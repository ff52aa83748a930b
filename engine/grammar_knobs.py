"""The bounds on structured output's cost, apart from the compiler that applies them
(:mod:`slotq.engine.constraints`): every process's settings carry them, and a settings class must
not load llguidance and numpy with them (a producer that never sends a schema never needs either).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    import llguidance


class GrammarKnobs(BaseModel):
    """The bounds on what one request's structured output may cost (llguidance's parser limits).
    Producers check against them before enqueue and workers again when a request arrives, so both
    sides must agree: they are read from the same ``SLOTQ_GRAMMAR_*`` settings."""

    grammar_initial_fuel: int = Field(
        1_000_000, ge=1_000, le=1_000_000_000,
        description="work allowed for building a grammar's lexer (about 50k units per ms): bounds the time a "
                    "request's json_schema or grammar takes to compile")
    grammar_step_fuel: int = Field(
        100_000, ge=1_000, le=100_000_000,
        description="lexer work allowed for one token's mask (about 14k units per ms): bounds what a "
                    "constrained request adds to every decode step of its batch; a step over it ends that request")
    grammar_max_lexer_states: int = Field(
        50_000, ge=100, le=10_000_000,
        description="distinct lexer states one grammar may build (about 1-2 kB each): bounds its memory")
    grammar_max_size: int = Field(
        50_000, ge=100, le=65_000,
        description="symbols in a grammar after compilation; llguidance's own ceiling is 65,525, which it checks "
                    "only with a model's tokenizer (in the worker), so the bound producers check is kept below it")

    def parser_limits(self) -> llguidance.LLParserLimits:
        import llguidance

        return llguidance.LLParserLimits(initial_lexer_fuel=self.grammar_initial_fuel,
                                         step_lexer_fuel=self.grammar_step_fuel,
                                         max_lexer_states=self.grammar_max_lexer_states,
                                         max_grammar_size=self.grammar_max_size)

    def describe(self) -> str:
        return (f"SLOTQ_GRAMMAR_INITIAL_FUEL={self.grammar_initial_fuel}, SLOTQ_GRAMMAR_STEP_FUEL="
                f"{self.grammar_step_fuel}, SLOTQ_GRAMMAR_MAX_LEXER_STATES={self.grammar_max_lexer_states}, "
                f"SLOTQ_GRAMMAR_MAX_SIZE={self.grammar_max_size}")
