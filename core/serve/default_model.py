"""The model `deepinfer-serve` runs when no --model-path is given: the embedded tiny DeepSeek-V3."""

from __future__ import annotations

from pathlib import Path

from deepinfer.errors import ConfigError


def default_model_path() -> Path:
    from deepinfer.models import embedded_model_path

    path = embedded_model_path()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"the embedded default model is missing from this installation ({path}); "
            "pass --model-path /path/to/a/DeepSeek/checkpoint (a Hugging Face folder with config.json, "
            "*.safetensors and tokenizer.json)"
        )
    return path
