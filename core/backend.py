"""The backend contract: what a device backend implements for the backend-neutral core.

A backend provides attention over the paged latent cache (plan once per step, then write_cache and
run_attention per layer), GEMMs (linear, grouped_linear over experts) and communication (dispatch,
combine, all_reduce). Small fused ops (rms_norm, rope, silu_and_mul, routing, activation quantisation)
live in `deepinfer.ops.FusedOps`; a backend overrides the ones it accelerates by returning a subclass
from `ops`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from deepinfer.attention import AttentionBatch, AttentionPlan, KVCacheSpec
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError
from deepinfer.ops import ExpertLayout, ExpertSum, FusedOps
from deepinfer.quant import Fp8Activations
from deepinfer.weights import LinearWeight

T = TypeVar("T")


def check_per_head(x: object, weight: object) -> None:
    """per_head_linear's inputs: x [T, H, K] float, weight a stacked [H, N, K] LinearWeight on x's device."""
    if not isinstance(weight, LinearWeight) or weight.data.dim() != 3:
        raise InvalidInputError("per-head weight must be a stacked [H, N, K] LinearWeight")
    check_tensor("x", x, ndim=3, shape=[None, weight.num_groups, weight.in_features], dtypes=FLOAT_DTYPES,
                 device=weight.device)


@dataclass(frozen=True)
class Probe:
    """Answer to "can this backend run here?"; `reason` says why not (or what it found)."""

    usable: bool
    reason: str
    device: str = ""


@dataclass(frozen=True)
class Capabilities:
    weight_formats: frozenset[str]  # "bf16", "fp8_e4m3", "nvfp4"
    kv_cache_dtypes: frozenset[str]  # "bf16", "fp32", "fp8_e4m3", ...
    graph_capture: bool
    dist_backend: str  # torch.distributed backend name: gloo / nccl / hccl
    # Steps of long prompt chunks run MLA decompressed (keys and values rebuilt from the latent cache, then
    # dense attention) where that beats the absorbed kernel; see deepinfer.model.mla.
    decompressed_prefill: bool = False

    def describe(self) -> str:
        return (
            f"weights={','.join(sorted(self.weight_formats))} kv={','.join(sorted(self.kv_cache_dtypes))} "
            f"graphs={'yes' if self.graph_capture else 'no'} dist={self.dist_backend}"
        )


class Pending(Generic[T]):
    """A result that may still be in flight (an async collective); `wait()` returns it.

    Callers start dispatch/combine, do independent work (shared experts), then wait.
    """

    def __init__(self, finish: Callable[[], T], works: tuple[Any, ...] = ()):
        self._finish = finish
        self._works = works
        self._value: T | None = None
        self._done = False

    @classmethod
    def ready(cls, value: T) -> Pending[T]:
        return cls(lambda: value)

    def wait(self) -> T:
        if not self._done:
            for work in self._works:
                work.wait()
            self._value = self._finish()
            self._done = True
        return self._value  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class Dispatched:
    """Tokens delivered to this rank's experts by `dispatch`.

    hidden [R, H]: one row per (token, chosen local expert) pair, sorted by local expert;
    group_sizes [num_local_experts] int64: rows per local expert (the grouped GEMM's contiguous layout);
    first_expert: global id of local expert 0. `state` is the backend's bookkeeping for `combine`.
    hidden_is_input: hidden is a view of dispatch's x itself (no copy), so its rows were written when x was.
    """

    hidden: torch.Tensor
    group_sizes: torch.Tensor
    first_expert: int
    state: Any = field(repr=False, default=None)
    hidden_is_input: bool = False


class Backend(ABC):
    """A device backend. Construct with `device=None` for the backend's default device."""

    name: ClassVar[str]
    CAPABILITIES: ClassVar[Capabilities]  # what the backend can do at best; listed without instantiating

    @classmethod
    @abstractmethod
    def probe(cls) -> Probe:
        """Can this backend run here? Never raises; cheap (no kernel compilation)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    def capabilities(self) -> Capabilities:
        """What this instance can do on its device (a backend may narrow CAPABILITIES, e.g. by GPU generation)."""
        return type(self).CAPABILITIES

    @property
    def ops(self) -> FusedOps:
        """Small fused ops; the reference defaults unless the backend accelerates some."""
        return FusedOps()

    # --- attention over the paged latent cache -------------------------------------------------
    @abstractmethod
    def allocate_kv_cache(self, spec: KVCacheSpec) -> torch.Tensor:
        """One layer's cache tensor of shape spec.shape and dtype spec.torch_dtype on this device."""

    @abstractmethod
    def plan_attention(self, batch: AttentionBatch, spec: KVCacheSpec) -> AttentionPlan:
        """Host work once per step: validate the batch and build the device metadata all layers reuse.

        A backend advertising `graph_capture` also takes keyword arguments `max_seq_len` (a plan whose
        buffers hold sequences growing up to that length, to capture in a CUDA graph) and `into` (rewrite
        such a plan's device tensors in place for a later step with the same query lengths)."""

    @abstractmethod
    def write_cache(self, plan: AttentionPlan, cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store this step's tokens: c_kv [T, kv_lora_rank] (normalised latent), k_pe [T, rope_dim] (roped)."""

    @abstractmethod
    def run_attention(
        self,
        plan: AttentionPlan,
        cache: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        softmax_scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Absorbed MLA: q_nope [T, H, kv_lora_rank] (W_UK folded in), q_pe [T, H, rope_dim] (roped).

        Each query attends causally over its sequence's cache; returns out [T, H, kv_lora_rank] in
        q_nope's dtype (W_UV not applied), and with return_lse the log-sum-exp [T, H] in float32.
        """

    def rope_norm_and_write_cache(self, plan: AttentionPlan, cache: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                                  kv_norm_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor,
                                  interleaved: bool, *, validate: bool = True) -> torch.Tensor:
        """MLA's cache update with its ropes, at the plan's positions: c_kv = RMSNorm(kv[:, :R]) and the roped
        k_pe = kv[:, R:] stored as write_cache stores them, and q_pe [T, H, rope] roped (returned). By default
        ops.mla_rope_and_norm, then write_cache; a backend may do both in one launch. validate=False skips
        the positions' range check (a read-back) for callers that checked them on the host."""
        q_pe, c_kv, k_pe = self.ops.mla_rope_and_norm(q_pe, kv, kv_norm_weight, eps, plan.positions, cos_sin_cache,
                                                      interleaved, validate=validate)
        self.write_cache(plan, cache, c_kv, k_pe)
        return q_pe

    # --- GEMM -----------------------------------------------------------------------------------
    @abstractmethod
    def linear(self, x: torch.Tensor | Fp8Activations, weight: LinearWeight) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] in x's dtype (FP8 weights: x quantised per token per 128 channels). For
        an fp8_block weight x may come quantised already (Fp8Activations, e.g. from ops.add_rms_norm(...,
        quantize=True)): the result is then what the unquantised x would give."""

    @abstractmethod
    def grouped_linear(self, x: torch.Tensor, weight: LinearWeight, group_sizes: torch.Tensor, *,
                       validate: bool = True, sizes_settled: bool = False) -> torch.Tensor:
        """Rows of x [M, K] sorted by group; group g's rows (group_sizes[g] of them) use weight[g] [N, K].

        validate=False skips checking the sizes' values, a read-back that stalls the host behind queued GPU
        work (and is illegal in graph capture), for callers that produced them (the model, from dispatch).
        sizes_settled: an earlier launch on this stream already read group_sizes (an MLP's down projection after
        its gate/up): their writer is then at least two launches back, and a backend whose kernels start before
        their predecessor ends (programmatic dependent launch) may read them, and fetch the groups' weights,
        before waiting for x."""

    def gated_linear(self, x: torch.Tensor, gate_up: LinearWeight, group_sizes: torch.Tensor | None = None, *,
                     validate: bool = True, settled_tail: int = 0) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T) for a [.., 2I, K] gate/up weight (the first half of a gated MLP),
        -> [M, I]; with group_sizes, grouped as grouped_linear. By default the projection then
        ops.silu_and_mul; a backend may fuse the two.
        settled_tail (grouped): the last settled_tail rows of x are one row each of the last settled_tail groups
        (one token's always-chosen shared-expert slices), and x was written at least two launches back on this
        stream: a backend whose kernels start before their predecessor ends (programmatic dependent launch) may
        compute those rows before waiting for the group sizes' writer."""
        if group_sizes is None:
            return self.ops.silu_and_mul(self.linear(x, gate_up))
        return self.ops.silu_and_mul(self.grouped_linear(x, gate_up, group_sizes, validate=validate))

    def per_head_linear(self, x: torch.Tensor, weight: LinearWeight, *, quantize: bool = False
                        ) -> torch.Tensor | Fp8Activations:
        """x [T, H, K] @ weight[h]^T for each head h (weight stacked [H, N, K]) -> [T, H, N] in x's dtype: MLA's
        absorbed projections. quantize (the rows feed an FP8 projection): the rows [T, H * N] as Fp8Activations,
        or, where this backend's linear would quantise them itself to the same bits, the plain rows; callers
        hand either to linear.
        By default a grouped_linear with heads as groups, with transposed copies around it; a backend may read
        and write the per-token layout in place."""
        check_per_head(x, weight)
        t, h, k = x.shape
        # Made per call (one small fill): a cached tensor that a later shape evicts would dangle in a CUDA graph.
        sizes = torch.full((h,), t, dtype=torch.int64, device=x.device)
        out = self.grouped_linear(x.transpose(0, 1).reshape(h * t, k), weight, sizes, validate=False)
        out = out.view(h, t, -1).transpose(0, 1)
        if quantize:
            return Fp8Activations(*self.ops.quantize_fp8_per_token_group(out.reshape(t, -1)), x.dtype)
        return out

    # --- communication --------------------------------------------------------------------------
    @abstractmethod
    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
        group: Any = None,
        *,
        validate: bool = True,
        capacity: int | None = None,
        layout: ExpertLayout | None = None,
    ) -> Pending[Dispatched]:
        """Send each token to the ranks owning its chosen experts (experts split evenly, in order).
        validate=False skips the range check of topk_ids (a read-back), for ids from the model's router.
        capacity: a bound on every rank's token count that all ranks of the group pass alike (expert
        parallelism); a backend may then use fixed-size buffers instead of exchanging counts, with no host
        synchronisation (CUDA-graph capturable). Dispatched.hidden may then hold padding rows past the sum of
        group_sizes, which the grouped GEMMs skip.
        layout: these choices' layout from FusedOps.route_sorted (one process): a backend may lay the rows out
        from it instead of sorting; Dispatched.hidden may then be a view of x (one token: every row is it)."""

    @abstractmethod
    def combine(self, dispatched: Dispatched, expert_out: torch.Tensor, add: torch.Tensor | None = None, *,
                defer: bool = False) -> Pending[torch.Tensor | ExpertSum]:
        """Return expert outputs [R, H] to their tokens' ranks: out[t] = sum_k weight[t, k] * y[t, k], plus
        add[t] when given ([T, H], the shared experts' output), in the same float32 sum (no separate add).
        defer (the caller hands the result to ops.add_rms_norm and nothing else): where the combine is a local
        gather, a backend may return it unformed, as an ExpertSum, for that op to form in its own launch."""

    @abstractmethod
    def all_reduce(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Sum x over the ranks of `group` in place (identity in a single process) and return it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"
