"""The worker's stream writer (jobs/worker/stream_writer.py): when it flushes (a pure policy), what one flush
writes, and fencing per job inside one flush. Real Valkey; no worker, no model, no timing."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from slotq.jobs.protocol.keys import stream_key
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.streams import decode_entry, encode_chunk
from slotq.jobs.protocol.wire import FinishReason, TokenLogprob, TopLogprob
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.worker.stream_writer import FlushPolicy, StreamWriter
from tests.support.jobs import fences_raised

POLICY = FlushPolicy(max_delay_s=0.1)


def test_a_flush_waits_until_its_tokens_pay_for_its_commands_and_entries() -> None:
    fixed, entry = FlushPolicy.FIXED_COMMANDS, FlushPolicy.ENTRY_COST
    # one job, one entry: worth it from fixed + entry tokens on
    assert POLICY.due_in(waited_s=0.0, tokens=fixed + entry - 1, entries=1, buckets=1, urgent=False) == \
        pytest.approx(0.1)
    assert POLICY.due_in(waited_s=0.0, tokens=fixed + entry, entries=1, buckets=1, urgent=False) == 0.0
    # eight jobs with one token each (one decode step) wait; once they carry the entries' cost, they go
    assert POLICY.due_in(waited_s=0.03, tokens=8, entries=8, buckets=1, urgent=False) == pytest.approx(0.07)
    assert POLICY.due_in(waited_s=0.03, tokens=8 * entry + fixed, entries=8, buckets=1, urgent=False) == 0.0
    # on a cluster the same eight jobs in four stream buckets cost four times the fixed commands: they wait for more
    assert POLICY.due_in(waited_s=0.03, tokens=8 * entry + fixed, entries=8, buckets=4, urgent=False) == \
        pytest.approx(0.07)
    assert POLICY.due_in(waited_s=0.03, tokens=8 * entry + 4 * fixed, entries=8, buckets=4, urgent=False) == 0.0


def test_nothing_waits_longer_than_the_max_delay_and_urgent_entries_go_at_once() -> None:
    assert POLICY.due_in(waited_s=0.1, tokens=1, entries=1, buckets=1, urgent=False) == 0.0
    assert POLICY.due_in(waited_s=5.0, tokens=1, entries=1, buckets=1, urgent=False) == 0.0
    assert POLICY.due_in(waited_s=0.0, tokens=0, entries=1, buckets=1, urgent=True) == 0.0


@pytest.fixture
async def redis(redis_url: str):
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()


async def entries(redis: Redis, job_id: str) -> list[StreamEntry]:
    return [decode_entry(i, raw) for i, raw in await redis.xrange(stream_key(job_id))]


async def test_consecutive_chunks_merge_into_one_entry_per_flush(redis) -> None:
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60)
    for n, text in enumerate(["Hel", "lo", ", ", "world"], start=1):
        writer.add_chunk("j", attempt=1, choice=0, text=text, token_ids=[n], n_tokens=n,
                         **({"prompt_tokens": 12, "cached_prompt_tokens": 5} if n == 1 else {}))   # the first
    writer.add_chunk("j", attempt=1, choice=1, text="other", token_ids=[9], n_tokens=1)
    writer.add("j", StreamEntry(id="", kind=EntryKind.DONE, attempt=1, finish_reason=FinishReason.LENGTH, final=True))
    assert await writer.flush()
    got = await entries(redis, "j")
    assert [(e.kind, e.choice, e.text, e.token_ids, e.n_tokens) for e in got] == [
        (EntryKind.CHUNK, 0, "Hello, world", [1, 2, 3, 4], 4),
        (EntryKind.CHUNK, 1, "other", [9], 1),
        (EntryKind.DONE, 0, "", [], 0),
    ]
    assert got[-1].final and writer.round_trips == 1
    assert (got[0].prompt_tokens, got[0].cached_prompt_tokens) == (12, 5) and got[1].prompt_tokens is None
    assert 0 < await redis.ttl(stream_key("j")) <= 60


def logprob(token: int, piece: bytes) -> TokenLogprob:
    text = piece.decode("utf-8", errors="replace") if piece != b"\xe2" else "bytes:\\xe2"
    return TokenLogprob(id=token, token=text, token_bytes=list(piece), logprob=-0.5 * token,
                        top=[TopLogprob(id=token, token=text, token_bytes=list(piece), logprob=-0.5 * token),
                             TopLogprob(id=99, token="é", token_bytes=list("é".encode()), logprob=-7.25)])


async def test_merged_chunks_keep_one_logprob_per_token_and_older_entries_decode_without(redis) -> None:
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60)
    pieces = [b"a", b"\xe2", b"", b"z"]          # a piece of a character; a token with no text
    for n, piece in enumerate(pieces, start=1):
        writer.add_chunk("lp", attempt=1, choice=0, text="x", token_ids=[n], n_tokens=n,
                         logprobs=[logprob(n, piece)])
    writer.add_chunk("lp", attempt=1, choice=0, text="!", token_ids=[], n_tokens=4, logprobs=None)  # a held tail
    writer.add_chunk("plain", attempt=1, choice=0, text="y", token_ids=[7], n_tokens=1)
    assert await writer.flush()
    [chunk] = await entries(redis, "lp")
    assert chunk.token_ids == [1, 2, 3, 4] and chunk.text == "xxxx!"
    assert chunk.logprobs == [logprob(n, piece) for n, piece in enumerate(pieces, start=1)]
    [plain] = await entries(redis, "plain")
    assert plain.logprobs is None
    old = encode_chunk(attempt=1, choice=0, text="y", token_ids=[7], n_tokens=1)    # as a 1.2 worker wrote it
    assert "lp" not in old and decode_entry("1-0", old).logprobs is None


async def test_one_flush_writes_the_jobs_it_owns_and_reports_the_one_it_lost(redis) -> None:
    assert await fences_raised(redis, {"mine": "w#1", "also-mine": "w#2", "lost": "other#3"}) == {
        "mine": True, "also-mine": True, "lost": True}
    lost: list[tuple[str, str]] = []
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60,
                          on_fenced=lambda job, lease: lost.append((job, lease)))
    for job, lease in (("mine", "w#1"), ("lost", "w#3"), ("also-mine", "w#2")):
        writer.bind(job, lease)
        writer.add_chunk(job, attempt=1, choice=0, text=job, token_ids=[1], n_tokens=1)
    assert await writer.flush()
    assert writer.round_trips == 1
    assert [e.text for e in await entries(redis, "mine")] == ["mine"]
    assert [e.text for e in await entries(redis, "also-mine")] == ["also-mine"]
    assert await entries(redis, "lost") == []
    assert lost == [("lost", "w#3")]
    # what the lost job adds afterwards is still refused; the others go on
    writer.add_chunk("lost", attempt=1, choice=0, text="again", token_ids=[2], n_tokens=2)
    writer.add_chunk("mine", attempt=1, choice=0, text="+", token_ids=[2], n_tokens=2)
    assert await writer.flush()
    assert await entries(redis, "lost") == []
    assert [e.text for e in await entries(redis, "mine")] == ["mine", "+"]
    assert lost == [("lost", "w#3"), ("lost", "w#3")]


async def test_entries_buffered_by_an_attempt_are_refused_once_the_same_worker_claims_the_job_again(
        tmp_path) -> None:
    """A Redis outage longer than the lease: the reaper requeues a running job and its own worker
    claims it again, with a new lease. The old attempt's flush, still waiting to be re-sent, must
    not land behind the stream the new attempt resumed from (that wrote tokens twice)."""
    server = EmbeddedRedis(tmp_path / "redis", port=0, fsync="always")
    server.start()
    redis = Redis.from_url(server.url, socket_timeout=2)
    lost: list[tuple[str, str]] = []
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60, writer_id="w",
                          on_fenced=lambda job, lease: lost.append((job, lease)))
    try:
        writer.bind("j", "w#1")
        assert (await writer.open("j")).raised
        writer.add_chunk("j", attempt=1, choice=0, text="a", token_ids=[1], n_tokens=1)
        assert await writer.flush()
        writer.add_chunk("j", attempt=1, choice=0, text="b", token_ids=[2], n_tokens=2)
        server.kill()
        assert not await writer.flush()                 # "b" stays in flight, to be re-sent
        server.restart()
        writer.unbind("j")                              # reaped and claimed again by this worker
        writer.bind("j", "w#2")
        assert (await writer.open("j")).raised
        writer.add_chunk("j", attempt=2, choice=0, text="b", token_ids=[2], n_tokens=2)   # resumed after "a"
        assert await writer.flush()                     # the old flight: refused
        assert await writer.flush()                     # the new attempt's entry
        got = await entries(redis, "j")
        assert [(e.attempt, e.text) for e in got] == [(1, "a"), (2, "b")]
        assert lost == [("j", "w#1")]
    finally:
        await redis.aclose()
        server.stop()


async def test_an_attempt_that_ended_without_a_final_entry_leaves_nothing_behind(redis) -> None:
    """A job handed back or retried ends its attempt without a final entry; its unbind forgets the job,
    so the writer keeps nothing of it, and the job's next attempt here sets its stream's live expiry
    again (its stream may have aged through a retry's backoff)."""
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60, ttl_live_s=3600, writer_id="w")
    writer.bind("j", "w#1")
    assert (await writer.open("j")).raised
    writer.add_chunk("j", attempt=1, choice=0, text="a", token_ids=[1], n_tokens=1)
    writer.add("j", StreamEntry(id="", kind=EntryKind.ERROR, attempt=1))          # retried: not final
    assert await writer.write_all("j")
    writer.unbind("j")
    assert writer.tracked_jobs() == 0
    await redis.expire(stream_key("j"), 100)                                      # aged through the backoff
    writer.bind("j", "w#2")
    assert (await writer.open("j")).raised
    writer.add_chunk("j", attempt=2, choice=0, text="b", token_ids=[2], n_tokens=2)
    assert await writer.write_all("j")
    assert await redis.ttl(stream_key("j")) > 3000
    writer.unbind("j")
    assert writer.tracked_jobs() == 0


async def test_a_fence_only_rises_and_an_older_claim_cannot_take_it_back(redis) -> None:
    """The claim numbers order the claims of a job: one that comes late with an older number (its
    worker stalled between the claim and the raise) loses the job, and its writes are refused."""
    assert await fences_raised(redis, {"j": "new#20"}) == {"j": True}
    assert await fences_raised(redis, {"j": "old#9"}) == {"j": False}       # 9 < 20, as numbers
    assert await fences_raised(redis, {"j": "again#20"}) == {"j": True}     # the same claim number
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60)
    writer.bind("j", "old#9")
    writer.add_chunk("j", attempt=1, choice=0, text="late", token_ids=[1], n_tokens=1)
    assert await writer.flush()
    assert await entries(redis, "j") == []
    assert 0 < await redis.ttl("slotq:fences") <= 60


async def test_a_jobs_final_entry_takes_its_fence_away(redis) -> None:
    """The fences are one hash (one per stream bucket on a cluster), so a finished job's fence is
    removed with its final entry rather than left to expire."""
    assert await fences_raised(redis, {"done": "w#5", "running": "w#6"}) == {"done": True, "running": True}
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60)
    writer.bind("done", "w#5")
    writer.bind("running", "w#6")
    writer.add_chunk("running", attempt=1, choice=0, text="x", token_ids=[1], n_tokens=1)
    writer.add("done", StreamEntry(id="", kind=EntryKind.DONE, attempt=1, final=True))
    assert await writer.flush()
    assert await redis.hkeys("slotq:fences") == [b"running"]
    assert [e.kind for e in await entries(redis, "done")] == [EntryKind.DONE]


async def test_attempts_that_open_together_share_one_call_that_raises_their_fences_and_reads_their_streams(
        redis) -> None:
    """A claim's jobs open their streams in the same turn of the event loop: one OPEN_STREAMS for all
    of them raises each fence and reads each stream (no XRANGE, XINFO or second script of their own),
    and says which stream MAXLEN trimmed, the one thing a resume cannot go on from."""
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60, writer_id="w")
    for n in range(5):                       # job n's stream holds n chunks (written unfenced)
        for token in range(n):
            writer.add_chunk(f"j{n}", attempt=1, choice=0, text=str(token), token_ids=[token], n_tokens=token + 1)
            assert await writer.write_all(f"j{n}")
    await redis.xtrim(stream_key("j4"), maxlen=3, approximate=False)         # as SLOTQ_STREAM_MAXLEN would
    assert await fences_raised(redis, {"j3": "other#9"}) == {"j3": True}     # a newer claim took j3
    await redis.config_resetstat()
    for n in range(5):
        writer.bind(f"j{n}", "w#2")
    opened = dict(zip(["j0", "j1", "j2", "j3", "j4"], await asyncio.gather(*(writer.open(f"j{n}") for n in range(5)))))
    stats = await redis.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1                            # what the one script ran:
    assert stats["cmdstat_xrange"]["calls"] == 4                             # the 4 streams whose fence rose,
    assert stats["cmdstat_xinfo|stream"]["calls"] == 3                       # of them those with entries
    assert [opened[j].raised for j in opened] == [True, True, True, False, True]
    assert [[e.text for e in opened[j].entries] for j in ["j0", "j1", "j2"]] == [[], ["0"], ["0", "1"]]
    assert opened["j3"].entries == []                                         # lost: nothing read
    assert [e.text for e in opened["j4"].entries] == ["1", "2", "3"]
    assert [opened[j].trimmed for j in ["j0", "j1", "j2", "j4"]] == [False, False, False, True]
    assert await redis.hget("slotq:fences", "j2") == b"w#2"
    assert await redis.hget("slotq:fences", "j3") == b"other#9"
