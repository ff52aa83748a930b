"""``slotq enqueue``, ``result`` and ``cancel``: one job, from its creation to its end.

``enqueue`` can wait for its job (``--stream``, ``--json``); when that wait ends early (Ctrl-C, SIGTERM,
``--timeout``, the reader of its output gone) the job it created is cancelled, unless ``--detach``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from slotq.jobs.cli.commands.common import (
    client_settings,
    connected_client,
    describe,
    print_json,
    stop_on_interrupt,
)
from slotq.jobs.cli.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_TIMED_OUT
from slotq.jobs.errors import JobTimeout

if TYPE_CHECKING:
    from slotq.jobs.producer.client import JobHandle


async def cmd_enqueue(args: argparse.Namespace) -> int:
    from slotq.jobs.protocol.schemas import JobRequest

    settings = client_settings(args)
    text: dict[str, Any]
    if args.raw:
        text = {"prompt": args.text}
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        text = {"messages": [*system, {"role": "user", "content": args.text}]}
    try:
        seed = {"seed": args.seed} if args.seed is not None else {}
        request = JobRequest.model_validate({
            **text, "max_tokens": args.max_tokens, "stop": args.stop or [], "ignore_eos": args.ignore_eos,
            "idempotency_key": args.idempotency_key, "priority": args.priority, "lane": args.lane,
            "sampling": {"temperature": args.temperature, **seed}})
    except ValidationError as exc:
        print(f"invalid request:\n{describe(exc)}", file=sys.stderr)
        return EXIT_INVALID
    waits = args.stream or args.json
    async with connected_client(settings) as client:
        interrupted = asyncio.Event()
        stop_on_interrupt(interrupted.set)     # before the enqueue: no Ctrl-C slips in between it and the wait
        job = await client.enqueue(request)
        # The id comes first, so whoever interrupts the wait can still follow or cancel the job. It is
        # stdout's only line when it is the command's whole output; with --stream stdout is the text and
        # with --json one JSON object, so there it goes to stderr.
        print(job.id, file=sys.stderr if waits else sys.stdout, flush=True)
        if waits:
            try:
                code = await _until_interrupted(_wait_for(job, args), interrupted)
            except BrokenPipeError:     # stdout's reader left (`| head`): the job should not outlive it either
                await _let_go(job, detach=args.detach, why="the reader of the output went away")
                raise
            except JobTimeout:          # the caller's wait is over, as with Ctrl-C: its job goes with it
                await _let_go(job, detach=args.detach, why=f"no result within --timeout {args.timeout:g} s")
                return EXIT_TIMED_OUT
            if code is not None:
                return code
        elif not interrupted.is_set():
            return 0
        await _let_go(job, detach=args.detach, why="interrupted")
        return EXIT_INTERRUPTED


async def _wait_for(job: JobHandle, args: argparse.Namespace) -> int:
    """``enqueue --stream`` prints the text as it comes, ``--json`` the result; the exit code is 1 when
    the job did not succeed (known with --json only, as --stream prints nothing but the text)."""
    if args.stream:
        try:
            async for chunk in job.text():
                print(chunk, end="", flush=True)
        finally:
            print()     # end the text's line, also when interrupted, before anything goes to stderr
    if args.json:
        result = await job.result(timeout=args.timeout)
        print_json(result.model_dump(mode="json"))
        return 0 if result.status.value == "succeeded" else EXIT_FAILED
    return 0


async def _until_interrupted(work: Awaitable[int], interrupted: asyncio.Event) -> int | None:
    """``work``'s exit code, or None when ``interrupted`` is set first (``work`` is then cancelled)."""
    working = asyncio.ensure_future(work)
    waiting = asyncio.create_task(interrupted.wait())
    try:
        await asyncio.wait({working, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if working.done():
        return working.result()
    working.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await working
    return None


async def _let_go(job: JobHandle, *, detach: bool, why: str) -> None:
    """What becomes of the job when its command stops waiting early: the command's caller is gone, so
    the job it created is cancelled, unless --detach asked to keep it. A job the command only
    attached to (its --idempotency-key matched an existing job) belongs to whoever created it, and
    keeps running. Either way stderr says what happened and how to reach the job."""
    if detach or not job.created:
        because = "--detach" if detach else "--idempotency-key matched a job this command did not create"
        print(f"{why}; job {job.id} keeps running ({because}): `slotq result {job.id}` waits for it, "
              f"`slotq cancel {job.id}` cancels it", file=sys.stderr)
    elif await job.cancel():
        print(f"{why}; job {job.id} cancelled", file=sys.stderr)
    else:
        print(f"{why}; job {job.id} had already finished: `slotq result {job.id}` shows it", file=sys.stderr)


async def cmd_result(args: argparse.Namespace) -> int:
    async with connected_client(client_settings(args)) as client:
        result = await client.result(args.job_id, timeout=args.timeout)
        print_json(result.model_dump(mode="json"))
        return 0


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with connected_client(client_settings(args)) as client:
        done = await client.cancel(args.job_id)
        print("cancelled" if done else "not cancelled: the job already finished or does not exist")
        return 0 if done else EXIT_FAILED
