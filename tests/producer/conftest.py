"""The producer (slotq.jobs.producer): following streams through the shared reader, also behind a
latency proxy.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""
