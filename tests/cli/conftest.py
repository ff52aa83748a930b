"""The ``slotq`` command (slotq.jobs.cli) as a user drives it: the executable, ``--help``, the embedded
Valkey, watching children, ``slotq status``.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""
