"""Reasoning parser: splits generated text into reasoning (`<think>` ... `</think>`) and content, chunk by chunk.

Rules (DeepSeek-R1 style: one reasoning block, at the start of the output):
- Output that begins with `<think>` (after optional whitespace, which is dropped with the marker) is reasoning
  up to the first `</think>`; everything after that is content, `<think>`/`</think>` included as plain text.
- When the prompt already opened `<think>` (`starts_in_reasoning`), output is reasoning from its first character.
- Output that does not begin with `<think>` is all content.
- Output that ends inside reasoning leaves it all as reasoning.
Any split of the text into chunks gives the same reasoning and content as the whole text: a tail that could
still become a marker is held back until the next chunk (or `finish()`) decides it.
"""

from __future__ import annotations

import enum

from deepinfer.text.markers import THINK_END, THINK_START, partial_marker_length


def prompt_opens_reasoning(prompt: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """True when the prompt's last `<think>` is not closed, so generation begins inside reasoning."""
    opened = prompt.rfind(start)
    return opened != -1 and prompt.rfind(end) < opened


class _State(enum.Enum):
    START = "start"  # nothing decided yet: the output may still open with <think>
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """`feed(text)` and `finish()` return (reasoning_delta, content_delta)."""

    def __init__(self, *, starts_in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END) -> None:
        self._start, self._end = start, end
        self._state = _State.REASONING if starts_in_reasoning else _State.START
        self._buf = ""
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        if self._finished:
            return "", ""
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self._state is _State.START:
            stripped = self._buf.lstrip()
            if stripped.startswith(self._start):
                self._buf = stripped[len(self._start) :]
                self._state = _State.REASONING
            elif self._start.startswith(stripped) and not final:
                return "", ""  # only whitespace or a piece of <think> so far
            else:
                self._state = _State.CONTENT
        if self._state is _State.REASONING:
            at = self._buf.find(self._end)
            if at != -1:
                reasoning, self._buf = self._buf[:at], self._buf[at + len(self._end) :]
                self._state = _State.CONTENT
            else:
                keep = 0 if final else partial_marker_length(self._buf, (self._end,))
                cut = len(self._buf) - keep
                reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        if self._state is _State.CONTENT:
            content, self._buf = self._buf, ""
        return reasoning, content
