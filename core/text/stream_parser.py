"""Chat output parser: generated text deltas in, OpenAI chat deltas (content, reasoning_content, tool_calls) out.

Reasoning is split off first; tool calls are looked for in the content only (a call the model drafts while
reasoning is reasoning). Feed it the detokenizer's deltas, with the markers kept (see markers.STREAM_MARKERS),
and call `finish()` once generation ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.text.reasoning_parser import ReasoningParser
from deepinfer.text.tool_parser import ToolCall, ToolCallDelta, ToolCallParser, new_tool_call_id


@dataclass
class ChatDelta:
    """What one step adds to the assistant message."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)

    def to_openai(self) -> dict:
        """The `delta` object of a chat.completion.chunk (only the fields this step has)."""
        out: dict = {}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [d.to_openai() for d in self.tool_calls]
        return out


@dataclass
class ParsedChatOutput:
    """The whole assistant message, for non-streaming responses."""

    content: str
    reasoning_content: str
    tool_calls: list[ToolCall]


class ChatStreamParser:
    """Per-request parser. `reasoning` turns on `<think>` splitting (`starts_in_reasoning` when the prompt
    opened `<think>`, see reasoning_parser.prompt_opens_reasoning); `tools` turns on DeepSeek tool-call parsing.
    With both off, text passes through as content."""

    def __init__(
        self,
        *,
        reasoning: bool = False,
        starts_in_reasoning: bool = False,
        tools: bool = False,
        tool_call_id_factory: Callable[[], str] = new_tool_call_id,
    ) -> None:
        self._reasoning = ReasoningParser(starts_in_reasoning=starts_in_reasoning) if reasoning else None
        self._tools = ToolCallParser(id_factory=tool_call_id_factory) if tools else None
        self._content: list[str] = []
        self._reasoning_text: list[str] = []

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._content_step(reasoning, content, final=False)

    def finish(self) -> ChatDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._content_step(reasoning, content, final=True)

    def _content_step(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        delta = ChatDelta(reasoning_content=reasoning)
        if self._tools is not None:
            parsed = self._tools.feed(content)
            if final:
                parsed.extend(self._tools.finish())
            delta.content, delta.tool_calls = parsed.content, parsed.tool_calls
        else:
            delta.content = content
        self._content.append(delta.content)
        self._reasoning_text.append(delta.reasoning_content)
        return delta

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning_content(self) -> str:
        return "".join(self._reasoning_text)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._tools.tool_calls) if self._tools else []

    def result(self) -> ParsedChatOutput:
        return ParsedChatOutput(self.content, self.reasoning_content, self.tool_calls)

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI finish_reason: "tool_calls" when the model stopped after calling tools, else `engine_reason`
        ("stop", "length", ...)."""
        return "tool_calls" if engine_reason == "stop" and self.tool_calls else engine_reason


def parse_chat_output(
    text: str,
    *,
    reasoning: bool = False,
    starts_in_reasoning: bool = False,
    tools: bool = False,
    tool_call_id_factory: Callable[[], str] = new_tool_call_id,
) -> ParsedChatOutput:
    """Parse a whole generated text at once (non-streaming responses)."""
    parser = ChatStreamParser(
        reasoning=reasoning,
        starts_in_reasoning=starts_in_reasoning,
        tools=tools,
        tool_call_id_factory=tool_call_id_factory,
    )
    parser.feed(text)
    parser.finish()
    return parser.result()
