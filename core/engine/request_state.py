"""Engine-side state of one request: its completions, their seeds, stop checkers and snapshots."""

from __future__ import annotations

import hashlib

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import SequenceStatus
from deepinfer.engine.stop_checker import StopStringChecker

FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


def completion_seed(seed: int, index: int) -> int:
    """Completion `index`'s own seed: completions of one request draw independent noise."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}#{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class EngineRequest:
    """Engine-side state of one request: its completions' sequences, text and logprobs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, seed: int, tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        self.seq_ids = [f"{request_id}#{i}" for i in range(params.n)]
        self.completions = [
            CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)
        ]
        self.checkers = [self._checker(tokenizer) for _ in range(params.n)]
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.forked = params.n == 1

    def _checker(self, tokenizer) -> StopStringChecker:
        detok = None
        if tokenizer is not None:
            from deepinfer.text.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=self.params.skip_special_tokens)
        return StopStringChecker(detok, self.params.stop)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def snapshot(self) -> RequestOutput:
        outs = []
        for c in self.completions:
            outs.append(CompletionOutput(
                index=c.index, token_ids=list(c.token_ids), text=c.text,
                logprobs=None if c.logprobs is None else list(c.logprobs),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                delta_token_ids=c.delta_token_ids, delta_text=c.delta_text,
            ))
            c.delta_token_ids, c.delta_text = [], ""
        plp = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), plp, outs, self.finished)
