"""Sequence: one stream of tokens the scheduler drives (a request, or one of its n > 1 branches).

Pure Python (no torch): the scheduler and block manager run on the host while the device works.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable

from deepinfer.errors import DeepInferError, InvalidInputError

# Token ids are hashed as signed 64-bit integers for prefix caching.
_MAX_TOKEN_ID = 2**63 - 1


class EngineStateError(DeepInferError, RuntimeError):
    """The engine drove the scheduler or block manager inconsistently (a bug in the caller, not user input):
    a stale scheduler output, tokens past max_len, a block freed twice through a different object..."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED})


# A sampled token still on its way from the device (overlapped scheduling): the engine appends it so that the
# next step can be scheduled, and resolves it before its position is ever computed or hashed.
PENDING_TOKEN = -1


def _token_list(token_ids: Iterable[int], what: str, allow_pending: bool = False) -> list[int]:
    try:
        tokens = [operator.index(t) for t in token_ids]
    except TypeError as exc:
        raise InvalidInputError(f"{what} must be integers: {exc}") from None
    if allow_pending and tokens == [PENDING_TOKEN]:
        return tokens
    if tokens and (min(tokens) < 0 or max(tokens) > _MAX_TOKEN_ID):
        raise InvalidInputError(f"{what} must be non-negative integers below 2**63")
    return tokens


class Sequence:
    """Token ids (prompt then outputs), how many of them have their latent KV in the cache, and the cache
    blocks holding them.

    Tokens are append-only (`append_token_ids`), which is what makes the cached `block_hashes` of full
    blocks stay valid. `prompt_token_ids`, `output_token_ids` and `all_token_ids` return tuples (copies),
    so appending to them by mistake fails loudly instead of desynchronising the sequence.
    """

    __slots__ = (
        "seq_id", "max_len", "num_prompt_tokens", "num_computed_tokens", "block_table", "status",
        "arrival", "fork_index", "block_hashes", "skip_prefix_cache", "_token_ids", "_prompt",
    )

    def __init__(self, seq_id: str, prompt_token_ids: Iterable[int], max_len: int,
                 output_token_ids: Iterable[int] = ()):
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidInputError(f"seq_id must be a non-empty string, got {seq_id!r}")
        if not isinstance(max_len, int) or max_len < 1:
            raise InvalidInputError(f"max_len must be a positive integer, got {max_len!r}")
        prompt = _token_list(prompt_token_ids, "prompt token ids")
        if not prompt:
            raise InvalidInputError(f"sequence {seq_id!r}: the prompt is empty")
        self.seq_id = seq_id
        self.max_len = max_len  # cap on prompt + output tokens (the engine min's it with max_model_len)
        self.num_prompt_tokens = len(prompt)
        self._prompt = tuple(prompt)
        self._token_ids = prompt + _token_list(output_token_ids, "output token ids")
        self.num_computed_tokens = 0  # leading tokens whose latent KV is in the cache
        self.block_table: list[int] = []  # cache block ids, in token order
        self.status = SequenceStatus.WAITING
        # Priority (lower = older = served first): arrival order, then fork order among n > 1 branches.
        self.arrival = -1  # assigned by the scheduler on add()
        self.fork_index = 0
        # Chained hashes of the full blocks of all_token_ids, filled lazily by the block manager.
        self.block_hashes: list[bytes] = []
        # Admission takes no prefix-cache hits (a request wanting prompt log-probs must compute every
        # prompt position); its own full blocks are still registered for others.
        self.skip_prefix_cache = False

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self._prompt

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids[self.num_prompt_tokens:])

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids)

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole sequence."""
        return self._token_ids[start:end]

    def get_token_id(self, index: int) -> int:
        """all_token_ids[index]."""
        return self._token_ids[index]

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def priority(self) -> tuple[int, int]:
        return (self.arrival, self.fork_index)

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append sampled tokens, or a single PENDING_TOKEN whose value resolve_pending() gives later."""
        tokens = self._token_ids
        if tokens[-1] == PENDING_TOKEN:
            raise EngineStateError(f"sequence {self.seq_id!r}: its last token is still pending")
        # One token per decode step is the hot case (every running sequence, every step): checked inline
        # instead of through _token_list's comprehension and min/max.
        if type(token_ids) is list and len(token_ids) == 1:
            token = token_ids[0]
            if type(token) is int and (0 <= token <= _MAX_TOKEN_ID or token == PENDING_TOKEN):
                tokens.append(token)
                return
        tokens.extend(_token_list(token_ids, "sampled token ids", allow_pending=True))

    @property
    def has_pending_token(self) -> bool:
        return self._token_ids[-1] == PENDING_TOKEN

    def resolve_pending(self, token: int) -> None:
        """Replace the pending last token by its sampled value."""
        if self._token_ids[-1] != PENDING_TOKEN:
            raise EngineStateError(f"sequence {self.seq_id!r} has no pending token to resolve")
        if type(token) is not int or not 0 <= token <= _MAX_TOKEN_ID:
            token = _token_list([token], "sampled token ids")[0]
        self._token_ids[-1] = token

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens} "
                f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, "
                f"max_len={self.max_len}, blocks={self.block_table})")
