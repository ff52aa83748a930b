"""The HTTP gateway (slotq.jobs.gateway): its pure parts, and real Valkey + ``slotq worker`` + ``slotq
gateway`` processes driven with the official OpenAI SDK, httpx and a real Chromium.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""
