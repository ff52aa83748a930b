"""The Redis protocol (slotq.jobs.protocol) on a real Valkey, without a model: claims, leases, lanes, the
victim rule, Sentinel and TLS connections.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""
