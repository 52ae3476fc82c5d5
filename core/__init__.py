"""DeepInfer: an inference engine for DeepSeek-family models.

Heavy pieces (the engine, the model) load lazily so that `deepinfer backends` and backend listing stay cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    DeepInferError,
    InvalidInputError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__", "LLM", "SamplingParams", "list_backends", "load_backend", "Backend",
    "DeepInferError", "InvalidInputError", "BackendNotFoundError", "BackendUnavailableError",
    "ConfigError", "CheckpointError",
]

_LAZY = {
    "LLM": ("deepinfer.llm", "LLM"),
    "SamplingParams": ("deepinfer.engine.sampling_params", "SamplingParams"),
    "list_backends": ("deepinfer.registry", "list_backends"),
    "load_backend": ("deepinfer.registry", "load_backend"),
    "Backend": ("deepinfer.backend", "Backend"),
}

if TYPE_CHECKING:
    from deepinfer.backend import Backend
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.llm import LLM
    from deepinfer.registry import list_backends, load_backend


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
