"""Generated text as the API shows it: per-token texts and bytes (for logprobs), OpenAI's two logprobs
layouts, and the filter that removes special tokens other than the stream markers from chat output.

Why a filter: the chat parsers must see `<think>` and the tool-call markers, which a DeepSeek tokenizer may
mark special. The engine's detokenizer either skips all special tokens or keeps all of them, so chat
requests run with skip_special_tokens=False and this filter drops the special tokens the parsers do not read
(bos/eos, `<｜User｜>`, the tool-call markers when no tools are parsed, ...), robust to any chunk boundary.
The engine's stop strings then apply to the raw text, which is what the model wrote.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from tokenizers import decoders

from deepinfer.engine.outputs import PositionLogprobs
from deepinfer.text import Tokenizer
from deepinfer.text.markers import STREAM_MARKERS, THINK_END, THINK_START, find_first, partial_marker_length

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE token characters -> bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in table.items()}


class TokenTexts:
    """Text and bytes of single tokens, cached (a vocabulary is small next to the requests it serves)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._byte_map = _byte_level_decoder() if self._byte_level else {}
        self._added = set(tokenizer.backend.get_added_tokens_decoder())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and token_id not in self._added and all(c in self._byte_map for c in piece):
            raw = bytes(self._byte_map[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self._tok.decode([token_id]) if 0 <= token_id < self._tok.vocab_size else ""
        return text, list(text.encode("utf-8"))

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _top(position: PositionLogprobs, top_n: int) -> list[tuple[int, float]]:
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank <= top_n)
    return [(tid, value) for _, tid, value in ranked[:top_n]]


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
                  top_n: int) -> dict[str, Any]:
    """Chat layout: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for token_id, position in zip(token_ids, positions):
        text, raw = texts.get(token_id)
        entry = {"token": text, "logprob": _lp(position[token_id].logprob), "bytes": raw, "top_logprobs": []}
        for tid, value in _top(position, top_n):
            t, b = texts.get(tid)
            entry["top_logprobs"].append({"token": t, "logprob": _lp(value), "bytes": b})
        content.append(entry)
    return {"content": content}


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None],
                        top_n: int, text_offset: int) -> dict[str, Any]:
    """Completions layout: parallel lists tokens / token_logprobs / top_logprobs / text_offset.

    A None position (the first prompt token when echoing) has no log-probability."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token_id, position in zip(token_ids, positions):
        text = texts.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if position is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(position[token_id].logprob))
        top = {texts.text(tid): _lp(value) for tid, value in _top(position, top_n)}
        top.setdefault(text, _lp(position[token_id].logprob))  # OpenAI lists the sampled token too
        out["top_logprobs"].append(top)
    return out


class SpecialTextFilter:
    """Drops the given token texts from a stream of text deltas, whatever the chunk boundaries."""

    def __init__(self, drop: Collection[str]):
        self._drop = tuple(sorted({d for d in drop if d}, key=len, reverse=True))
        self._buf = ""

    def feed(self, text: str) -> str:
        if not self._drop:
            return text
        return self._advance(text, final=False)

    def finish(self) -> str:
        if not self._drop:
            return ""
        return self._advance("", final=True)

    def _advance(self, text: str, final: bool) -> str:
        buf = self._buf + text
        out = []
        while (hit := find_first(buf, self._drop)) is not None:
            at, token = hit
            out.append(buf[:at])
            buf = buf[at + len(token):]
        keep = 0 if final else partial_marker_length(buf, self._drop)
        out.append(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return "".join(out)


def chat_text_filter(tokenizer: Tokenizer, skip_special_tokens: bool, tools: bool) -> SpecialTextFilter:
    """Drop every special token but the markers the parsers read: `<think>`/`</think>` always (reasoning is always
    parsed), the tool-call markers when tools are parsed. Nothing is dropped when the client keeps special tokens."""
    if not skip_special_tokens:
        return SpecialTextFilter(())
    keep = STREAM_MARKERS if tools else (THINK_START, THINK_END)
    return SpecialTextFilter(set(tokenizer.special_tokens) - set(keep))
