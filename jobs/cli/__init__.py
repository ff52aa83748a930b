"""The ``slotq`` command (:mod:`~slotq.jobs.cli.main`) and what only it runs: the zero-config demo,
``slotq status`` views, watching child processes, and the embedded Redis-protocol server (Valkey)
used when ``SLOTQ_REDIS_URL`` is unset. ``python -m slotq.jobs.cli`` is the same as ``slotq``.
"""
