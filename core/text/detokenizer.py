"""Incremental detokenization: one per request, turning generated ids into text deltas as they arrive.

Decoding each new id alone is wrong twice over: byte-level tokens can split a UTF-8 character (decoded alone
they give U+FFFD), and some decoders change a token's text depending on what precedes it (leading-space
rules). So each step decodes a short window of ids twice, with and without the new ones, and emits the
difference; the window restarts at the last point where the text was complete. Trailing U+FFFD is held back:
the next ids may complete the character (the text before it is sent at once). `finish()` releases whatever is
held, so the concatenation of all deltas equals `tokenizer.decode(all ids)` with the same options.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from deepinfer.errors import InvalidInputError
from deepinfer.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for a growing id sequence. `add(ids)` returns new text (possibly ""), `finish()` the rest."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        keep_special_tokens: Collection[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._keep_ids = tokenizer.token_ids(keep_special_tokens) if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        # ids[_prefix:_read] decode to text already sent; of the text ids[_read:] add to it, the first
        # _sent_beyond_read characters are sent too (those before an incomplete character).
        self._prefix = 0
        self._read = 0
        self._sent_beyond_read = 0
        self._finished = False

    @property
    def ids(self) -> list[int]:
        """All ids added so far (a copy)."""
        return list(self._ids)

    def add(self, ids: int | Iterable[int]) -> str:
        """Append generated ids; return the text they complete. InvalidInputError for ids not in the vocabulary."""
        if self._finished:
            raise InvalidInputError("IncrementalDetokenizer.add called after finish()")
        new = self._tokenizer.check_ids([ids] if isinstance(ids, int) else ids)
        if not new:
            return ""
        self._ids.extend(new)
        after = self._decode(self._ids[self._prefix :])
        sent = len(self._decode(self._ids[self._prefix : self._read])) + self._sent_beyond_read
        if after.endswith(_REPLACEMENT):
            # The last character may be incomplete: send only what precedes the trailing U+FFFD run.
            safe = len(after.rstrip(_REPLACEMENT))
            if safe <= sent:
                return ""
            self._sent_beyond_read += safe - sent
            return after[sent:safe]
        if len(after) <= sent:
            return ""  # only skipped special tokens so far
        self._prefix, self._read, self._sent_beyond_read = self._read, len(self._ids), 0
        return after[sent:]

    def finish(self) -> str:
        """The text still held back (an incomplete character at the very end decodes as U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        after = self._decode(self._ids[self._prefix :])
        sent = len(self._decode(self._ids[self._prefix : self._read])) + self._sent_beyond_read
        return after[sent:]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode_valid_ids(ids, self._skip, self._keep_ids) if ids else ""
