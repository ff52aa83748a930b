"""The ``slotq`` subcommands, one module per command or family of commands (``jobs``: enqueue, result
and cancel). Each command is a function of the parsed arguments that returns the exit code (None for
0); :mod:`~slotq.jobs.cli.parser` binds them to the argument tree, :mod:`~slotq.jobs.cli.main` runs
them. A command imports what it runs inside its function, so that ``slotq --help`` or one command
never loads the code of the others (the worker's llama.cpp, the gateway's FastAPI).
"""
