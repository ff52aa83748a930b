"""The worker (slotq.jobs.worker): stream writer, shutdown bound, metrics, elastic slots, the claim path
across a fleet of real workers.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""

from tests.support.faults import fault_backend, fclient, fsync_redis  # noqa: F401  (the kill tests' Valkey and client)
