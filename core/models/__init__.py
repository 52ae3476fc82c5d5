"""Models shipped inside the package: the embedded tiny DeepSeek-V3 (trained by `deepinfer train-tiny`)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

EMBEDDED_MODEL_NAME = "deepseek_v3_tiny"


def embedded_model_path() -> Path:
    """The folder of the embedded model (HF layout: config.json, model.safetensors, tokenizer files, README.md)."""
    return Path(str(files(__name__) / EMBEDDED_MODEL_NAME))


EMBEDDED_MODEL_PATH = embedded_model_path()
