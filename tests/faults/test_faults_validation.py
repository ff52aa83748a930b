"""Property-based fault injection on request validation (hypothesis).

Arbitrary values for every JobRequest field -- wrong types, huge numbers, NaN and infinities, odd
unicode, nested junk, unknown keys -- must either validate or raise pydantic's ValidationError;
whatever validates must survive the trip through Redis unchanged; and enqueued to a real worker
(tiny model, max_tokens capped) it must end succeeded, or failed with a known error code, without
ever killing the worker.
"""

from __future__ import annotations

import asyncio
import math
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobRequest, JobStatus
from slotq.jobs.protocol.serialization import deserialize, serialize
from tests.support.faults import Fleet, known_bug, worker_env
from tests.support.jobs import jobs_in_queue, raw_entries, settings_for

pytestmark = pytest.mark.fault

# ---------------------------------------------------------------------- strategies
ODD_TEXT = st.text(alphabet=st.characters(codec=None), max_size=24) | st.sampled_from([
    "", " ", "\x00", "\x00\x01\x02", "\u200b\u200d\ufeff", "e\u0301\u0301\u0301", "\U0001f600" * 5, "\ufffd",
    "<|im_start|>", "</s>", "<s>", "{{ messages }}", "{% for %}", "\r\n\t", "a" * 300, "\ud800", "\udfff"])
HUGE_INTS = st.integers() | st.sampled_from([2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64, 2**80, -(2**63), -(2**64)])
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324])
SCALARS = st.none() | st.booleans() | HUGE_INTS | FLOATS | ODD_TEXT | st.binary(max_size=8)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(ODD_TEXT | st.integers(), inner, max_size=3)
                    | st.tuples(inner, inner) | st.frozensets(st.integers(), max_size=3), max_leaves=8)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False)
                           | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=8)
GRAMMARS = st.sampled_from([
    'root ::= "a"', 'root ::= [a-z]+', 'root ::= "a" | "b" root', 'root ::= ( "x" )* "y"', 'root ::= [^a]',
    'root ::= "', 'root ::= [', 'root ::= [a-', 'root ::= root', 'root ::= x', 'x ::= "a"', 'root ::=', "root",
    '::= "a"', 'root ::= "\\', 'root ::= "\\x"', 'root ::= "\\u12"', 'root ::= ("a"',
    'root ::= "a"{99999}', 'root ::= "a"{2,1}', 'root ::= [\\]', "root ::= 'a'", "", "\x00", 'root ::= "" ',
    'root ::= "\U0001f600"+']) | ODD_TEXT
SCHEMAS = st.sampled_from([
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "pattern": "^[a-c]+$"}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"enum": [1, "x", None]}, {"$ref": "#/nowhere"}, {"type": "nonsense"}, {"anyOf": []}, {},
    {"type": "string", "pattern": "("}, {"type": "integer", "minimum": 10, "maximum": 1},
    {"type": "object", "properties": {"a": {"$ref": "#"}}}]) | st.dictionaries(st.text(max_size=6), JSON_VALUES,
                                                                             max_size=3)


VALID_TEXT = ODD_TEXT.filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t))
STOP = VALID_TEXT.filter(lambda t: 0 < len(t) <= 256)


def plausible_request(field: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Requests built field by field from ``field(valid_values)``: with ``field=lambda s: s`` they
    are mostly valid, right up to every bound; with junk mixed in, mostly not."""
    sampling = st.fixed_dictionaries({}, optional={
        "temperature": field(st.floats(0, 5) | st.sampled_from([0.0, 5.0, 1e-300])),
        "top_k": field(st.integers(0, 100_000)),
        "top_p": field(st.floats(1e-9, 1.0)),
        "min_p": field(st.floats(0, 1)),
        "repeat_penalty": field(st.floats(1e-9, 10)),
        "presence_penalty": field(st.floats(-2, 2)),
        "frequency_penalty": field(st.floats(-2, 2)),
        "penalty_last_n": field(st.integers(-1, 1_000_000)),
        "seed": field(st.integers(0, 2**32 - 2)),
        "logit_bias": field(st.dictionaries(st.integers(-3, 400) | st.sampled_from([2**31, 2**40]),
                                            FLOATS, max_size=4)),
        "grammar": field(GRAMMARS),
        "json_schema": field(SCHEMAS),
    })
    sampling = st.one_of(sampling.filter(lambda d: not ("grammar" in d and "json_schema" in d)),
                         st.just({"temperature": 0}))
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                               "content": VALID_TEXT}), min_size=1, max_size=3)
    body = st.fixed_dictionaries({}, optional={
        "max_tokens": field(st.integers(1, 1_000_000) | st.sampled_from([1, 2, 12])),
        "n": field(st.integers(1, 64) | st.sampled_from([1, 2])),
        "stop": field(st.lists(STOP, max_size=16)),
        "ignore_eos": field(st.booleans()),
        "sampling": field(sampling),
        "priority": field(st.integers(-100, 100)),
        "deadline": field(FLOATS | st.sampled_from([0.0, 1.0, 4e9])),
        "idempotency_key": field(st.from_regex(r"[A-Za-z0-9._:\-]{1,40}", fullmatch=True)),
        "metadata": field(st.dictionaries(VALID_TEXT, st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1)
                                          | FLOATS | VALID_TEXT, max_size=4)),
    })
    source = st.one_of(st.fixed_dictionaries({"prompt": field(VALID_TEXT)}),
                       st.fixed_dictionaries({"messages": field(messages)}))
    return st.builds(lambda a, b: {**a, **b}, source, body)


def _sometimes_junk(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, JUNK)


CONSTRAINED = st.fixed_dictionaries({
    "prompt": VALID_TEXT | st.sampled_from(["x" * 2000, "<|im_start|>user\nhi<|im_end|>\n" * 40]),
    "sampling": st.one_of(
        st.fixed_dictionaries({"grammar": GRAMMARS}, optional={"temperature": st.floats(0, 5)}),
        st.fixed_dictionaries({"json_schema": SCHEMAS}, optional={"temperature": st.floats(0, 5)}),
        st.fixed_dictionaries({"logit_bias": st.dictionaries(st.integers(-3, 400), FLOATS, min_size=1, max_size=300)},
                              optional={"temperature": st.floats(0, 5), "penalty_last_n": st.integers(-1, 10**6),
                                        "repeat_penalty": st.floats(1e-9, 10)})),
}, optional={"max_tokens": st.integers(1, 1_000_000), "ignore_eos": st.booleans(),
             "stop": st.lists(STOP, max_size=16), "n": st.integers(1, 64)})
MOSTLY_VALID = st.one_of(plausible_request(lambda s: s), CONSTRAINED)
REQUEST = st.one_of(
    plausible_request(_sometimes_junk),                                  # one odd field here and there
    plausible_request(lambda s: s).map(lambda d: {**d, "bogus": 1}),     # an unknown key
    st.builds(lambda a, b: {**a, **b}, MOSTLY_VALID, st.fixed_dictionaries({"prompt": VALID_TEXT},
                                                                           optional={"messages": JUNK})),
    st.dictionaries(ODD_TEXT, JUNK, max_size=4),                         # junk keys and values
    JUNK,                                                                # not even a dict
    MOSTLY_VALID,
)

# What the job path answers a bad request with: the engine's error codes and the job layer's own.
KNOWN_ERROR_CODES = {"invalid_request", "prompt_too_long", "invalid_grammar", "kv_exhausted", "decode_failed",
                     "engine_error", "engine_stopped", "engine_dead", "request_failed", "expired", "invalid_payload",
                     "poison_payload", "tries_exhausted", "unsupported_payload_version"}


def _validate(payload: Any) -> JobRequest | None:
    """Validation either succeeds or raises ValidationError -- any other exception fails the test."""
    try:
        return JobRequest.model_validate(payload)
    except ValidationError as exc:
        assert exc.errors(), exc
        return None


def _wire(request: JobRequest) -> Any:
    """What SlotqClient.enqueue puts in Redis and what the worker reads back out of it."""
    dumped = request.model_dump(mode="json", exclude_defaults=True)
    return deserialize(serialize({"f": "generate", "a": [dumped], "k": {}, "et": 0}))["a"][0]


def _same(a: Any, b: Any) -> bool:
    """Equality that treats NaN as equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------- validation alone
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=REQUEST)
def test_any_payload_validates_or_raises_validation_error(payload):
    request = _validate(payload)
    if request is not None:
        assert request.max_tokens >= 1 and 1 <= request.n <= 64
        assert (request.prompt is None) != (request.messages is None)
    # the same through keyword arguments (SlotqClient.enqueue("prompt", **fields) builds it this way)
    if isinstance(payload, dict) and all(isinstance(k, str) for k in payload):
        try:
            JobRequest(**payload)
        except ValidationError:
            pass


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=REQUEST)
def test_validated_requests_cross_redis_unchanged(payload):
    """The worker re-validates the payload it reads from Redis: it must get the same request back
    (and whatever validated must serialize at all)."""
    request = _validate(payload)
    if request is None:
        return
    again = JobRequest.model_validate(_wire(request))
    assert _same(again.model_dump(), request.model_dump()), (request, again)


@pytest.mark.parametrize("payload", [
    {"prompt": "x", "metadata": {"big": 2**64}},
    {"prompt": "x", "sampling": {"json_schema": {"type": "integer", "maximum": 2**70}}},
    {"prompt": "x", "sampling": {"json_schema": {"type": "string", "enum": ["\ud800"]}}},
    {"prompt": "x", "sampling": {"json_schema": {"type": "string", "const": b"\xff"}}},
], ids=["metadata-int-65-bits", "json-schema-int-70-bits", "json-schema-lone-surrogate", "json-schema-bytes"])
async def test_unserializable_request_fails_validation_and_queues_nothing(client, payload):
    """Values pydantic would accept but msgpack cannot carry are rejected as a ValidationError."""
    with pytest.raises(ValidationError):
        JobRequest.model_validate(payload)
    fields = {k: v for k, v in payload.items() if k != "prompt"}
    with pytest.raises(ValidationError):
        await client.enqueue(payload["prompt"], **fields)
    assert await jobs_in_queue(client) == 0
    assert await client.redis.keys("arq:job:*") == []


@pytest.mark.parametrize("bound", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_json_schema_with_non_finite_number_is_rejected_or_kept(bound):
    payload = {"prompt": "x", "sampling": {"json_schema": {"type": "number", "maximum": bound}}}
    request = _validate(payload)
    if request is None:
        return                                   # rejected: fine (JSON has no such numbers)
    arrived = JobRequest.model_validate(_wire(request)).sampling.json_schema
    known_bug(_same(arrived, request.sampling.json_schema), f"enqueued {request.sampling.json_schema}, "
                                                             f"the worker gets {arrived}")


# ---------------------------------------------------------------------- a grammar that never parses
_GRAMMAR_PROBE = """
import asyncio, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))   # never let a runaway parse eat the host
from slotq.engine import Engine, EngineConfig, EngineError, GenerationRequest, SamplingParams

async def main():
    engine = await Engine.start(EngineConfig(model_path=sys.argv[1], slots=1, ctx=256, threads=1))
    started = time.monotonic()
    try:
        engine.submit(GenerationRequest(prompt="hi", max_tokens=4, sampling=SamplingParams(grammar=sys.argv[2])))
        outcome = "accepted"
    except EngineError as exc:
        outcome = exc.code
    print("OUTCOME", outcome, round(time.monotonic() - started, 3), flush=True)
    await engine.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("grammar", ['root ::= "a"{2,1}', 'root ::= [a-z]{9,0}', 'root ::= ("a" | "b"){5,4} "c"'])
async def test_grammar_with_inverted_repetition_is_rejected_at_once(tiny_model_path, grammar):
    """Run in a child process capped at 1 GiB of address space and killed after 20 s."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _GRAMMAR_PROBE, str(tiny_model_path), grammar,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(20):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"parsing {grammar!r} did not return within 20 s") from None
    text = out.decode(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith("OUTCOME")), None)
    assert proc.returncode == 0 and line is not None, \
        f"the parse of {grammar!r} crashed the process (exit {proc.returncode}): {text[-500:]}"
    _, outcome, seconds = line.split()
    assert float(seconds) < 1.0, f"parsing {grammar!r} took {seconds} s ({outcome})"
    assert outcome == "invalid_grammar", text


# ---------------------------------------------------------------------- through a worker
MAX_EXAMPLES_WORKER = 60


def test_validated_requests_never_kill_the_worker(fsync_redis, tiny_model_path, tmp_path, monkeypatch):
    """Every request that validates (drawn from values valid up to every bound, so most do), sent to
    a real worker (max_tokens capped at 12, n at 2), ends succeeded or failed with a known error
    code within 15 s, and the worker lives on. The worker is what is tested, so the producer's own
    check of schemas and grammars (which would refuse the bad ones before enqueue) is off here:
    the worker must hold for a producer configured with other limits, or none."""
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    client = run(SlotqClient.connect(fsync_redis.url, settings_for(fsync_redis.url)))

    async def unchecked(request: JobRequest) -> None:
        return None

    monkeypatch.setattr(client, "_check_constraint", unchecked)
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=2, ctx=512), tmp_path)
    fleet.spawn("v1")
    outcomes: dict[str, int] = {}
    odd_codes: list[str] = []
    try:
        run(fleet.wait_ready("v1"))
        pid = fleet.procs["v1"].proc.pid

        async def one(request: JobRequest) -> None:
            request = request.model_copy(update={"max_tokens": min(request.max_tokens, 12), "n": min(request.n, 2)})
            handle = await client.enqueue(request)
            result = await handle.result(timeout=15)
            assert fleet.procs["v1"].proc.poll() is None, fleet.logs()
            assert result.status in (JobStatus.SUCCEEDED, JobStatus.FAILED), result
            key = result.status.value if result.error is None else f"failed:{result.error.code}"
            outcomes[key] = outcomes.get(key, 0) + 1
            if result.status == JobStatus.FAILED:
                assert result.error is not None and result.error.code, result
                if result.error.code not in KNOWN_ERROR_CODES:
                    odd_codes.append(f"{result.error.code}: {result.error.message} <- {request!r}")
            else:
                entries = await raw_entries(client, result.id)
                assert sum(e.final for e in entries) == 1 and entries[-1].final
                assert "".join(e.text for e in entries if e.kind == "chunk" and e.choice == 0) == result.text

        # no shrinking: a failing example here can cost the 15 s result timeout per try
        @settings(max_examples=MAX_EXAMPLES_WORKER, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(payload=MOSTLY_VALID)
        def property_(payload):
            request = _validate(payload)
            if request is not None:
                run(one(request))

        property_()
        # still the same process, and it still serves
        assert fleet.procs["v1"].proc.poll() is None and fleet.procs["v1"].proc.pid == pid
        last = run(client.enqueue(JobRequest(prompt="still alive?", max_tokens=4, ignore_eos=True)))
        assert run(last.result(timeout=30)).status == JobStatus.SUCCEEDED
        print(f"VALIDATION outcomes={dict(sorted(outcomes.items()))}")
        assert sum(outcomes.values()) > 0, "no example validated: the strategy needs more plausible values"
        assert not odd_codes, "unexpected exception inside the job function: " + "; ".join(odd_codes[:3])
    finally:
        codes = fleet.stop_all()
        run(client.close())
        loop.close()
    assert codes == {"v1": 0}, fleet.logs()
