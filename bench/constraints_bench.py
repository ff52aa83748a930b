"""``slotq bench constraints``: what one request's JSON schema costs the other requests of its batch,
with llguidance (slotq's engine, ``slotq.engine.constraints``) beside llama.cpp's grammar sampler
(what slotq used before, and what llama-server uses without its llguidance build).

Sampling runs on the engine thread after each decode, one sequence after another, so a slow
constrained sampler delays every sequence of the batch. On the bundled model this decodes a batch
of ``SLOTS`` sequences step by step; at each step sequence 0 is sampled under the schema (both
engines alternate on the same logits, so the machine's noise hits both alike) and the other seven
plainly. A row reports the constrained sample's median cost, its own step when it runs alone (one
sequence: (decode + the constrained sample) / (decode + a plain one)), and the batch-mates' step:
(decode + 7 plain samples + the constrained one) / (decode + 8 plain samples); the issue's target
is <= 1.2x.
It also times the compile of each schema, and of the two "bombs" the probe found (``minItems``
10^8, an enum of 100,000 values): llama.cpp's converter is run on 1/1000 of ``minItems`` to show
its growth without taking the machine (at full size it took a worker to 12 GB).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import llama_cpp
from llama_cpp import llama_grammar

from bench.overhead_bench import THREADS
from bench.report import markdown_table, progress, write_results
from slotq.engine import EngineConfig, GenerationRequest, KVLayout, SamplingParams, bundled_model_path
from slotq.engine.constraints import ConstraintCompiler, constraint_for
from slotq.engine.errors import GrammarError
from slotq.engine.grammar_knobs import GrammarKnobs
from slotq.engine.llama_model import LlamaModel
from slotq.engine.sampling import build_chain

SLOTS = 8
PROMPT = 32

SCHEMAS: dict[str, dict[str, Any]] = {
    "object list": {"type": "array", "minItems": 40, "items": {
        "type": "object", "required": ["name", "city", "age"],
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}}}},
    "long string": {"type": "string", "minLength": 2000},
    "enum of 2,000": {"type": "array", "minItems": 200, "items": {"enum": [f"value-{i}" for i in range(2000)]}},
}
BOMBS: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    # name: (the schema, a smaller one for llama.cpp's converter where the real one would take the machine)
    "minItems 10^8": ({"type": "array", "minItems": 10**8, "items": {"type": "string"}},
                      {"type": "array", "minItems": 10**5, "items": {"type": "string"}}),
    "enum of 100,000": ({"enum": [f"v{i}" for i in range(100_000)]}, None),
}


class LlamaGrammarSampler:
    """llama.cpp's grammar sampler on its own: the pre-llguidance path, for comparison only."""

    def __init__(self, model: LlamaModel, schema: dict[str, Any]) -> None:
        grammar = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        self.bytes = len(grammar)
        self.sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
        self.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(self.chain, self.sampler)
        llama_cpp.llama_sampler_chain_add(self.chain, llama_cpp.llama_sampler_init_greedy())

    def sample(self, model: LlamaModel, index: int) -> int:
        return int(llama_cpp.llama_sampler_sample(self.chain, model._ctx, index))

    def free(self) -> None:
        llama_cpp.llama_sampler_free(self.chain)


class GuidanceSampler:
    """slotq's own path: the sampler chain the engine builds for a constrained greedy request."""

    def __init__(self, model: LlamaModel, compiler: ConstraintCompiler, eog: list[int], schema: dict[str, Any]) -> None:
        request = GenerationRequest(prompt="x", sampling=SamplingParams(temperature=0, json_schema=schema))
        constraint = constraint_for(request.sampling)
        assert constraint is not None
        self.chain = build_chain(request, model.vocab, model.n_vocab, eog,
                                 compiler.matcher(constraint, []), seed=0)

    def sample(self, model: LlamaModel, index: int) -> int:
        return model.sample(self.chain, index)

    def free(self) -> None:
        self.chain.free()


def _timed(call: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    value = call()
    return value, (time.perf_counter() - started) * 1000


def _batch_steps(model: LlamaModel, samplers: dict[str, Any], steps: int) -> dict[str, Any]:
    """Decode SLOTS sequences for ``steps`` steps; sequence 0's logits are sampled by every sampler
    (each walks its own schema; the batch continues with the plain token, so both see the same
    logits), the others by a plain greedy chain."""
    model.kv_clear()
    prompts = [model.tokenize(f"Item {seq}: write JSON about rivers and the towns along them.")[:PROMPT]
               for seq in range(SLOTS)]
    for seq, tokens in enumerate(prompts):     # all but the last token; the last ones decode as one batch
        assert model.decode(tokens[:-1], list(range(len(tokens) - 1)), [seq] * (len(tokens) - 1),
                            [False] * (len(tokens) - 1)) == 0
    positions = {seq: len(tokens) - 1 for seq, tokens in enumerate(prompts)}
    last = [tokens[-1] for tokens in prompts]
    assert model.decode(last, [positions[s] for s in range(SLOTS)], list(range(SLOTS)), [True] * SLOTS) == 0
    for seq in range(SLOTS):
        positions[seq] += 1
    plain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(plain, llama_cpp.llama_sampler_init_greedy())
    decode_ms: list[float] = []
    plain_ms: list[float] = []
    constrained_ms: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(steps):
        tokens = []
        for index in range(SLOTS):
            token, ms = _timed(lambda index=index: int(llama_cpp.llama_sampler_sample(plain, model._ctx, index)))
            tokens.append(token)
            plain_ms.append(ms)
        # In the order given: llguidance masks the logits row in place, so it samples last (llama.cpp's
        # sampler copies the row; the plain samples above are already taken).
        for name, sampler in samplers.items():
            try:
                _, ms = _timed(lambda sampler=sampler: sampler.sample(model, 0))
            except GrammarError:
                ms = float("nan")
            constrained_ms[name].append(ms)
        seqs = list(range(SLOTS))
        started = time.perf_counter()
        ret = model.decode(tokens, [positions[s] for s in seqs], seqs, [True] * SLOTS)
        decode_ms.append((time.perf_counter() - started) * 1000)
        assert ret == 0, f"llama_decode returned {ret}"
        for s in seqs:
            positions[s] += 1
    llama_cpp.llama_sampler_free(plain)
    alone_ms = []                     # sequence 0 decoding by itself: the constrained request alone on a worker
    for _ in range(max(8, steps // 4)):
        started = time.perf_counter()
        assert model.decode([tokens[0]], [positions[0]], [0], [True]) == 0
        alone_ms.append((time.perf_counter() - started) * 1000)
        positions[0] += 1
    decode, sample, alone = statistics.median(decode_ms), statistics.median(plain_ms), statistics.median(alone_ms)
    base = decode + SLOTS * sample
    out: dict[str, Any] = {"decode_ms": decode, "plain_sample_ms": sample, "alone_decode_ms": alone}
    for name, values in constrained_ms.items():
        cost = statistics.median(values)
        out[name] = {"sample_ms": cost, "max_ms": max(values), "batch_step_ratio": (base - sample + cost) / base,
                     "alone_step_ratio": (alone + cost) / (alone + sample)}
    return out


def _compile_row(model: LlamaModel, compiler: ConstraintCompiler, eog: list[int], name: str, schema: dict[str, Any],
                 smaller: dict[str, Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"schema": name}
    try:
        sampler, row["llguidance_build_ms"] = _timed(lambda: GuidanceSampler(model, compiler, eog, schema))
        sampler.free()
        row["llguidance"] = "accepted"
    except GrammarError as exc:
        row["llguidance"] = f"refused: {str(exc).split(': ', 1)[1].split(' (limit')[0]}"
        row["llguidance_build_ms"] = None
    grammar, row["llama_convert_ms"] = _timed(lambda: llama_grammar.json_schema_to_gbnf(json.dumps(smaller or schema)))
    row["llama_grammar_bytes"] = len(grammar)
    row["llama_scale"] = "" if smaller is None else " (at 1/1000 of minItems)"
    return row


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    steps = 24 if quick else 96
    model = LlamaModel(EngineConfig(model_path=bundled_model_path(), slots=SLOTS, cache_slots=0, ctx=4096,
                                    threads=THREADS, kv_layout=KVLayout.SPLIT, prefix_cache=False))
    eog = [t for t in range(model.n_vocab) if model.is_eog(t)]
    compiler = ConstraintCompiler(model.vocab, model.n_vocab, eog, GrammarKnobs())
    rows: list[list[str]] = []
    data: dict[str, Any] = {"slots": SLOTS, "steps": steps, "schemas": {}, "bombs": []}
    try:
        for name, schema in SCHEMAS.items():
            progress(f"{name}: {steps} steps of {SLOTS} sequences, both engines on sequence 0's logits")
            samplers: dict[str, Any] = {"llama.cpp grammar": LlamaGrammarSampler(model, schema),
                                        "llguidance": GuidanceSampler(model, compiler, eog, schema)}
            try:
                result = _batch_steps(model, samplers, steps)
            finally:
                for sampler in samplers.values():
                    sampler.free()
            data["schemas"][name] = result
            for engine in samplers:
                r = result[engine]
                rows.append([name, engine, f"{r['sample_ms']:.2f}", f"{r['max_ms']:.1f}",
                             f"{r['alone_step_ratio']:.2f}x",
                             f"{result['decode_ms'] + SLOTS * result['plain_sample_ms']:.1f}",
                             f"{r['batch_step_ratio']:.2f}x"])
        table = markdown_table(["schema", "engine", "constrained sample p50 ms", "max ms", "its step alone (1 seq)",
                                f"plain step ms ({SLOTS} seqs)", "batch-mates' step"], rows)
        bomb_rows = []
        for name, (schema, smaller) in BOMBS.items():
            progress(f"compiling {name}")
            row = _compile_row(model, compiler, eog, name, schema, smaller)
            data["bombs"].append(row)
            build = row["llguidance_build_ms"]
            bomb_rows.append([name, row["llguidance"], "" if build is None else f"{build:.1f}",
                              f"{row['llama_grammar_bytes']:,} bytes{row['llama_scale']}",
                              f"{row['llama_convert_ms']:.0f}"])
        table += "\n\n" + markdown_table(["schema", "llguidance (default limits)", "llguidance build ms",
                                          "llama.cpp converter output", "converter ms"], bomb_rows)
    finally:
        model.close()
    write_results("constraints", data, table, "slotq bench constraints" + (" --quick" if quick else ""))
    return data, table
