"""A sequence's output text with stop strings applied.

The stop string and everything after it never reach the user, also when the string is split across
tokens: text that could still turn out to start a stop string is held back until it cannot.
"""

from __future__ import annotations

from deepinfer.text.detokenizer import IncrementalDetokenizer


class StopStringChecker:
    def __init__(self, detokenizer: IncrementalDetokenizer | None, stop: list[str]):
        self._detok = detokenizer
        # Without a detokenizer there is no text: add() never matches and the text stays "", so the engine
        # skips the checker per token.
        self.decodes = detokenizer is not None
        self._stop = stop
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""  # everything decoded so far, cut at a matched stop string
        self._emitted = 0  # characters of `text` already handed out as deltas
        self.matched: str | None = None

    def add(self, token_id: int, match: bool = True) -> str | None:
        """Decode one more token; return the stop string if this token completed one. match False (min_tokens
        not reached, as vLLM): decode only; a later token matches only strings that end in its own text."""
        if self._detok is None or self.matched is not None:
            return None
        before = len(self.text)
        self.text += self._detok.add(token_id)
        if not self._stop or not match:
            return None
        # Each string only where it would end in this token's text (one that ended earlier, held back by
        # min_tokens, stays unmatched).
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, max(0, before - len(s) + 1))) != -1]
        if hits:
            index, self.matched = min(hits)
            self.text = self.text[:index]
        return self.matched

    def finish(self) -> None:
        """The sequence ended for another reason: release what the detokenizer still holds."""
        if self._detok is not None and self.matched is None:
            self.text += self._detok.finish()

    def take_delta(self, final: bool) -> str:
        """New text safe to show: all of it when final, else without a tail that may begin a stop string."""
        end = len(self.text)
        if not final and self.matched is None:
            end -= self._held_back()
        end = max(end, self._emitted)
        delta, self._emitted = self.text[self._emitted : end], end
        return delta

    @property
    def visible(self) -> str:
        """The text handed out so far."""
        return self.text[: self._emitted]

    def _held_back(self) -> int:
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
