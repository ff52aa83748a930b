"""The ``slotq`` command's exit codes, beyond 0 for success. Each is what a shell user already
knows from other tools, so scripts can tell the cases apart without parsing messages."""

EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_TIMED_OUT = 124       # what coreutils' `timeout` reports for a command that ran out of time
EXIT_INTERRUPTED = 130     # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141     # 128 + SIGPIPE, what a shell reports for `yes | head -1`'s yes
