"""``slotq bulk`` (slotq.jobs.bulk): reading and writing lines (pure), and whole runs on real workers.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""
