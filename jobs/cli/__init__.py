"""The ``slotq`` command (:mod:`~slotq.jobs.cli.main`: the argument tree in ``parser``, one module
per command in ``commands``) and what only it runs: the zero-config demo, ``slotq status`` views and
watching child processes. ``python -m slotq.jobs.cli`` is the same as ``slotq``.
"""
