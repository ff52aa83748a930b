"""The engine (slotq.engine) on real llama.cpp with the tiny model, and its pure policies (scheduler, text,
KV ledger): no Redis.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_model import write_draft_model


@pytest.fixture(scope="session")
def draft_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight draft model with the bundled model's vocabulary (SLOTQ_DRAFT_MODEL's tests)."""
    return write_draft_model(tmp_path_factory.mktemp("draft") / "draft.gguf")
