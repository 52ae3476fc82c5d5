"""Offline inference: `LLM(model=path).generate(prompts, SamplingParams(...))`.

Every request is prefilled in one step, then all running requests decode together until each stops.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from deepinfer.attention import AttentionBatch
from deepinfer.config import ModelConfig
from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.sampler import position_logprobs, sample_row
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidInputError
from deepinfer.model.loader import load_model
from deepinfer.quant import cdiv
from deepinfer.registry import load_backend

Prompt = str | Sequence[int]
BLOCK_SIZE = 64


class _Sequence:
    """One request's state in the generation loop."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, first_block: int, max_len: int):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.max_len = max_len
        self.block_table = tuple(range(first_block, first_block + cdiv(max_len, BLOCK_SIZE)))
        self.output = CompletionOutput(index=0, logprobs=[] if params.logprobs is not None else None)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)


class LLM:
    def __init__(
        self,
        model: str | Path,
        backend: str | None = None,
        precision: str | None = None,
        max_model_len: int | None = None,
        dtype: torch.dtype | str | None = None,
        kv_cache_dtype: str | None = None,
        load_mtp: bool = True,
    ):
        self.model_path = Path(model)
        self.config = ModelConfig.from_hf_dir(self.model_path)
        self.backend = load_backend(backend)
        if isinstance(dtype, str):
            dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                     "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}.get(dtype) or _bad_dtype(dtype)
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise InvalidInputError(f"max_model_len must be in [1, {limit}] (max_position_embeddings), got {max_model_len}")
        self.max_model_len = max_model_len or limit
        self.model = load_model(self.model_path, self.backend, config=self.config, precision=precision,
                                dtype=dtype, max_positions=self.max_model_len, load_mtp=load_mtp)
        act = self.model.embed_tokens.dtype
        self.kv_cache_dtype = kv_cache_dtype or {torch.float32: "fp32", torch.float16: "fp16"}.get(act, "bf16")
        self.tokenizer = _load_tokenizer(self.model_path)
        self._ids = itertools.count()

    # --- prompts ----------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError(
                    f"prompt is a string but {self.model_path} has no tokenizer.json; pass token ids instead"
                )
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise InvalidInputError("a token-id prompt must be a list of integers")
        return None, ids

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidInputError("prompt is empty")
        if len(ids) > self.max_model_len:
            raise InvalidInputError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")

    # --- generation -------------------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        params_list = _broadcast_params(sampling_params, len(prompts))
        seqs, next_block = [], 0
        for prompt, params in zip(prompts, params_list):
            text, ids = self._prompt_ids(prompt)
            self._check_prompt(ids)
            budget = self.max_model_len if params.max_tokens is None else len(ids) + params.max_tokens
            seq = _Sequence(str(next(self._ids)), text, ids, params, next_block, min(budget, self.max_model_len))
            next_block += len(seq.block_table)
            seqs.append(seq)
        runner = ModelRunner(self.model, self.backend, ModelRunner.cache_spec(self.model, next_block, BLOCK_SIZE, self.kv_cache_dtype))

        self._step(runner, seqs, prefill=True)
        running = [s for s in seqs if not s.output.finished]
        while running:
            self._step(runner, running, prefill=False)
            running = [s for s in running if not s.output.finished]
        return [self._result(s) for s in seqs]

    def _step(self, runner: ModelRunner, seqs: list[_Sequence], prefill: bool) -> None:
        input_ids, query_lens, logit_rows = [], [], []
        for s in seqs:
            new = s.token_ids if prefill else s.token_ids[-1:]
            start = len(input_ids)
            input_ids += new
            query_lens.append(len(new))
            if prefill and s.prompt_logprobs is not None:
                logit_rows += range(start, start + len(new))
            else:
                logit_rows.append(start + len(new) - 1)
        batch = AttentionBatch(tuple(query_lens), tuple(len(s.token_ids) for s in seqs), tuple(s.block_table for s in seqs))
        logits = runner.execute(batch, input_ids, logit_rows).logits
        row = 0
        for s in seqs:
            if prefill and s.prompt_logprobs is not None:
                n = s.num_prompt
                lps = logits[row : row + n].log_softmax(-1)
                for i in range(n - 1):
                    s.prompt_logprobs.append(position_logprobs(lps[i], s.token_ids[i + 1], s.params.prompt_logprobs))
                row += n - 1
            self._append_token(s, logits[row])
            row += 1

    def _append_token(self, s: _Sequence, logits: torch.Tensor) -> None:
        token = sample_row(logits, s.params, s.generator)
        s.token_ids.append(token)
        s.output.token_ids.append(token)
        if s.output.logprobs is not None:
            s.output.logprobs.append(position_logprobs(logits.log_softmax(-1), token, s.params.logprobs))
        eos = self.config.eos_token_ids
        if token in s.params.stop_token_ids:
            s.output.finish_reason, s.output.stop_reason = "stop", token
        elif not s.params.ignore_eos and token in eos:
            s.output.finish_reason = "stop"
        elif len(s.token_ids) >= s.max_len:
            s.output.finish_reason = "length"

    def _result(self, s: _Sequence) -> RequestOutput:
        if self.tokenizer is not None:
            s.output.text = self.tokenizer.decode(s.output.token_ids, skip_special_tokens=True)
        return RequestOutput(s.request_id, s.prompt, s.token_ids[: s.num_prompt], s.prompt_logprobs, [s.output], True)


def _broadcast_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidInputError(f"sampling_params must be one SamplingParams or one per prompt ({n})")
    return params


def _bad_dtype(dtype: str):
    raise InvalidInputError(f"dtype {dtype!r} is not one of bfloat16, float16, float32")


def _load_tokenizer(path: Path):
    if not (path / "tokenizer.json").exists():
        return None
    from deepinfer.text.tokenizer import Tokenizer

    return Tokenizer.from_folder(path)
