"""POST /v1/chat/completions: messages -> chat template -> engine -> content, reasoning_content, tool_calls.

Each completion (choice) gets its own special-token filter and ChatStreamParser; the engine runs with
skip_special_tokens=False so `<think>` and the tool-call markers reach the parser (see text_output.py).
tool_choice: "auto" (default with tools) lets the model decide; "none" leaves the tools out of the prompt;
"required" and a named function are honoured by prefilling the tool-call section (and the function's
header) after the prompt: the model must continue inside a call. Its arguments are not schema-constrained
(that needs structured output, not built yet).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer.engine.async_engine import EngineError
from deepinfer.engine.outputs import CompletionOutput
from deepinfer.errors import InvalidInputError
from deepinfer.serve.config import ServeConfig
from deepinfer.serve.engine_client import RequestStream, ServingEngine
from deepinfer.serve.errors import BadRequestError, InternalServerError, ModelNotFoundError, error_body
from deepinfer.serve.params import check_length, check_unsupported, sampling_params, speculation_header
from deepinfer.serve.parsing import parse_request
from deepinfer.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    NamedToolChoice,
    ResponseMessage,
    ResponseToolCall,
    UsageInfo,
)
from deepinfer.serve.sse import CLIENT_CLOSED_REQUEST, DONE, ClientDisconnected, EventStreamResponse, run_until_disconnect, sse
from deepinfer.serve.text_output import TokenTexts, chat_logprobs, chat_text_filter
from deepinfer.text import ChatDelta, ChatStreamParser, prompt_opens_reasoning
from deepinfer.text.markers import TOOL_CALL_BEGIN, TOOL_CALLS_BEGIN, TOOL_SEP
from deepinfer.text.tool_parser import ToolCallDelta

# apply_chat_template's own parameters: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                       "continue_final_message", "chat_template", "tokenize"})


def resolve_model(requested: str | None, config: ServeConfig) -> str:
    """The name to answer with; 400 model_not_found for a model this server does not serve."""
    if requested is None:
        return config.served_model_names[0]
    if requested in config.served_model_names or requested == config.model_path:
        return requested
    raise ModelNotFoundError(f"The model `{requested}` does not exist on this server; it serves "
                             f"{', '.join(config.served_model_names)}", param="model")


def merge_delta(into: ChatDelta, more: ChatDelta) -> ChatDelta:
    into.content += more.content
    into.reasoning_content += more.reasoning_content
    for call in more.tool_calls:
        if call.id is None and into.tool_calls and into.tool_calls[-1].index == call.index:
            into.tool_calls[-1].arguments += call.arguments
        else:
            into.tool_calls.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))
    return into


@dataclass(frozen=True)
class _Prompt:
    text: str  # the rendered chat template
    ids: list[int]  # its tokens, followed by those of `forced`
    forced: str  # text prefilled after the template (tool_choice "required" / named)
    tools: bool  # parse tool calls
    starts_in_reasoning: bool  # the template opened <think>


class _Choice:
    """One completion's text pipeline: special-token filter -> reasoning / tool-call parser."""

    def __init__(self, index: int, handler: ChatHandler, req: ChatCompletionRequest, prompt: _Prompt):
        self.index = index
        self.filter = chat_text_filter(handler.serving.tokenizer, req.skip_special_tokens, prompt.tools)
        self.parser = ChatStreamParser(reasoning=True, starts_in_reasoning=prompt.starts_in_reasoning, tools=prompt.tools)
        self.single_call = req.parallel_tool_calls is False
        self.pending = self.parser.feed(prompt.forced) if prompt.forced else ChatDelta()
        self.done = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs_sent = 0

    def step(self, c: CompletionOutput) -> ChatDelta:
        delta, self.pending = self.pending, ChatDelta()
        merge_delta(delta, self.parser.feed(self.filter.feed(c.delta_text)))
        if c.finish_reason is not None:
            merge_delta(delta, self.parser.feed(self.filter.finish()))
            merge_delta(delta, self.parser.finish())
            self.done = True
            self.finish_reason = self.parser.finish_reason(c.finish_reason)
            self.stop_reason = c.stop_reason
        if self.single_call:
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0]
        return delta

    def message(self) -> ResponseMessage:
        calls = self.parser.tool_calls[:1] if self.single_call else self.parser.tool_calls
        content = self.parser.content
        return ResponseMessage(
            content=None if not content and calls else content,
            reasoning_content=self.parser.reasoning_content or None,
            tool_calls=[ResponseToolCall(id=c.id, function={"name": c.name, "arguments": c.arguments}) for c in calls],
        )


class ChatHandler:
    def __init__(self, serving: ServingEngine, config: ServeConfig, texts: TokenTexts):
        self.serving, self.config, self.texts = serving, config, texts

    async def create(self, request: Request) -> Response:
        req = await parse_request(request, ChatCompletionRequest)
        model = resolve_model(req.model, self.config)
        check_unsupported(req)
        prompt = self._prompt(req)
        check_length(len(prompt.ids), req.max_new_tokens, self.serving.max_model_len, param="messages",
                     tokens_param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens=req.max_new_tokens, logprobs=top_n, skip_special_tokens=False)
        choices = [_Choice(i, self, req, prompt) for i in range(req.n)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # From here on the request holds engine state: every path below closes `stream`.
        stream = await self.serving.submit(request_id, prompt.ids, params)
        headers = speculation_header(req, self.config.speculative_engine)
        if req.stream:
            events = self._events(stream, choices, req, model, request_id, len(prompt.ids), top_n)
            return EventStreamResponse(events, on_close=stream.close, headers=headers)
        try:
            response = await run_until_disconnect(
                request, self._collect(stream, choices, model, request_id, len(prompt.ids), top_n))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            await stream.close()
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    # ----- prompt --------------------------------------------------------------------------------------

    def _prompt(self, req: ChatCompletionRequest) -> _Prompt:
        tokenizer = self.serving.tokenizer
        messages = []
        for m in req.messages:
            msg = m.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})
            if msg["role"] == "developer":
                msg["role"] = "system"  # OpenAI's newer name for the system role
            messages.append(msg)
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools and req.tools else None
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_KWARGS & set(kwargs)
        if reserved:
            raise BadRequestError(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final_message, **kwargs)
        except InvalidInputError as err:  # ChatTemplateError included: the template refused these messages
            raise BadRequestError(f"cannot apply the chat template: {err}", param="messages") from None
        forced = ""
        if use_tools and req.tool_choice == "required":
            forced = TOOL_CALLS_BEGIN
        elif use_tools and isinstance(req.tool_choice, NamedToolChoice):
            forced = f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}function{TOOL_SEP}{req.tool_choice.function.name}\n```json\n"
        starts_in_reasoning = not forced and prompt_opens_reasoning(text)
        ids = tokenizer.encode(text + forced, add_special_tokens=False)  # the template wrote bos itself
        return _Prompt(text, ids, forced, use_tools, starts_in_reasoning)

    # ----- responses -----------------------------------------------------------------------------------

    def _logprobs(self, choice: _Choice, c: CompletionOutput, top_n: int | None) -> dict[str, Any] | None:
        if top_n is None or c.logprobs is None:
            return None
        start, choice.logprobs_sent = choice.logprobs_sent, len(c.token_ids)
        return chat_logprobs(self.texts, c.token_ids[start:], c.logprobs[start:], top_n)

    async def _collect(self, stream: RequestStream, choices: list[_Choice], model: str, request_id: str,
                       prompt_len: int, top_n: int | None) -> ChatCompletionResponse:
        final = None
        try:
            async for out in stream:
                final = out
                for c in out.outputs:
                    if not choices[c.index].done:
                        choices[c.index].step(c)
        except EngineError as err:
            raise InternalServerError(str(err)) from None
        if final is None:
            raise InternalServerError("the engine ended the request without output")
        result = []
        for c in final.outputs:
            choice = choices[c.index]
            result.append(ChatChoice(index=c.index, message=choice.message(), logprobs=self._logprobs(choice, c, top_n),
                                     finish_reason=choice.finish_reason, stop_reason=choice.stop_reason))
        completion = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion)
        return ChatCompletionResponse(id=request_id, created=int(time.time()), model=model, choices=result, usage=usage)

    async def _events(self, stream: RequestStream, choices: list[_Choice], req: ChatCompletionRequest, model: str,
                      request_id: str, prompt_len: int, top_n: int | None) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(parts: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=parts, usage=usage))

        yield chunk([ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""}) for c in choices])
        completion_tokens = 0
        try:
            async for out in stream:
                parts = []
                for c in out.outputs:
                    choice = choices[c.index]
                    if choice.done:
                        continue
                    delta = choice.step(c)
                    logprobs = self._logprobs(choice, c, top_n)
                    if not delta.is_empty() or logprobs or choice.done:
                        parts.append(ChatChunkChoice(index=c.index, delta=delta.to_openai(), logprobs=logprobs,
                                                     finish_reason=choice.finish_reason))
                    if choice.done:
                        completion_tokens += len(c.token_ids)
                if parts:
                    yield chunk(parts)
        except EngineError as err:
            yield sse(error_body(str(err), "server_error", None, "internal_error"))
            yield DONE
            return
        if req.include_usage:
            usage = UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                              total_tokens=prompt_len + completion_tokens)
            yield chunk([], usage)
        yield DONE
