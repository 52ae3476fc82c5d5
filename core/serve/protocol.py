"""OpenAI API shapes as pydantic models: requests (validated strictly) and responses.

Requests forbid unknown fields, as OpenAI does ("Unrecognized request argument"): a typo must not silently
change nothing. Accepted beyond OpenAI's own fields: vLLM's common sampling extensions (top_k, min_p, ...) and
DeepInfer's extras (dspark_speculation, max_draft_tokens), at top level or inside an `extra_body` object
(see `lift_extra_body`). Range checks that OpenAI documents live here; SamplingParams re-checks the rest.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOGPROBS = 20  # the engine's cap (OpenAI's chat API allows 20 top_logprobs as well)
MAX_N = 128
MAX_STOP_SEQUENCES = 16
MAX_DRAFT_TOKENS = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """Response models: extra attributes pass through (e.g. reasoning_content on a message)."""

    model_config = ConfigDict(extra="allow")


# ----- request parts -------------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # present when a client echoes streamed calls back


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # Fields OpenAI's own responses carry, so a client can send a previous reply back unchanged.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _SamplingFields(_Strict):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id (a string) -> bias
    user: str | None = None
    # vLLM's sampling extensions.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # DeepInfer: per-request speculation hints (advisory; see serve/params.py).
    dspark_speculation: bool | None = None
    max_draft_tokens: int | None = Field(default=None, ge=1, le=MAX_DRAFT_TOKENS)

    @model_validator(mode="after")
    def _check_shared(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Chat-template controls (vLLM's names).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice is set but no tools are given")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools {names}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=0)  # 0: with echo, score the prompt only (legacy OpenAI, vLLM)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (scoring the prompt without generating)")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt's text and log-probabilities, nothing generated."""
        return self.max_tokens == 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ----- responses -----------------------------------------------------------------------------------------


class UsageInfo(_Open):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(_Open):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Open):
    error: ErrorInfo


class ModelCard(_Open):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deepinfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Open):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ResponseToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseMessage(_Open):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(_Open):
    index: int
    message: ResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatChunkChoice(_Open):
    index: int
    delta: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Open):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
