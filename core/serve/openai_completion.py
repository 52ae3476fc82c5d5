"""POST /v1/completions: one engine request per prompt (a string, token ids, or a batch of either).

Choice index = prompt index * n + completion index, as OpenAI numbers them. `echo` prepends the prompt's text
(and, with logprobs, the prompt tokens' log-probabilities: the first has none). `echo` with max_tokens 0 scores
the prompt alone (lm-eval-style log-likelihoods): the engine prefills it and samples one token, which the
response leaves out, so the prompt costs one forward pass and no decode step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer.engine.async_engine import EngineError
from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.errors import InvalidInputError
from deepinfer.serve.config import ServeConfig
from deepinfer.serve.engine_client import RequestStream, ServingEngine
from deepinfer.serve.errors import BadRequestError, InternalServerError, error_body
from deepinfer.serve.openai_chat import resolve_model
from deepinfer.serve.params import check_length, check_unsupported, sampling_params, speculation_header
from deepinfer.serve.parsing import parse_request
from deepinfer.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from deepinfer.serve.sse import CLIENT_CLOSED_REQUEST, DONE, ClientDisconnected, EventStreamResponse, run_until_disconnect, sse
from deepinfer.serve.text_output import TokenTexts, completion_logprobs


class _Choice:
    def __init__(self, index: int, echo: str, prompt_ids: list[int]):
        self.index = index
        self.echo = echo
        self.prompt_ids = prompt_ids
        self.started = False
        self.done = False
        self.logprobs_sent = 0
        self.prompt_logprobs_sent = 0
        self.text_offset = 0


class CompletionHandler:
    def __init__(self, serving: ServingEngine, config: ServeConfig, texts: TokenTexts):
        self.serving, self.config, self.texts = serving, config, texts

    async def create(self, request: Request) -> Response:
        req = await parse_request(request, CompletionRequest)
        model = resolve_model(req.model, self.config)
        check_unsupported(req)
        prompts = [self._ids(p, req) for p in req.prompts]
        for ids in prompts:
            check_length(len(ids), req.max_tokens, self.serving.max_model_len, param="prompt")
        params = sampling_params(req, max_tokens=1 if req.prompt_only else req.max_tokens, logprobs=req.logprobs,
                                 skip_special_tokens=req.skip_special_tokens,
                                 prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
        echoes = [self._echo_text(p, ids, req) for p, ids in zip(req.prompts, prompts)]
        choices = {(i, k): _Choice(i * req.n + k, echoes[i], prompts[i]) for i in range(len(prompts)) for k in range(req.n)}
        headers = speculation_header(req, self.config.speculative_engine)
        self.serving.check_admission(len(prompts))  # all of the batch, or none of it
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # From here on the requests hold engine state: every path below closes `streams`.
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.serving.submit(f"{request_id}-{i}", ids, params))
        except BaseException:
            for s in streams:
                await s.close()
            raise

        async def close_all() -> None:
            for s in streams:
                await s.close()

        if req.stream:
            events = self._events(streams, choices, req, model, request_id, prompts)
            return EventStreamResponse(events, on_close=close_all, headers=headers)
        try:
            response = await run_until_disconnect(request, self._collect(streams, choices, req, model, request_id, prompts))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            await close_all()
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    # ----- prompts -------------------------------------------------------------------------------------

    def _ids(self, prompt: str | list[int], req: CompletionRequest) -> list[int]:
        tokenizer = self.serving.tokenizer
        try:
            ids = (tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens) if isinstance(prompt, str)
                   else tokenizer.check_ids(prompt))
        except InvalidInputError as err:
            raise BadRequestError(str(err), param="prompt") from None
        if not ids:
            raise BadRequestError("the prompt is empty", param="prompt")
        return ids

    def _echo_text(self, prompt: str | list[int], ids: list[int], req: CompletionRequest) -> str:
        if not req.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        return self.serving.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)

    # ----- responses -----------------------------------------------------------------------------------

    def _logprobs(self, choice: _Choice, c: CompletionOutput, out: RequestOutput, req: CompletionRequest) -> dict[str, Any] | None:
        if req.logprobs is None or c.logprobs is None:
            return None
        ids, positions = [], []
        if req.echo and out.prompt_logprobs is not None:  # as far as prefilled: a stream gets them chunk by chunk
            done, choice.prompt_logprobs_sent = choice.prompt_logprobs_sent, len(out.prompt_logprobs)
            ids, positions = choice.prompt_ids[done : len(out.prompt_logprobs)], list(out.prompt_logprobs[done:])
        generated = _generated(c, req)
        start, choice.logprobs_sent = choice.logprobs_sent, len(generated)
        ids, positions = ids + list(generated[start:]), positions + list(c.logprobs[start : len(generated)])
        result = completion_logprobs(self.texts, ids, positions, req.logprobs, choice.text_offset)
        if result["text_offset"]:
            choice.text_offset = result["text_offset"][-1] + len(result["tokens"][-1])
        return result

    async def _collect(self, streams: list[RequestStream], choices: dict, req: CompletionRequest, model: str,
                       request_id: str, prompts: list[list[int]]) -> CompletionResponse:
        async def last(stream: RequestStream) -> RequestOutput | None:
            final = None
            async for out in stream:
                final = out
            return final

        try:
            finals = await asyncio.gather(*(last(s) for s in streams))
        except EngineError as err:
            raise InternalServerError(str(err)) from None
        result, completion = [], 0
        for i, final in enumerate(finals):
            if final is None:
                raise InternalServerError("the engine ended a request without output")
            for c in final.outputs:
                choice = choices[(i, c.index)]
                finish, stop = _finish(c, req)
                result.append(CompletionChoice(index=choice.index, text=choice.echo + ("" if req.prompt_only else c.text),
                                               logprobs=self._logprobs(choice, c, final, req),
                                               finish_reason=finish, stop_reason=stop))
                completion += len(_generated(c, req))
        result.sort(key=lambda ch: ch.index)
        prompt_tokens = sum(len(p) for p in prompts)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
        return CompletionResponse(id=request_id, created=int(time.time()), model=model, choices=result, usage=usage)

    async def _events(self, streams: list[RequestStream], choices: dict, req: CompletionRequest, model: str,
                      request_id: str, prompts: list[list[int]]) -> AsyncIterator[str]:
        created = int(time.time())
        completion = 0
        try:
            async for i, out in _merge(streams):
                parts = []
                for c in out.outputs:
                    choice = choices[(i, c.index)]
                    if choice.done:
                        continue
                    text = "" if req.prompt_only else c.delta_text
                    if not choice.started:
                        choice.started, text = True, choice.echo + text
                    logprobs = self._logprobs(choice, c, out, req)
                    choice.done = c.finish_reason is not None
                    if text or (logprobs and logprobs["tokens"]) or choice.done:
                        finish, stop = _finish(c, req)
                        parts.append(CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                                      finish_reason=finish, stop_reason=stop if choice.done else None))
                    if choice.done:
                        completion += len(_generated(c, req))
                if parts:
                    yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=parts))
        except EngineError as err:
            yield sse(error_body(str(err), "server_error", None, "internal_error"))
            yield DONE
            return
        if req.include_usage:
            prompt_tokens = sum(len(p) for p in prompts)
            usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
            yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
        yield DONE


def _generated(c: CompletionOutput, req: CompletionRequest) -> list[int]:
    """The completion's tokens the response shows: none when only the prompt is scored."""
    return [] if req.prompt_only else c.token_ids


def _finish(c: CompletionOutput, req: CompletionRequest) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason): a scored prompt ends by length whatever the hidden token was."""
    if req.prompt_only and c.finish_reason is not None:
        return "length", None
    return c.finish_reason, c.stop_reason


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, exc))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
