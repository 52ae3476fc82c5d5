"""The FastAPI application: routes, error handlers, middlewares and the engine's lifetime.

`create_app(serving, config)` holds no global state: everything lives on `app.state` (serving, config,
metrics), so several apps can run in one process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer.errors import InvalidInputError
from deepinfer.serve.config import ServeConfig
from deepinfer.serve.engine_client import ServingEngine
from deepinfer.serve.errors import APIError, BadRequestError, InternalServerError, NotFoundError, install_error_handlers
from deepinfer.serve.middleware import APIKeyMiddleware, BodyLimitMiddleware, DrainMiddleware, RequestCountMiddleware
from deepinfer.serve.openai_chat import ChatHandler
from deepinfer.serve.openai_completion import CompletionHandler
from deepinfer.serve.protocol import ModelCard, ModelList
from deepinfer.serve.text_output import TokenTexts

logger = logging.getLogger(__name__)


def _openai_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Route wrapper: a bug becomes a 500 with an OpenAI body here, inside the middlewares (so it is counted)."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            return err.response()
        except InvalidInputError as err:  # the engine's validation: the client's mistake
            return BadRequestError(str(err)).response()
        except Exception as err:  # noqa: BLE001
            logger.exception("error serving %s", request.url.path)
            return InternalServerError(f"internal server error: {type(err).__name__}: {err}").response()

    return wrapped


def create_app(serving: ServingEngine, config: ServeConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        serving.start()
        logger.info("serving %s as %s", config.model_path, ", ".join(config.served_model_names))
        try:
            yield
        finally:
            await serving.shutdown()

    app = FastAPI(title="DeepInfer", summary="OpenAI-compatible server for DeepSeek-family models", lifespan=lifespan)
    app.state.serving = serving
    app.state.config = config
    app.state.metrics = serving.metrics
    install_error_handlers(app)
    texts = TokenTexts(serving.tokenizer)
    chat = ChatHandler(serving, config, texts)
    completion = CompletionHandler(serving, config, texts)

    def model_cards() -> list[ModelCard]:
        return [ModelCard(id=name, root=config.model_path, max_model_len=serving.max_model_len)
                for name in config.served_model_names]

    @app.post("/v1/chat/completions")
    @_openai_errors
    async def chat_completions(request: Request) -> Response:
        return await chat.create(request)

    @app.post("/v1/completions")
    @_openai_errors
    async def completions(request: Request) -> Response:
        return await completion.create(request)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=model_cards()).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        for card in model_cards():
            if card.id == model_id:
                return JSONResponse(card.model_dump(mode="json"))
        return NotFoundError(f"The model `{model_id}` does not exist", param="model", code="model_not_found").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not serving.is_healthy():
            return JSONResponse({"status": "engine_failed"}, status_code=503)
        if serving.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # add_middleware puts each new one outside the previous: this reads innermost first.
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    app.add_middleware(DrainMiddleware, draining=lambda: serving.draining)
    app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestCountMiddleware, metrics=serving.metrics)
    return app
