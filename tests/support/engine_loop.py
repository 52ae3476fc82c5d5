"""Driving an LLMEngine in tests: step until nothing is left, keeping each request's final output."""

from __future__ import annotations

from collections.abc import Callable


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
