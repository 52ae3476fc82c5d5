"""Driving an LLMEngine in tests: one on the reference backend, and stepping it until nothing is left, keeping
each request's final output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine


def reference_engine(path: Path | str, speculator=None, **options) -> LLMEngine:
    """An LLMEngine on the reference backend in float32, without progress bars, unless `options` say otherwise."""
    options.setdefault("dtype", "float32")
    options.setdefault("progress", False)
    return LLMEngine.from_config(EngineConfig(model=str(path), backend="reference", **options), speculator)


def run_to_completion(engine, after_step: Callable[[], None] | None = None) -> dict[str, object]:
    """Final RequestOutput by request id; `after_step` runs after every step (to observe the engine)."""
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if after_step is not None:
            after_step()
    return final
