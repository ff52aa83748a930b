from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # tests/helpers.py, tests/tiny_model.py

from tiny_model import write_tiny_llama  # noqa: E402

from engine import bundled_model_path  # noqa: E402

# Weight scale of the tiny random model. Larger weights give more decisive logits, so greedy argmax
# does not flip when llama.cpp's accumulation order changes with the batch shape.
TINY_SCALE = 1.0
TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=TINY_SEED, scale=TINY_SCALE)


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    return bundled_model_path()
