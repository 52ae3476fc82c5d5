"""SamplingParams: how to pick each next token and when to stop (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.errors import InvalidInputError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """temperature 0 is greedy; top_k 0 or -1 disables top-k; logprobs=N returns the sampled token's
    log-probability plus the N most likely (prompt_logprobs likewise for every prompt token but the first)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # before this many tokens no EOS, stop id or stop string ends the output (vLLM)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias; -100 bans, +100 forces).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Speculative decoding, per request: False opts out; max_draft_tokens caps the draft length. Neither can
    # change the output distribution (verification is lossless), only speed.
    dspark_speculation: bool | None = None
    max_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidInputError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidInputError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInputError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidInputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidInputError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidInputError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidInputError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidInputError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidInputError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidInputError(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidInputError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidInputError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.logit_bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(self.logit_bias, dict):
            raise InvalidInputError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        self.logit_bias = dict(self.logit_bias)  # the caller's dict stays the caller's
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidInputError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100.0 <= bias <= 100.0:
                raise InvalidInputError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {token}")
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidInputError(f"n must be a positive integer, got {self.n!r}")
        if self.dspark_speculation is not None and not isinstance(self.dspark_speculation, bool):
            raise InvalidInputError(f"dspark_speculation must be a boolean or None, got {self.dspark_speculation!r}")
        if self.max_draft_tokens is not None and (not isinstance(self.max_draft_tokens, int)
                                                  or isinstance(self.max_draft_tokens, bool) or self.max_draft_tokens < 0):
            raise InvalidInputError(f"max_draft_tokens must be a non-negative integer or None, got {self.max_draft_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
