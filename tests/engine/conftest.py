"""The engine (slotq.engine) on real llama.cpp with the tiny model, and its pure policies (scheduler, text,
KV ledger): no Redis.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""
