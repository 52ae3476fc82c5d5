"""The model `deepinfer-serve` runs when no --model-path is given.

Hook for the embedded default model: once the package ships one under `deepinfer/models/...`, this returns
its folder (and stays the only place that knows where it lives). Until then it raises, so start-up says
plainly that --model-path is required.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer.errors import ConfigError


def default_model_path() -> Path:
    raise ConfigError(
        "no --model-path given, and this build of DeepInfer ships no embedded default model yet; "
        "pass --model-path /path/to/a/DeepSeek/checkpoint (a Hugging Face folder with config.json, "
        "*.safetensors and tokenizer.json)"
    )
