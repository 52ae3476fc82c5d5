"""Expert-parallel runtime: one process per rank, attention data-parallel, routed experts partitioned.

Each rank runs its own LLMEngine (its own requests, scheduler and paged cache) over a model that holds only
its physical expert slots (deepinfer.moe.placement); every MoE layer moves tokens to the experts' ranks
with the backend's dispatch/combine over the EP group.

Lockstep. Every MoE layer is a collective, so all ranks must run the same number of model forwards, in the
same order. Each step the ranks all_reduce (MAX, on a gloo CPU group) whether any of them has work:
- no rank has work: every rank skips the step (nothing runs, nothing is recorded);
- otherwise every rank runs exactly one forward: its scheduled batch, or, when it scheduled nothing, an idle
  forward that enters each MoE layer's dispatch/combine with zero tokens (LLMEngine.idle_forward hook).
Before that forward the ranks agree (a second all_reduce, `agree`) on the step's dispatch capacity, the most
tokens any rank runs, and on whether every rank's step is a decode a captured graph serves. If so, all replay
the graph of the smallest captured size holding the capacity (an idle rank on dummy rows alone), its MoE
dispatch on fixed-size buffers; otherwise all run eagerly with that capacity (fixed-size buffers while small,
exchanged counts past that: the backend decides from the capacity alone, so alike on every rank).
A rank whose step fails (out of device memory included) raises RankFailedError: the others wait in that
step's collectives for it, so the group cannot go on (ep_serving ends it). After the step each rank's EPLB
balancer ticks (same step count and summed load on every rank, so they decide alike; rank 0's placement is
broadcast) and, when it rebalances, migrates weights between steps.

Launch: `init_distributed` reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT) or takes rank/world/init_method from a local launcher (deepinfer-serve spawning ranks).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.config import EngineConfig, ModelConfig
from deepinfer.engine.heap import refreeze
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.errors import ConfigError, DeepInferError, InvalidInputError
from deepinfer.model.checkpoint import Checkpoint
from deepinfer.model.moe import MoE
from deepinfer.moe.balancer import ExpertLoadBalancer, RebalanceEvent
from deepinfer.moe.placement import ModelPlacement
from deepinfer.moe.policy import EPLBConfig

logger = logging.getLogger(__name__)


class RankFailedError(DeepInferError, RuntimeError):
    """A rank's step failed: its peers wait in collectives it will not join, so the group cannot go on."""


TORCHRUN_VARS = ("RANK", "WORLD_SIZE")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the EP group. group: device collectives (the world group, gloo/nccl/hccl);
    cpu_group: gloo over the same ranks, for host-side flags, placements and Python objects."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group: Any
    cpu_group: Any

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def init_distributed(dist_backend: str, *, rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None, local_rank: int | None = None,
                     local_world_size: int | None = None, timeout_s: float = 600.0,
                     cpu_timeout_s: float | None = None) -> ParallelContext:
    """Join the process group. Without rank/world_size, torchrun's environment variables say them.

    cpu_timeout_s: the gloo CPU group's timeout (a serving follower waits there for work; default timeout_s).
    """
    env = os.environ
    if rank is None or world_size is None:
        if not launched_by_torchrun():
            raise ConfigError("expert parallelism needs rank and world size: launch with torchrun "
                              "(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) or let deepinfer-serve spawn the ranks")
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        init_method = init_method or "env://"
    local_rank = int(env.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size)) if local_world_size is None else local_world_size
    if not dist.is_initialized():
        dist.init_process_group(dist_backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    cpu_timeout = timedelta(seconds=cpu_timeout_s or timeout_s)
    cpu_group = group if dist_backend == "gloo" and cpu_timeout_s is None else dist.new_group(backend="gloo", timeout=cpu_timeout)
    return ParallelContext(rank, world_size, local_rank, local_world_size, group, cpu_group)


def shutdown_distributed(ctx: ParallelContext) -> None:
    """Leave the process group together: a rank tearing gloo down while a peer still finishes the last
    collective can abort the process. Close the rank's ExpertParallelEngine first (its graphs)."""
    if dist.is_initialized():
        dist.barrier(group=ctx.cpu_group)
        dist.destroy_process_group()


def _load_backend(engine_config: EngineConfig, local_rank: int):
    """The configured backend on this rank's device (device index = local rank off the CPU)."""
    from deepinfer.registry import load_backend

    options = {"batch_invariant": True} if engine_config.batch_invariant else {}
    backend = load_backend(engine_config.backend, **options)
    if backend.device.type != "cpu":
        device = torch.device(backend.device.type, local_rank)
        getattr(torch, device.type).set_device(device)
        backend = load_backend(engine_config.backend, device=str(device), **options)
    return backend


def dist_backend_for(engine_config: EngineConfig, local_rank: int = 0) -> str:
    """gloo on the CPU, else the backend's own collective library (nccl, hccl)."""
    backend = _load_backend(engine_config, local_rank)
    return "gloo" if backend.device.type == "cpu" else backend.capabilities.dist_backend


def moe_layers(model) -> dict[int, MoE]:
    """The model's MoE layers by layer index (MTP layers after the main ones)."""
    out = {}
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            out[layer.index] = layer.mlp
    for mtp in model.mtp:
        if isinstance(mtp.block.mlp, MoE):
            out[mtp.block.index] = mtp.block.mlp
    return out


class ExpertParallelEngine:
    """One rank's engine under expert parallelism; `step()` is collective (every rank calls it in turn)."""

    def __init__(self, engine: LLMEngine, ctx: ParallelContext, balancer: ExpertLoadBalancer | None = None):
        self.engine = engine
        self.ctx = ctx
        self.balancer = balancer
        self.steps = 0
        engine.idle_forward = self.idle_forward
        engine.runner.agree = self.agree
        engine.fail_step_on_oom = False  # step() turns the forward's error into RankFailedError

    def close(self) -> None:
        """Release the decode graphs (captured NCCL kernels on the group's communicator): call before
        shutdown_distributed, which would otherwise hang in destroying the group."""
        runner = self.engine.runner
        if runner.graphs is not None:
            runner.graphs.release()
            runner.graphs = None

    def agree(self, tokens: int, graphed: bool) -> tuple[int, bool]:
        """Collective: (the most tokens any rank runs this step, whether a graph serves every rank's step)."""
        if self.balancer is not None:
            self.balancer.recorder.set_rows(tokens)  # a padded graph's dummy rows are not load
        flags = torch.tensor([tokens, int(not graphed)], dtype=torch.int64)
        if self.ctx.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
        return int(flags[0]), not bool(flags[1])

    def idle_forward(self) -> None:
        """Enter the step's collectives with no tokens: the agreed graph on dummy rows, or every main-stack MoE
        layer's dispatch/combine in forward order."""
        capacity, graphed = self.agree(0, True)
        if capacity == 0:  # every rank is idle (overlapped steps resolving their last tokens): nothing to exchange
            return
        graphs = self.engine.runner.graphs
        size = graphs.size_for(capacity) if graphed and graphs is not None else None
        if size is not None:
            graphs.run_idle(size)
            return
        model = self.engine.model
        empty = torch.empty(0, model.config.hidden_size, dtype=model.embed_tokens.dtype, device=self.engine.backend.device)
        for layer in model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.forward(empty, capacity)

    def any_rank_has_work(self) -> bool:
        """Collective: whether any rank has unfinished requests."""
        flag = torch.tensor([int(self.engine.has_unfinished())], dtype=torch.int64)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
        return bool(flag.item())

    def step(self) -> list[RequestOutput] | None:
        """One lockstep step: this rank's outputs, or None when no rank had work (nothing ran anywhere)."""
        if not self.any_rank_has_work():
            return None
        try:
            outputs = self.engine.step()  # a forward of this rank's batch, or the idle forward
            self.steps += 1
            if self.balancer is not None:
                self._after_rebalance(self.balancer.after_step())
        except Exception as exc:
            # Out of memory included: one rank cannot fail only its own requests, since the others wait in
            # this step's collectives for it.
            raise RankFailedError(f"expert-parallel rank {self.ctx.rank} failed in step {self.steps + 1}: "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        return outputs

    def rebalance(self, load: torch.Tensor | None = None) -> RebalanceEvent:
        """Collective: EPLB's placement for `load` (default: the recorded window) now, on every rank."""
        event = self.balancer.rebalance(load)
        self._after_rebalance(event)
        return event

    def _after_rebalance(self, event: RebalanceEvent | None) -> None:
        """Experts moved in place (weights and routing tables kept their addresses) leave the decode graphs
        valid. Otherwise (a switch from or to the identity map) they point at the old placement: captured
        again, collectively (every rank rebalances at the same step)."""
        graphs = self.engine.runner.graphs
        if event is None or event.in_place or graphs is None:
            return
        graphs.release()
        graphs.capture()
        refreeze()
        self.balancer.recorder.discard_current()

    def run_until_done(self) -> dict[str, RequestOutput]:
        """Step until no rank has work; this rank's finished outputs by request id."""
        final: dict[str, RequestOutput] = {}
        while (outputs := self.step()) is not None:
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
        return final


def check_config(engine_config: EngineConfig, config: ModelConfig | None = None) -> ModelConfig:
    """What every rank would refuse, checked before anything starts (raises ConfigError); the model's config
    (`config` when given, else read from the folder engine_config.model)."""
    if engine_config.speculative_engine is not None:
        raise ConfigError("speculative decoding is not supported with expert parallelism yet "
                          "(every rank must run the same number of MoE forwards per step)")
    config = config or ModelConfig.from_hf_dir(Path(engine_config.model))
    if config.n_routed_experts is None:
        raise ConfigError("expert parallelism needs a MoE model (n_routed_experts is not set)")
    limit = config.max_position_embeddings
    if engine_config.max_model_len is not None and engine_config.max_model_len > limit:
        raise InvalidInputError(f"max_model_len must be at most {limit} (max_position_embeddings), got {engine_config.max_model_len}")
    world = engine_config.expert_parallel_size
    num_physical = config.n_routed_experts + engine_config.num_redundant_experts
    if num_physical % world:
        raise ConfigError(f"{config.n_routed_experts} experts + {engine_config.num_redundant_experts} redundant = "
                          f"{num_physical} slots do not split evenly over {world} ranks (--expert-parallel-size)")
    return config


def build_engine(engine_config: EngineConfig, ctx: ParallelContext, *, eplb_check_interval: int = 50,
                 checkpoint: Checkpoint | None = None, config: ModelConfig | None = None) -> ExpertParallelEngine:
    """Load this rank's share of the model and its engine. Collective on GPUs (every rank builds at once): the
    memory profile's step and the decode graphs' captures run the MoE all-to-alls.

    checkpoint, config: load from this checkpoint (e.g. a TensorDictCheckpoint of tensors already in memory)
    with its ModelConfig instead of the folder engine_config.model (then only a name; no tokenizer).
    """
    from deepinfer.model.loader import load_model

    if engine_config.expert_parallel_size != ctx.world_size:
        raise ConfigError(f"expert_parallel_size {engine_config.expert_parallel_size} does not match the "
                          f"{ctx.world_size} ranks of the process group")
    if checkpoint is not None and config is None:
        raise ConfigError("loading from a checkpoint object needs its ModelConfig (config=)")
    config = check_config(engine_config, config)
    path = Path(engine_config.model)
    max_model_len = engine_config.max_model_len or config.max_position_embeddings
    num_physical = config.n_routed_experts + engine_config.num_redundant_experts
    backend = _load_backend(engine_config, ctx.local_rank)
    if backend.device.type == "cpu" and engine_config.kv_cache_memory is None:
        # The local ranks share the host's memory: each takes its part of the fraction.
        share = engine_config.kv_cache_fraction / ctx.local_world_size
        engine_config = engine_config.model_copy(update={"kv_cache_fraction": share})
    with_mtp = engine_config.load_mtp and config.num_nextn_predict_layers > 0
    layer_ids = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    layer_ids += list(config.mtp_layer_ids) if with_mtp else []
    placement = ModelPlacement.initial(layer_ids, config.n_routed_experts, num_physical, config.n_group,
                                       ctx.num_nodes, ctx.world_size)
    placements = {i: placement.layer(i, ctx.rank, backend.device) for i in layer_ids}
    dtype = _DTYPES.get(engine_config.dtype) if engine_config.dtype else None
    source = path if checkpoint is None else checkpoint
    model = load_model(source, backend, config=config, precision=engine_config.precision, dtype=dtype,
                       max_positions=max_model_len, load_mtp=engine_config.load_mtp,
                       progress=engine_config.progress and ctx.rank == 0, placements=placements, ep_group=ctx.group)
    tokenizer = None
    if checkpoint is None and (path / "tokenizer.json").exists():
        from deepinfer.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_folder(path)
    layers = moe_layers(model)
    placement = placement.subset([i for i in layer_ids if i in layers])  # MTP layers only if the checkpoint has them
    balancer = None
    if engine_config.enable_eplb:  # before the engine: its decode graphs then capture the load recording
        eplb = EPLBConfig(window_size=engine_config.eplb_window_size, step_interval=engine_config.eplb_step_interval,
                          imbalance_threshold=engine_config.eplb_imbalance_threshold, check_interval=eplb_check_interval,
                          num_redundant_experts=engine_config.num_redundant_experts)
        balancer = ExpertLoadBalancer(backend, layers, placement, eplb, rank=ctx.rank, num_nodes=ctx.num_nodes,
                                      num_groups=config.n_group, group=ctx.group, cpu_group=ctx.cpu_group)
    engine = LLMEngine(model, backend, engine_config, tokenizer, max_model_len)
    if balancer is not None:
        balancer.recorder.discard_current()  # the memory profile's and the graph captures' forwards
    logger.info("rank %d/%d: %d MoE layers, %d expert slots per rank (%d redundant)%s", ctx.rank, ctx.world_size,
                len(layer_ids), num_physical // ctx.world_size, engine_config.num_redundant_experts,
                ", EPLB on" if balancer else "")
    return ExpertParallelEngine(engine, ctx, balancer)
