"""``python -m slotq.jobs.cli``: the ``slotq`` command, for a child started with ``sys.executable``."""

from slotq.jobs.cli.main import main

main()
