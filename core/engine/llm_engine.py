"""LLMEngine: continuous batching over the scheduler, the model runner and the sampler.

One `step()` schedules a batch (decodes first, then prefill chunks), runs the model once, samples the
sequences whose known tokens are all computed, applies stop conditions and returns the outputs of the
requests that moved. A request with n > 1 completions prefills once; its other completions fork from the
prompt's cache blocks without copying them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.attention import AttentionBatch
from deepinfer.backend import Backend
from deepinfer.config import EngineConfig, ModelConfig
from deepinfer.engine.cuda_graphs import default_batch_sizes
from deepinfer.engine.memory_profile import kv_cache_spec
from deepinfer.engine.outputs import EngineStats, PositionLogprobs, RequestOutput
from deepinfer.engine.overlap import InFlightStep, pending_input
from deepinfer.engine.request_state import FINISH_REASON, EngineRequest, completion_seed
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.sampler import (apply_penalties_rows, assemble_logprobs, logprob_stats, needs_row_processing,
                                      position_logprobs, sample_rows, sample_rows_device, sample_token)
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from deepinfer.engine.sequence import PENDING_TOKEN, EngineStateError, Sequence, SequenceStatus
from deepinfer.errors import ConfigError, InvalidInputError
from deepinfer.model.deepseek import DeepseekModel
from deepinfer.spec.drafter import DraftRequest, Observation
from deepinfer.spec.verifier import VerifyContext, verify
from deepinfer.transfer import take_rows, to_device

logger = logging.getLogger(__name__)


class _ForwardOutOfMemory(Exception):
    """A step's forward ran out of device memory (raised before the step changed any request's state)."""


@contextlib.contextmanager
def _out_of_memory_fails_step():
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise _ForwardOutOfMemory(str(exc).split("\n")[0]) from exc


PROMPT_LOGITS_ROWS = 256  # prompt-logprob rows whose logits exist at once (the start-up memory profile counts them)

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class _StepLayout:
    """One step's batch and which logit rows to compute: prompt-logprob rows and each sampled sequence's row."""

    batch: AttentionBatch
    input_ids: list[int]
    rows: list[int]  # token rows of the batch whose logits the runner computes (sampling and drafts)
    prompt_rows: list[tuple[int, "EngineRequest", int]]  # (token row of the batch, request, prompt position it scores)
    sample_rows: list[tuple[int, object]]  # (index into rows, ScheduledSequence); drafts add rows after it
    offsets: list[int]  # per scheduled sequence: its first token row in the batch


class LLMEngine:
    def __init__(self, model: DeepseekModel, backend: Backend, engine_config: EngineConfig, tokenizer=None, max_model_len: int | None = None,
                 speculator=None):
        """speculator: a deepinfer.spec Speculator to use instead of the one engine_config describes (tests,
        custom drafters)."""
        self.model = model
        self.backend = backend
        self.config: ModelConfig = model.config
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or engine_config.max_model_len or self.config.max_position_embeddings
        act = model.embed_tokens.dtype
        kv_dtype = engine_config.kv_cache_dtype or {torch.float32: "fp32", torch.float16: "fp16"}.get(act, "bf16")
        spec = kv_cache_spec(self.model, backend, engine_config, self.max_model_len, kv_dtype,
                             logit_rows=engine_config.max_num_seqs + 2 * PROMPT_LOGITS_ROWS)
        self.runner = ModelRunner(model, backend, spec, self._graph_batch_sizes(), self.max_model_len,
                                  expert_parallel=engine_config.expert_parallel_size > 1)
        from deepinfer.spec.speculator import build_speculator

        self.speculator = speculator or build_speculator(engine_config, model, self.runner, type(backend).__name__)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=engine_config.max_num_seqs,
            max_num_batched_tokens=engine_config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=engine_config.block_size,
            num_blocks=self.runner.num_usable_blocks,
            enable_prefix_caching=engine_config.enable_prefix_caching,
            enable_chunked_prefill=engine_config.enable_chunked_prefill,
            num_lookahead_slots=self.speculator.num_lookahead_slots if self.speculator else 0,
        ))
        self._requests: dict[str, EngineRequest] = {}
        self._seq_owner: dict[str, tuple[EngineRequest, int]] = {}
        self._generated_tokens = 0
        self._eos = frozenset(self.config.eos_token_ids)  # the config is frozen; checked for every token
        # Expert parallelism (deepinfer.engine.expert_parallel) sets this hook: a rank that schedules nothing
        # in a step must still enter the step's MoE collectives, with a forward of no tokens.
        self.idle_forward: Callable[[], None] | None = None
        # A forward out of device memory fails only its step's requests (_fail_step). Expert parallelism turns
        # this off: the other ranks wait in that forward's MoE collectives, so the whole group must fail.
        self.fail_step_on_oom = True
        self._inflight: InFlightStep | None = None  # overlapped scheduling: the step whose tokens are on the way

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, engine_config: EngineConfig, speculator=None) -> LLMEngine:
        from pathlib import Path

        from deepinfer.model.loader import load_model
        from deepinfer.registry import load_backend

        if engine_config.expert_parallel_size > 1:
            raise ConfigError("expert_parallel_size > 1 runs one engine per rank: use deepinfer.engine.expert_parallel")
        path = Path(engine_config.model)
        config = ModelConfig.from_hf_dir(path)
        limit = config.max_position_embeddings
        if engine_config.max_model_len is not None and engine_config.max_model_len > limit:
            raise InvalidInputError(f"max_model_len must be at most {limit} (max_position_embeddings), got {engine_config.max_model_len}")
        max_model_len = engine_config.max_model_len or limit
        options = {"batch_invariant": True} if engine_config.batch_invariant else {}
        backend = load_backend(engine_config.backend, **options)
        dtype = _TORCH_DTYPES.get(engine_config.dtype) if engine_config.dtype else None
        model = load_model(path, backend, config=config, precision=engine_config.precision, dtype=dtype,
                           max_positions=max_model_len, load_mtp=engine_config.load_mtp, progress=engine_config.progress)
        tokenizer = None
        if (path / "tokenizer.json").exists():
            from deepinfer.text.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_folder(path)
        return cls(model, backend, engine_config, tokenizer, max_model_len, speculator)

    def _graph_batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes to capture: none when eager is forced or the backend cannot capture on a GPU
        (under expert parallelism the ranks agree on each step's size: ExpertParallelEngine.agree)."""
        ec = self.engine_config
        if ec.enforce_eager or not self.backend.capabilities.graph_capture or self.backend.device.type != "cuda":
            return ()
        return default_batch_sizes(min(ec.cuda_graph_max_batch_size, ec.max_num_seqs))

    @property
    def num_cache_tokens(self) -> int:
        return self.runner.num_usable_blocks * self.runner.spec.block_size

    # --- requests ---------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError("prompt is a string but the model folder has no tokenizer.json; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidInputError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise InvalidInputError("a token-id prompt must be a list of integers")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises InvalidInputError (nothing is queued) for a bad one."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        text, ids = self.prompt_ids(prompt)
        if not ids:
            raise InvalidInputError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidInputError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate")
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise InvalidInputError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        bad = next((t for t in params.logit_bias if t >= self.config.vocab_size), None)
        if bad is not None:
            raise InvalidInputError(f"logit_bias token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise InvalidInputError("stop strings need a tokenizer; this model folder has none (use stop_token_ids)")
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        req = EngineRequest(request_id, text, ids, params, seed, self.tokenizer)
        max_len = self._max_len(len(ids), params)
        seq = Sequence(req.seq_ids[0], ids, max_len)
        seq.skip_prefix_cache = params.prompt_logprobs is not None
        self.scheduler.add(seq)  # raises if it can never fit
        self._requests[request_id] = req
        self._seq_owner[seq.seq_id] = (req, 0)

    def _max_len(self, prompt_len: int, params: SamplingParams) -> int:
        return self.max_model_len if params.max_tokens is None else min(self.max_model_len, prompt_len + params.max_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any moment and free its cache blocks; returns its final output, or None if unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for i, seq_id in enumerate(req.seq_ids):
            self._seq_owner.pop(seq_id, None)
            self.scheduler.finish(seq_id, SequenceStatus.FINISHED_ABORTED)
            if self.speculator:
                self.speculator.release(seq_id)
            if req.completions[i].finish_reason is None:
                req.completions[i].finish_reason = "abort"
        return req.snapshot()

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self._inflight is not None

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            running=s.num_running, waiting=s.num_waiting, cache_usage=s.cache_usage,
            prefix_cache_hit_rate=s.prefix_cache_hit_rate, prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_queries=s.prefix_cache_queries, preemptions=s.num_preemptions,
            prompt_tokens=s.num_prompt_tokens_computed, generated_tokens=self._generated_tokens,
            num_blocks=self.runner.num_usable_blocks, free_blocks=self.scheduler.block_manager.num_free_blocks,
            spec_decode=self.speculator.metrics.snapshot() if self.speculator else None,
        )

    def failure(self) -> str | None:
        """Why this engine can no longer step although its own state is sound (a peer process it steps with
        is gone), or None. A single-process engine has no such peers."""
        return None

    # --- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs of the requests that moved. With overlapped scheduling the
        outputs are those of the previous step, resolved while this one runs on the device."""
        pending, self._inflight = self._inflight, None
        plan = self.scheduler.schedule()
        outputs = None
        try:
            if plan.scheduled and self._can_defer(plan):
                launched = self._launch(plan, pending)
                outputs = self._resolve(pending)
                self._commit(launched)
                return outputs
            outputs = self._resolve(pending)
            plan = self._without_finished(plan) if pending is not None else plan
            if not plan.scheduled:
                if self.idle_forward is not None:
                    self.idle_forward()
                return outputs
            return outputs + self._run(plan)
        except _ForwardOutOfMemory as oom:
            if not self.fail_step_on_oom:
                raise
            return (self._resolve(pending) if outputs is None else outputs) + self._fail_step(plan, oom)

    def _execute(self, layout: _StepLayout, capture: tuple[int, ...] = (), pending: InFlightStep | None = None):
        """The step's forward. Out of device memory there, before the step changed any request, only its
        requests fail (see _fail_step)."""
        with _out_of_memory_fails_step():
            return self.runner.execute(layout.batch, layout.input_ids, layout.rows, capture,
                                       pending_tokens=None if pending is None else pending.tokens)

    def _fail_step(self, plan: SchedulerOutput, oom: Exception) -> list[RequestOutput]:
        """End the requests of a step whose forward ran out of device memory, with an error, freeing their
        blocks; the others go on. Nothing was committed: no block of theirs entered the prefix cache."""
        if self.backend.device.type == "cuda":
            torch.cuda.empty_cache()
        owners = (self._seq_owner.get(item.seq.seq_id) for item in plan.scheduled)
        failed = list(dict.fromkeys(owner[0].request_id for owner in owners if owner is not None))
        logger.error("out of device memory in a step of %d sequences (%s); failing requests %s",
                     len(plan.scheduled), oom, failed)
        outputs = [out for out in map(self.abort, failed) if out is not None]
        for out in outputs:
            out.error = f"the device ran out of memory in this request's step: {oom}"
        return outputs

    def _run(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """A synchronous step: forward, sample, verify drafts, update the scheduler, build outputs."""
        started = time.perf_counter()
        with _out_of_memory_fails_step():  # drafting: forwards of the drafter (and MTP layers)
            drafts = self._propose(plan) if self.speculator else {}
        layout = self._layout(plan, drafts)
        capture = self.speculator.capture_layers if self.speculator else ()
        step_out = self._execute(layout, capture)
        logits = step_out.logits
        touched: dict[str, EngineRequest] = {}
        # Prompt logprobs from the step's hidden states a slice of rows at a time: a whole chunk's [rows, vocab]
        # float32 logits (16k rows x 100k vocabulary: 6.7 GB) would not fit beside a full cache.
        for first in range(0, len(layout.prompt_rows), PROMPT_LOGITS_ROWS):
            part = layout.prompt_rows[first : first + PROMPT_LOGITS_ROWS]
            lps = self.model.compute_logits(take_rows(step_out.hidden, [row for row, _, _ in part])).log_softmax(-1)
            chosen = [req.prompt_ids[position] for _, req, position in part]
            top = max(req.params.prompt_logprobs for _, req, _ in part)
            stats = logprob_stats(lps, to_device(chosen, torch.int64, lps.device), top)
            chosen_lp, rank, values, ids = (t.tolist() for t in stats)  # the slice's numbers in one transfer each
            for j, (_, req, _) in enumerate(part):
                req.prompt_logprobs.append(assemble_logprobs(chosen[j], chosen_lp[j], rank[j], values[j], ids[j],
                                                             req.params.prompt_logprobs))
                touched[req.request_id] = req
        sampled: dict[str, list[int]] = {}
        sample_row: dict[str, int] = {}
        forks: list[tuple[EngineRequest, int, int, int]] = []
        accepted: dict[str, int] = {}
        draws: list[tuple[EngineRequest, int, Sequence, int]] = []  # (request, completion, sequence, logit row)
        for row_index, item in layout.sample_rows:
            req, index = self._seq_owner[item.seq.seq_id]
            draft = drafts.get(item.seq.seq_id)
            sample_row[item.seq.seq_id] = row_index
            if draft is not None:  # speculative: rows for the anchor and each draft
                result = self._verify(req, index, item.seq, draft, logits[row_index : row_index + 1 + len(draft.proposal.tokens)])
                sampled[item.seq.seq_id], accepted[item.seq.seq_id] = result.tokens, result.num_accepted
                continue
            draws.append((req, index, item.seq, row_index))
            if not req.forked:  # the parent's prompt is done: the other completions start from the same logits
                draws += [(req, child, item.seq, row_index) for child in range(1, req.params.n)]
                req.forked = True
        for (req, index, seq, row_index), token in zip(draws, self._sample_all(draws, logits)):
            if index == self._seq_owner[seq.seq_id][1]:
                sampled[seq.seq_id] = [token]
            else:
                forks.append((req, index, token, row_index))
        self.scheduler.update(plan, sampled, accepted)
        for req, child, token, row_index in forks:  # before the parent may finish and release its blocks
            self._fork(req, child, token)
        for req, child, token, row_index in forks:
            self._append(req, child, token, logits[row_index])
        for seq_id, tokens in sampled.items():
            req, index = self._seq_owner[seq_id]
            comp = req.completions[index]
            for i, token in enumerate(tokens):  # several when drafts were accepted; none after a stop
                if comp.finish_reason is not None:
                    break
                # The logit row only where logprobs are wanted: a tensor view per token costs microseconds.
                self._append(req, index, token, None if comp.logprobs is None else logits[sample_row[seq_id] + i])
            touched[req.request_id] = req
        if self.speculator:
            self._observe(plan, layout, step_out)
            for req, child, _, _ in forks:  # after observe: the parent's drafter state now covers the prompt
                seq = self.scheduler.get(req.seq_ids[child])
                if seq is not None:
                    self.speculator.fork(req.seq_ids[0], seq.seq_id, seq.num_computed_tokens)
            self.speculator.step_done(time.perf_counter() - started, layout.batch.num_tokens)
        return self._finish_outputs(touched)

    # --- overlapped scheduling (deepinfer.engine.overlap) ---------------------------------------------
    def _can_defer(self, plan: SchedulerOutput) -> bool:
        """Whether this step's sampled tokens may stay on the device while the next step is scheduled."""
        if not self.engine_config.overlap_scheduling or self.speculator is not None:
            return False
        for item in plan.scheduled:
            req, index = self._seq_owner[item.seq.seq_id]
            params = req.params
            if params.prompt_logprobs is not None:
                return False
            if item.sample and not req.forked:  # its first token decides the other completions' forks
                return False
        return True

    def _launch(self, plan: SchedulerOutput, pending: InFlightStep | None) -> InFlightStep:
        """Forward and sample on the device; nothing waits for the result."""
        layout = self._layout(plan, pending=pending)
        step_out = self._execute(layout, pending=pending)
        draws, rows = [], []
        for row_index, item in layout.sample_rows:
            req, index = self._seq_owner[item.seq.seq_id]
            draws.append((req, index, item.seq))
            rows.append(row_index)
        device = step_out.logits.device
        tokens = torch.empty(0, dtype=torch.int64, device=device)
        extras, wanted = (), tuple(j for j, (r, _, _) in enumerate(draws) if r.params.logprobs is not None)
        if draws:
            raw = take_rows(step_out.logits, rows)
            logits = self._penalize_deferred(raw.float(), draws, pending)
            tokens = sample_rows_device(logits, [r.params for r, _, _ in draws],
                                        [completion_seed(r.seed, i) for r, i, _ in draws], [s.num_tokens for _, _, s in draws],
                                        self.backend.ops.argmax)
            if wanted:
                sel = to_device(wanted, torch.int64, device)
                top = max(draws[j][0].params.logprobs for j in wanted)
                extras = logprob_stats(raw.index_select(0, sel).float().log_softmax(-1), tokens.index_select(0, sel), top)
        return InFlightStep.launch(plan, draws, tokens, extras, wanted)

    def _penalize_deferred(self, logits: torch.Tensor, draws: list, pending: InFlightStep | None) -> torch.Tensor:
        """Penalties and min_tokens suppression for a deferred step, whose sequences may end with a token of
        the step in flight: counted from the device."""
        if not any(r.params.min_tokens or needs_row_processing(r.params) for r, _, _ in draws):
            return logits  # nothing to penalise or suppress (the usual case): skip the per-row lists
        outputs, pend = [], []
        for req, index, seq in draws:
            outputs.append(req.completions[index].token_ids)
            pend.append(pending.row_of[seq.seq_id] if seq.has_pending_token else -1)
        suppressed = [self._suppressed(req, len(out) + (p >= 0)) for (req, _, _), out, p in zip(draws, outputs, pend)]
        if not any(needs_row_processing(r.params) for r, _, _ in draws) and not any(suppressed):
            return logits
        tokens = None
        if pending is not None and pending.tokens.numel():
            where = to_device(pend, torch.int64, logits.device)
            tokens = torch.where(where >= 0, pending.tokens.index_select(0, where.clamp(min=0)), -1)
        return apply_penalties_rows(logits, [r.params for r, _, _ in draws], [r.prompt_ids for r, _, _ in draws],
                                    outputs, tokens, suppressed)

    def _commit(self, launched: InFlightStep) -> None:
        """Advance the scheduler past a launched step, its sampled tokens still pending."""
        pending, get = [PENDING_TOKEN], self.scheduler.get  # one list for all: update() only reads it
        live = {seq.seq_id: pending for _, _, seq in launched.draws if get(seq.seq_id) is seq}
        self.scheduler.update(launched.plan, live)
        self._inflight = launched

    def _resolve(self, pending: InFlightStep | None) -> list[RequestOutput]:
        """Give the in-flight step's sequences their sampled tokens and apply stop conditions."""
        if pending is None:
            return []
        touched: dict[str, EngineRequest] = {}
        tokens, *stats = pending.wait()
        stats_of = {j: [column[n] for column in stats] for n, j in enumerate(pending.logprob_rows)}
        owner, get = self._seq_owner.get, self.scheduler.get
        for j, ((req, index, seq), token) in enumerate(zip(pending.draws, tokens)):
            seq_id = seq.seq_id
            held = owner(seq_id)
            if held is None or held[0] is not req or held[1] != index or get(seq_id) is not seq:
                continue  # aborted, or stopped by an earlier token: this row was computed for nothing
            seq.resolve_pending(token)
            lps = assemble_logprobs(token, *stats_of[j], req.params.logprobs) if stats_of and j in stats_of else None
            self._append(req, index, token, None, lps)
            touched[req.request_id] = req
        return self._finish_outputs(touched)

    def _without_finished(self, plan: SchedulerOutput) -> SchedulerOutput:
        """The plan minus sequences that stopped when the in-flight step resolved (their blocks are free)."""
        keep = tuple(e for e in plan.scheduled if self.scheduler.get(e.seq_id) is e.seq)
        if len(keep) == len(plan.scheduled):
            return plan
        return SchedulerOutput(keep, plan.preempted, sum(e.num_new_tokens for e in keep))

    def _finish_outputs(self, touched: dict[str, EngineRequest]) -> list[RequestOutput]:
        outputs = [req.snapshot() for req in touched.values()]
        for out in outputs:
            if out.finished:
                self._retire(out.request_id)
        return outputs

    def _layout(self, plan: SchedulerOutput, drafts: dict | None = None, pending: InFlightStep | None = None) -> _StepLayout:
        """pending: the step in flight, whose sampled tokens some sequences end with (overlapped scheduling);
        their input is then named by pending_input(row) and read on the device."""
        query_lens, seq_lens, tables, input_ids, rows, prompt_rows, sample_rows = [], [], [], [], [], [], []
        offsets = []
        owner, drafts = self._seq_owner, drafts or {}
        for item in plan.scheduled:
            seq, start = item.seq, item.start
            end = start + item.num_new_tokens
            offset = len(input_ids)
            offsets.append(offset)
            if end == start + 1:  # one token (decodes): no slice to build
                input_ids.append(seq.get_token_id(start))
            else:
                input_ids += seq.get_token_ids(start, end)
            if input_ids[-1] == PENDING_TOKEN and end == seq.num_tokens:
                if pending is None or seq.seq_id not in pending.row_of:
                    raise EngineStateError(f"{seq.seq_id!r} ends with a pending token that no step in flight sampled")
                input_ids[-1] = pending_input(pending.row_of[seq.seq_id])
            draft = drafts.get(seq.seq_id) if drafts else None
            extra = draft.proposal.tokens if draft is not None else ()
            input_ids += extra  # verified in the same forward, in the lookahead slots
            query_lens.append(item.num_new_tokens + len(extra))
            seq_lens.append(end + len(extra))
            tables.append(tuple(seq.block_table))
            req, index = owner[seq.seq_id]
            if index == 0 and req.prompt_logprobs is not None:
                # The row of position p scores prompt token p + 1. Positions already recorded (seen again when a
                # preempted request is recomputed) are skipped.
                for p in range(max(start, len(req.prompt_logprobs) - 1), min(end, seq.num_prompt_tokens - 1)):
                    prompt_rows.append((offset + p - start, req, p + 1))
            if item.sample:
                sample_rows.append((len(rows), item))
                last = offset + item.num_new_tokens - 1
                if extra:
                    rows.extend(range(last, last + 1 + len(extra)))
                else:
                    rows.append(last)
        batch = AttentionBatch(tuple(query_lens), tuple(seq_lens), tuple(tables))
        return _StepLayout(batch, input_ids, rows, prompt_rows, sample_rows, offsets)

    # --- speculative decoding (deepinfer.spec) ------------------------------------------------------------
    def _propose(self, plan: SchedulerOutput) -> dict:
        """Drafts for this step's decoding sequences (those with lookahead slots whose request allows it)."""
        requests, sampling = [], 0
        k = self.speculator.num_lookahead_slots
        for item in plan.scheduled:
            if not item.sample:
                continue
            sampling += 1
            if item.num_new_tokens != 1 or item.num_lookahead_slots == 0:
                continue  # prompts (and recomputations) finish without drafts
            req, index = self._seq_owner[item.seq.seq_id]
            if not req.forked:  # a prompt's last token (a one-token chunk): n > 1 forks from its plain sample
                continue
            params = req.params
            limit = min(item.num_lookahead_slots, k if params.max_draft_tokens is None else params.max_draft_tokens)
            if params.dspark_speculation is False or limit == 0:
                continue
            requests.append(DraftRequest(item.seq.seq_id, item.seq.last_token_id, item.start, limit, params,
                                         completion_seed(req.seed, index), tuple(item.seq.block_table)))
        return self.speculator.propose(requests, plan.num_batched_tokens, sampling)

    def _verify(self, req: EngineRequest, index: int, seq: Sequence, draft, rows: torch.Tensor):
        output = req.completions[index].token_ids
        ctx = VerifyContext(req.params, completion_seed(req.seed, index), seq.num_tokens, req.prompt_ids, output,
                            lambda n: self._suppressed(req, n), seq.max_len - seq.num_tokens,
                            trace=self.speculator.metrics.record_traces)
        result = verify(rows, draft.proposal, ctx)
        self.speculator.record(draft, result)
        return result

    def _observe(self, plan: SchedulerOutput, layout: _StepLayout, step_out) -> None:
        """Hand the drafter the positions this step computed and kept, with the token after each."""
        observations = []
        for item, offset in zip(plan.scheduled, layout.offsets):
            seq = item.seq
            if self.scheduler.get(seq.seq_id) is not seq or seq.num_computed_tokens <= item.start:
                continue  # finished (or preempted) since: nothing to extend
            end = seq.num_computed_tokens
            observations.append(Observation(seq.seq_id, item.start, offset, tuple(seq.get_token_ids(item.start + 1, end + 1)),
                                            tuple(seq.block_table)))
        self.speculator.observe(observations, step_out.hidden, step_out.captured)

    def _suppressed(self, req: EngineRequest, output_len: int) -> list[int]:
        if output_len >= req.params.min_tokens:
            return []
        eos = [] if req.params.ignore_eos else list(self.config.eos_token_ids)
        return eos + list(req.params.stop_token_ids)

    def _sample_all(self, draws: list[tuple[EngineRequest, int, Sequence, int]], logits: torch.Tensor) -> list[int]:
        """One token per (request, completion, sequence, logit row). Rows without penalties or suppressed ids
        sample together (one host copy for the step); the others one by one. Same tokens either way."""
        tokens: list[int | None] = [None] * len(draws)
        batched: list[int] = []
        for i, (req, index, seq, row_index) in enumerate(draws):
            output = req.completions[index].token_ids
            suppressed = self._suppressed(req, len(output)) if req.params.min_tokens else ()
            if needs_row_processing(req.params) or suppressed:
                tokens[i] = sample_token(logits[row_index], req.params, completion_seed(req.seed, index), seq.num_tokens,
                                         req.prompt_ids, output, suppressed)
            else:
                batched.append(i)
        if batched:
            rows = torch.tensor([draws[i][3] for i in batched], dtype=torch.int64, device=logits.device)
            picked = sample_rows(logits.index_select(0, rows), [draws[i][0].params for i in batched],
                                 [completion_seed(draws[i][0].seed, draws[i][1]) for i in batched],
                                 [draws[i][2].num_tokens for i in batched], self.backend.ops.argmax)
            for i, token in zip(batched, picked):
                tokens[i] = token
        return tokens

    def _append(self, req: EngineRequest, index: int, token: int, row: torch.Tensor | None,
                logprobs: PositionLogprobs | None = None) -> None:
        """Record a sampled token for completion `index` and apply stop conditions."""
        comp, checker, params = req.completions[index], req.checkers[index], req.params
        comp.token_ids.append(token)
        comp.delta_token_ids.append(token)
        self._generated_tokens += 1
        if comp.logprobs is not None:
            if logprobs is None:  # a synchronous step: from this row's logits
                logprobs = position_logprobs(row.log_softmax(-1), token, params.logprobs)
            comp.logprobs.append(logprobs)
        status = None
        if params.stop_token_ids and token in params.stop_token_ids:
            status, comp.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif not params.ignore_eos and token in self._eos:
            status = SequenceStatus.FINISHED_STOPPED
        elif checker.decodes and checker.add(token, match=len(comp.token_ids) > params.min_tokens) is not None:
            status, comp.stop_reason = SequenceStatus.FINISHED_STOPPED, checker.matched
        elif len(req.prompt_ids) + len(comp.token_ids) >= self._max_len(len(req.prompt_ids), params):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            checker.finish()
            comp.finish_reason = FINISH_REASON[status]
            self.scheduler.finish(req.seq_ids[index], status)
        if checker.decodes:  # without a detokenizer the text stays ""
            comp.delta_text += checker.take_delta(final=status is not None)
            comp.text = checker.visible

    def _fork(self, req: EngineRequest, index: int, token: int) -> None:
        """Completion `index` shares the parent's prompt blocks and starts from its own first token."""
        child = Sequence(req.seq_ids[index], req.prompt_ids, self._max_len(len(req.prompt_ids), req.params), [token])
        self._seq_owner[child.seq_id] = (req, index)
        if child.num_tokens < child.max_len:  # else (max_tokens 1) _append finishes it by length: nothing to run
            self.scheduler.fork(req.seq_ids[0], child)

    def _retire(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            for seq_id in req.seq_ids:
                self._seq_owner.pop(seq_id, None)
                if self.speculator:
                    self.speculator.release(seq_id)

