"""No lane starves (issue 32): a real in-process worker on the tiny model and a real Valkey, with
``SLOTQ_LANE_MIN_SHARE=0.25`` on 4 slots, so the bulk lane keeps one slot while it has work. The
claim rule itself is tested on Valkey alone (tests/protocol/test_queue_claims.py), the victim rule
as a pure function (tests/protocol/test_preemption_policy.py)."""

from __future__ import annotations

import asyncio

from slotq.jobs.producer.client import JobHandle, SlotqClient
from slotq.jobs.protocol.schemas import JobStatus
from tests.support.jobs import chunks, job_request, raw_entries

SLOTS = 4
SHARE = 0.25                 # one slot of four
BULK_TOKENS = 1500           # a few seconds of decoding on the tiny model: the preemptions come first
CHAT_TOKENS = 6000           # longer: the interactive jobs hold their slots while the guaranteed bulk job ends


async def first_token_ms(client: SlotqClient, job: JobHandle) -> int:
    """When the job's first chunk reached its stream: the ms part of the entry's id (Redis' clock)."""
    first = chunks(await raw_entries(client, job.id))[0]
    return int(first.id.split("-")[0])


async def test_bulk_starts_in_its_guaranteed_slot_while_interactive_jobs_wait(client, start_worker):
    """40 interactive jobs and one bulk job wait when the worker starts. With strict lanes the bulk
    job would start only once every interactive job had been claimed; with its guaranteed slot it
    starts in the worker's first claim, ahead of most of them."""
    bulk = await client.enqueue(job_request("a bulk request", max_tokens=32, lane="bulk"))
    chats = [await client.enqueue(job_request(f"interactive request {i}", max_tokens=16)) for i in range(40)]
    await start_worker(slots=SLOTS, lane_min_share=SHARE)
    for job in (bulk, *chats):
        assert (await job.result(timeout=120)).status == JobStatus.SUCCEEDED, job.id
    bulk_started = await first_token_ms(client, bulk)
    after_bulk = [chat for chat in chats if await first_token_ms(client, chat) > bulk_started]
    assert len(after_bulk) >= 30, f"only {len(after_bulk)} of 40 interactive jobs started after the bulk job"


async def test_a_job_in_the_guaranteed_slot_is_not_preempted(client, start_worker):
    """Four long bulk jobs fill the worker (no cache slot: every interactive job must take a slot),
    then four long interactive jobs arrive: three bulk jobs yield, and the fourth, in the bulk
    lane's guaranteed slot, runs on while the fourth interactive job waits."""
    await start_worker(slots=SLOTS, lane_min_share=SHARE, ctx=CHAT_TOKENS + 64, cache_slots=0, poll_delay_s=0.1)
    bulk = [await client.enqueue(job_request(f"bulk request {i}", max_tokens=BULK_TOKENS, lane="bulk"))
            for i in range(SLOTS)]
    async with asyncio.timeout(60):
        while (await lanes(client))["bulk"] != (0, SLOTS, 0):
            await asyncio.sleep(0.02)
    chats = [await client.enqueue(job_request(f"interactive request {i}", max_tokens=CHAT_TOKENS))
             for i in range(SLOTS)]
    try:
        async with asyncio.timeout(60):
            while (await lanes(client))["interactive"] != (1, SLOTS - 1, 0):
                assert (await lanes(client))["bulk"][2] <= SLOTS - 1, "the guaranteed slot was preempted"
                await asyncio.sleep(0.02)
        assert (await lanes(client))["bulk"] == (SLOTS - 1, 1, SLOTS - 1)
        [guaranteed] = [job for job in bulk if (await client.queue.place(job.id))[1]]
        async with asyncio.timeout(120):          # it runs to its end while an interactive job waits
            while (await client.queue.place(guaranteed.id))[0] is not None:
                assert (await lanes(client))["bulk"][2] == SLOTS - 1, "the guaranteed slot was preempted"
                await asyncio.sleep(0.05)
        result = await guaranteed.result(timeout=10)
        assert result.status == JobStatus.SUCCEEDED and result.usage.completion_tokens == BULK_TOKENS
        assert (await lanes(client))["interactive"][0] == 1             # the fourth still waits
    finally:
        for job in (*bulk, *chats):
            await job.cancel()


async def test_the_slot_a_guaranteed_job_leaves_goes_back_to_its_lane_not_to_the_reserve(client, start_worker):
    """One bulk job in the guaranteed slot and three long interactive jobs fill the worker; a
    fourth interactive job does not run in the reserve beside them (the bulk job is no victim), so
    when the bulk job ends its slot goes straight to the next bulk job, while that interactive job
    still waits for an interactive slot."""
    await start_worker(slots=SLOTS, lane_min_share=SHARE, ctx=CHAT_TOKENS + 64, poll_delay_s=0.1)
    first = await client.enqueue(job_request("bulk request 0", max_tokens=BULK_TOKENS, lane="bulk"))
    async with asyncio.timeout(60):
        while (await lanes(client))["bulk"] != (0, 1, 0):
            await asyncio.sleep(0.02)
    chats = [await client.enqueue(job_request(f"interactive request {i}", max_tokens=CHAT_TOKENS))
             for i in range(SLOTS - 1)]
    async with asyncio.timeout(60):
        while (await lanes(client))["interactive"] != (0, SLOTS - 1, 0):
            await asyncio.sleep(0.02)
    chats.append(await client.enqueue(job_request("one interactive request too many", max_tokens=CHAT_TOKENS)))
    second = await client.enqueue(job_request("bulk request 1", max_tokens=BULK_TOKENS, lane="bulk"))
    try:
        async with asyncio.timeout(120):
            while (await client.queue.place(second.id)) != ("bulk", True):
                assert (await lanes(client))["interactive"][1] == SLOTS - 1, "an interactive job ran in the reserve"
                await asyncio.sleep(0.02)
        assert (await first.result(timeout=10)).status == JobStatus.SUCCEEDED
        assert (await lanes(client))["interactive"][:2] == (1, SLOTS - 1)      # the fourth still waits
    finally:
        for job in (first, second, *chats):
            await job.cancel()


async def lanes(client: SlotqClient) -> dict[str, tuple[int, int, int]]:
    """(waiting, running, preempted) of each lane."""
    return {c.lane: (c.waiting, c.running, c.preempted) for c in await client.queue.counts()}
