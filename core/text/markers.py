"""DeepSeek's marker strings and the two text searches both stream parsers are built on.

Markers are looked for in decoded text, never as token ids: a checkpoint may or may not mark them special, and
the text is what a client sees. Streaming code holds back a tail that could still grow into a marker
(`partial_marker_length`) and only decides once the text disambiguates.
"""

from __future__ import annotations

from collections.abc import Iterable

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"

DEEPSEEK_V3_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS,
    EOS,
    USER,
    ASSISTANT,
    THINK_START,
    THINK_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    TOOL_OUTPUTS_END,
)

# Markers the stream parsers read from generated text. When they are special tokens, the detokenizer must keep
# them even with skip_special_tokens on (pass these as keep_special_tokens), or the parsers never see them.
TOOL_CALL_MARKERS: tuple[str, ...] = (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP)
STREAM_MARKERS: tuple[str, ...] = (THINK_START, THINK_END) + TOOL_CALL_MARKERS


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper, non-empty prefix of one of `markers`.

    That many characters must be held back: the next chunk may complete the marker.
    """
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest complete occurrence of any of `markers` in `text[start:]`: (index, marker), or None."""
    found: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker, start)
        if i != -1 and (found is None or i < found[0] or (i == found[0] and len(marker) > len(found[1]))):
            found = (i, marker)
    return found
