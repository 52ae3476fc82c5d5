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
        # What every RequestOutput of this request carries as prompt_token_ids: one copy, shared by them (as in
        # vLLM), instead of a copy of the whole prompt per request per step; the engine reads prompt_ids only.
        self._prompt_out = list(prompt_ids)
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
        """This request's output so far: cumulative fields copied (later steps do not change it), deltas
        handed over and reset."""
        outs = []
        finished = True
        for c in self.completions:
            outs.append(CompletionOutput(
                c.index, c.token_ids[:], c.text, None if c.logprobs is None else c.logprobs[:],
                c.finish_reason, c.stop_reason, c.delta_token_ids, c.delta_text,
            ))
            c.delta_token_ids, c.delta_text = [], ""
            finished = finished and c.finish_reason is not None
        plp = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self._prompt_out, plp, outs, finished)
