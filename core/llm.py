"""Offline inference: `LLM(model=path).generate(prompts, SamplingParams(...))`, on the continuous-batching engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidInputError

Prompt = str | Sequence[int]
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class LLM:
    """Load a HF DeepSeek checkpoint folder and generate; engine options (max_num_seqs, kv_cache_memory,
    enable_prefix_caching, batch_invariant, ...) pass through to EngineConfig, speculative decoding's too:
    speculative_engine="mtp" | "dspark" | None, num_speculative_tokens=k, dspark_confidence_threshold=None
    (None: the hardware-aware prefix scheduler), dspark_model=folder (default: <model>/dspark)."""

    def __init__(
        self,
        model: str | Path,
        backend: str | None = None,
        precision: str | None = None,
        max_model_len: int | None = None,
        dtype: torch.dtype | str | None = None,
        **engine_options: Any,
    ):
        dtype = _DTYPE_NAMES.get(dtype, dtype)
        self.engine = LLMEngine.from_config(EngineConfig(
            model=str(model), backend=backend, precision=precision, max_model_len=max_model_len, dtype=dtype, **engine_options
        ))
        self._ids = itertools.count()

    @property
    def model(self):
        return self.engine.model

    @property
    def backend(self):
        return self.engine.backend

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def kv_cache_dtype(self) -> str:
        return self.engine.runner.spec.dtype

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Results in prompt order. A bad prompt raises InvalidInputError before anything runs."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidInputError(f"sampling_params must be one SamplingParams or one per prompt ({n})")
    return params
