"""``slotq dlq``: list, show, requeue or purge dead letters."""

from __future__ import annotations

import argparse
import sys

from slotq.jobs.cli.commands.common import client_settings, connected_client, print_json
from slotq.jobs.cli.exit_codes import EXIT_FAILED, EXIT_INVALID

NO_DEAD_LETTERS = "no dead-lettered jobs"


def _no_dead_letter(job_id: str) -> int:
    """Say that ``job_id`` is not a dead letter; the exit code for it."""
    print(f"no dead letter {job_id} (`slotq dlq list` lists them)", file=sys.stderr)
    return EXIT_FAILED


async def cmd_dlq(args: argparse.Namespace) -> int:
    """Exit code 1 when a named job is not a dead letter, or one could not be requeued: a script that
    requeues or purges learns that it did not happen. Notes (no dead letters) go to stderr, so stdout
    holds only the listing or the records."""
    from slotq.jobs.protocol import dead_letters

    if (args.action == "show" and not args.job_id) or (args.action == "requeue" and not (args.job_id or args.all)):
        print(f"slotq dlq {args.action}: give a job id{' or --all' if args.action == 'requeue' else ''}",
              file=sys.stderr)
        return EXIT_INVALID
    async with connected_client(client_settings(args)) as client:
        redis = client.redis
        if args.action == "show":
            letter = await dead_letters.get(redis, args.job_id)
            if letter is None:
                return _no_dead_letter(args.job_id)
            print_json(letter.model_dump(mode="json"))
            return 0
        named = bool(args.job_id) and not args.all and args.action != "list"
        ids = [args.job_id] if named else await dead_letters.list_ids(redis)
        if not ids:
            print(NO_DEAD_LETTERS, file=sys.stderr)
            return 0
        code = 0
        if args.action == "list":
            for job_id in ids:
                letter = await dead_letters.get(redis, job_id)
                if letter:
                    deaths = f" worker_deaths={letter.worker_deaths}" if letter.worker_deaths else ""
                    print(f"{job_id}  attempts={letter.attempts} (interrupted={letter.interruptions}){deaths}  "
                          f"{letter.reason}: {letter.error.message}")
        elif args.action == "requeue":
            for job_id in ids:
                if await dead_letters.get(redis, job_id) is None:
                    code = _no_dead_letter(job_id)
                elif await client.requeue_dead_letter(job_id):
                    print(f"{job_id} requeued")
                else:
                    print(f"{job_id}: no requeueable payload (`slotq dlq show {job_id}`)", file=sys.stderr)
                    code = EXIT_FAILED
        elif args.action == "purge":
            purged = [job_id for job_id in ids if await dead_letters.remove(redis, job_id)]
            print(f"purged {len(purged)}")
            if named and not purged:
                code = _no_dead_letter(args.job_id)
    return code
