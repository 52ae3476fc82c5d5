"""Generation results shaped like vLLM's RequestOutput / CompletionOutput, and the engine's counters (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.spec.metrics import SpecDecodeStats


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One position's log-probabilities: the chosen token's and the top-N's, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # What this step added (for streaming); token_ids / text / logprobs above are cumulative.
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # one list shared by all outputs of a request (not the engine's own copy)
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = False
    # Set when the engine failed the request (its step ran out of device memory); it ends with finish_reason
    # "abort" and the server answers with an error.
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """Counters for /metrics: token counts are totals since start-up."""

    running: int
    waiting: int
    cache_usage: float  # fraction of cache blocks held by requests
    prefix_cache_hit_rate: float
    prefix_cache_hits: int  # prompt tokens found in the prefix cache
    prefix_cache_queries: int
    preemptions: int
    prompt_tokens: int  # prompt tokens run through the model
    generated_tokens: int
    num_blocks: int
    free_blocks: int  # free or evictable (cached but unreferenced)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding counters, when it runs
