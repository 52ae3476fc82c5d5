"""OpenAI-compatible HTTP server: `deepinfer-serve` (or `deepinfer serve`).

Layout: protocol.py (request/response models), parsing.py (body -> model, extra_body), params.py (request ->
SamplingParams), openai_chat.py / openai_completion.py (handlers), text_output.py (logprobs, special-token
filter), engine_client.py (admission, metrics per request, drain), sse.py (event streams, disconnects),
middleware.py (auth, body limit, drain, status counts), metrics.py, errors.py, app.py (FastAPI factory),
cli.py (flags, start-up checks, uvicorn with SIGTERM drain), bench.py (load generator).
Importing this package is cheap: the web stack and the engine load only when a server is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.serve.config import ServeConfig


def __getattr__(name: str):
    if name == "create_app":
        from deepinfer.serve.app import create_app

        return create_app
    if name == "ServeConfig":
        from deepinfer.serve.config import ServeConfig

        return ServeConfig
    raise AttributeError(f"module 'deepinfer.serve' has no attribute {name!r}")


__all__ = ["ServeConfig", "create_app"]
