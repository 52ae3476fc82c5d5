"""DeepSeek-V3 tool-call parser: turns generated content into plain content and OpenAI tool-call deltas.

The format (markers are special tokens, but are read here as text):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

How text is read, including malformed output (the tests pin each rule):
- A call opens once its header is complete: `<｜tool▁call▁begin｜>`, a type without newlines, `<｜tool▁sep｜>`,
  a non-empty name, then a newline (or `<｜tool▁call▁end｜>`, giving empty arguments). Its id and name are sent
  then. A bare `<｜tool▁call▁begin｜>` in content starts a section like `<｜tool▁calls▁begin｜>` does.
- Arguments are the text after the name line, without surrounding whitespace, without the opening "```json"
  fence line and without the closing "```" fence; they are streamed as they come and passed on raw: never
  validated or rewritten, so bad JSON yields a tool call with the raw text as its arguments.
- A call's arguments end at `<｜tool▁call▁end｜>`, or at `<｜tool▁call▁begin｜>`/`<｜tool▁calls▁end｜>`/
  `<｜tool▁calls▁begin｜>` if the model skipped the end marker. Output that ends inside the arguments
  (unterminated) keeps the call, with the arguments received so far, closing fence removed.
- Whitespace between and after calls and the markers of a well-formed section are dropped. Anything else is
  content: a header that breaks off (a marker or newline before `<｜tool▁sep｜>`, no name, output ending before
  the name line) gives its raw text, markers included, as content; so does a `<｜tool▁calls▁begin｜>` that no
  call follows, and non-whitespace text between calls (with everything after it that opens no new call).
  Text after `<｜tool▁calls▁end｜>` is content.
The result is the same for every way of cutting the text into chunks: the parser only decides what a piece
of text is once the text that follows it settles the question, holding back the undecided tail meanwhile.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.text.markers import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
    find_first,
    partial_marker_length,
)

_ALL_MARKERS = (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP)
_SECTION_OPENERS = (TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN)
_ARGUMENT_ENDS = (TOOL_CALL_END, TOOL_CALL_BEGIN, TOOL_CALLS_END, TOOL_CALLS_BEGIN)
_FENCE = "```"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """A parsed call, as a non-streaming response lists it."""

    id: str
    name: str
    arguments: str = ""
    type: str = "function"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: its first delta carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        function: dict = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments or self.name is not None:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class ToolParseDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ToolParseDelta) -> None:
        """Append a later delta, merging argument text into the call delta it continues."""
        self.content += other.content
        for call in other.tool_calls:
            if call.id is None:
                self.add_arguments(call.index, call.arguments)
            else:
                self.tool_calls.append(call)

    def add_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if self.tool_calls and self.tool_calls[-1].index == index:
            self.tool_calls[-1].arguments += text
        else:
            self.tool_calls.append(ToolCallDelta(index=index, arguments=text))


def strip_closing_fence(text: str) -> str:
    """Argument text without trailing whitespace and the closing "```" fence."""
    text = text.rstrip()
    if text.endswith(_FENCE):
        text = text[: -len(_FENCE)].rstrip()
    return text


class _State(enum.Enum):
    CONTENT = "content"
    SECTION = "section"  # between calls
    HEADER = "header"  # after <｜tool▁call▁begin｜>, reading the type up to <｜tool▁sep｜>
    NAME = "name"  # after <｜tool▁sep｜>, reading the name up to the newline
    ARGS_START = "args_start"  # after the name line: the optional ```json fence line
    ARGS = "args"


class ToolCallParser:
    """`feed(text)` and `finish()` return a ToolParseDelta; `tool_calls` lists the calls parsed so far."""

    def __init__(self, *, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._id_factory = id_factory
        self._state = _State.CONTENT
        self._buf = ""
        self._raw = ""  # text of a section or header not yet known to be a call: content if it breaks off
        self._type = "function"
        self.tool_calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> ToolParseDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ToolParseDelta:
        if self._finished:
            return ToolParseDelta()
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> ToolParseDelta:
        out = ToolParseDelta()
        step = {
            _State.CONTENT: self._content,
            _State.SECTION: self._section,
            _State.HEADER: self._header,
            _State.NAME: self._name,
            _State.ARGS_START: self._args_start,
            _State.ARGS: self._args,
        }
        while step[self._state](out, final):
            pass
        return out

    # Each step consumes what the buffer settles and returns True to run again, or False to wait for more text.

    def _content(self, out: ToolParseDelta, final: bool) -> bool:
        hit = find_first(self._buf, _SECTION_OPENERS)
        if hit is not None:
            at, marker = hit
            out.content += self._buf[:at]
            self._raw, self._buf = marker, self._buf[at + len(marker) :]
            self._state = _State.SECTION if marker == TOOL_CALLS_BEGIN else _State.HEADER
            return True
        cut = len(self._buf) - (0 if final else partial_marker_length(self._buf, _SECTION_OPENERS))
        out.content += self._buf[:cut]
        self._buf = self._buf[cut:]
        return False

    def _section(self, out: ToolParseDelta, final: bool) -> bool:
        rest = self._buf.lstrip()
        space = self._buf[: len(self._buf) - len(rest)]
        if rest.startswith(TOOL_CALL_BEGIN):
            self._raw += space + TOOL_CALL_BEGIN
            self._buf = rest[len(TOOL_CALL_BEGIN) :]
            self._state = _State.HEADER
            return True
        if rest.startswith(TOOL_CALLS_END):
            self._raw, self._buf = "", rest[len(TOOL_CALLS_END) :]
            self._state = _State.CONTENT
            return True
        if not final and (TOOL_CALL_BEGIN.startswith(rest) or TOOL_CALLS_END.startswith(rest)):
            return False
        if final and not rest and not self._raw:
            self._buf = ""  # output ended after a call: trailing whitespace is layout, not content
            return False
        # Not a call: what was held (an unopened section marker, the whitespace) is content after all.
        out.content += self._raw + space
        self._raw, self._buf = "", rest
        self._state = _State.CONTENT
        return True

    def _broken_header(self, out: ToolParseDelta, at: int) -> bool:
        out.content += self._raw + self._buf[:at]
        self._raw, self._buf = "", self._buf[at:]
        self._state = _State.CONTENT
        return True

    def _header(self, out: ToolParseDelta, final: bool) -> bool:
        hit = find_first(self._buf, (*_ALL_MARKERS, "\n"))
        if hit is None:
            return self._broken_header(out, len(self._buf)) if final else False
        at, marker = hit
        if marker != TOOL_SEP:
            return self._broken_header(out, at)
        self._type = self._buf[:at].strip() or "function"
        self._raw += self._buf[: at + len(marker)]
        self._buf = self._buf[at + len(marker) :]
        self._state = _State.NAME
        return True

    def _name(self, out: ToolParseDelta, final: bool) -> bool:
        hit = find_first(self._buf, (*_ALL_MARKERS, "\n"))
        if hit is None:
            return self._broken_header(out, len(self._buf)) if final else False
        at, marker = hit
        name = self._buf[:at].strip()
        if not name or marker not in ("\n", TOOL_CALL_END):
            return self._broken_header(out, at)
        call = ToolCall(id=self._id_factory(), name=name, type=self._type)
        self.tool_calls.append(call)
        out.tool_calls.append(ToolCallDelta(index=len(self.tool_calls) - 1, id=call.id, name=name))
        self._raw, self._buf = "", self._buf[at + len(marker) :]
        self._state = _State.ARGS_START if marker == "\n" else _State.SECTION
        return True

    def _args_start(self, out: ToolParseDelta, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(_FENCE):
            newline = rest.find("\n")
            stop = find_first(rest, _ALL_MARKERS)
            if newline != -1 and (stop is None or newline < stop[0]):
                rest = rest[newline + 1 :]  # the "```json" line
            elif stop is None and not final:
                return False
        elif not final and _FENCE.startswith(rest):
            return False  # nothing yet, or one or two backticks
        self._buf = rest
        self._state = _State.ARGS
        return True

    def _args(self, out: ToolParseDelta, final: bool) -> bool:
        hit = find_first(self._buf, _ARGUMENT_ENDS)
        if hit is None and not final:
            head = self._buf[: len(self._buf) - partial_marker_length(self._buf, _ARGUMENT_ENDS)]
            cut = _fence_tail_start(head)
            self._add_arguments(out, self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        at = len(self._buf) if hit is None else hit[0]
        self._add_arguments(out, strip_closing_fence(self._buf[:at]))
        end = at + len(TOOL_CALL_END) if hit is not None and hit[1] == TOOL_CALL_END else at
        self._buf = self._buf[end:]
        self._state = _State.SECTION
        return True

    def _add_arguments(self, out: ToolParseDelta, text: str) -> None:
        index = len(self.tool_calls) - 1
        call = self.tool_calls[index]
        if not call.arguments:
            text = text.lstrip()  # whitespace before the arguments is layout
        call.arguments += text
        out.add_arguments(index, text)


def _fence_tail_start(text: str) -> int:
    """Start of the longest tail of `text` that may still be the closing fence: whitespace, up to three
    backticks, whitespace. Every prefix of a real closing fence has this shape, so text before the tail can
    be sent at once and the final arguments still come out the same."""
    i = len(text)
    while i and text[i - 1].isspace():
        i -= 1
    j = i
    while j and i - j < len(_FENCE) and text[j - 1] == "`":
        j -= 1
    if j == i:
        return i
    while j and text[j - 1].isspace():
        j -= 1
    return j
