"""ModelConfig: a DeepSeek V2/V3 (R1) model's configuration, read from a Hugging Face `config.json`.

Both config layouts are accepted: the classic one of DeepSeek's own checkpoints (`rope_theta` +
`rope_scaling` with key `type`) and transformers 5's (`rope_parameters` holding `rope_theta` and
`rope_type`). Keys this engine does not use are ignored; values it cannot run fail with a ConfigError
naming the field and the value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deepinfer.errors import ConfigError
from deepinfer.ops.rope import RopeSpec, YarnScaling
from deepinfer.ops.routing import RoutingSpec

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ROPE_TYPES = ("default", "yarn")
# Per model type: the gate methods and scoring functions transformers' (and DeepSeek's) code implements.
TOPK_METHODS_BY_MODEL = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}
SCORING_FUNC_BY_MODEL = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}
NORM_TOPK_PROB_DEFAULT = {"deepseek_v2": False, "deepseek_v3": True}
FP8_WEIGHT_BLOCK = (128, 128)


class YarnRopeConfig(BaseModel):
    """YaRN parameters (DeepSeek's rope_scaling); defaults follow transformers' yarn implementation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    factor: float = Field(ge=1.0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = Field(default=32.0, gt=0)
    beta_slow: float = Field(default=1.0, gt=0)
    mscale: float = Field(default=1.0, ge=0)
    mscale_all_dim: float = Field(default=0.0, ge=0)
    truncate: bool = True


class FP8QuantConfig(BaseModel):
    """DeepSeek-V3's FP8 checkpoint format: float8_e4m3fn weights, one fp32 scale_inv per 128x128 block."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    quant_method: Literal["fp8"] = "fp8"
    fmt: Literal["e4m3"] = "e4m3"
    weight_block_size: tuple[int, int] = FP8_WEIGHT_BLOCK
    activation_scheme: Literal["dynamic"] = "dynamic"

    @field_validator("weight_block_size")
    @classmethod
    def _block_is_128(cls, value: tuple[int, int]) -> tuple[int, int]:
        if tuple(value) != FP8_WEIGHT_BLOCK:
            raise ValueError(f"only {list(FP8_WEIGHT_BLOCK)} is supported, got {list(value)}")
        return value


class ModelConfig(BaseModel):
    """What the model code needs to build a DeepSeek V2/V3 network; immutable once validated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: Literal["deepseek_v2", "deepseek_v3"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu"] = "silu"
    attention_bias: Literal[False] = False
    mlp_bias: Literal[False] = False

    # Multi-head latent attention.
    q_lora_rank: int | None = Field(default=None, gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)

    # Rotary embedding: rope_scaling None means plain RoPE.
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: YarnRopeConfig | None = None
    rope_interleave: bool = True

    # Mixture of experts (n_routed_experts None: every layer is a dense MLP).
    n_routed_experts: int | None = Field(default=None, gt=0)
    moe_intermediate_size: int | None = Field(default=None, gt=0)
    n_shared_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int | None = Field(default=None, gt=0)
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    first_k_dense_replace: int = Field(default=0, ge=0)
    moe_layer_freq: int = Field(default=1, gt=0)

    num_nextn_predict_layers: int = Field(default=0, ge=0)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None  # the checkpoint's dtype as the config states it; informational only
    quantization_config: FP8QuantConfig | None = None

    def __init__(self, **data: Any) -> None:
        # Surface pydantic's ValidationError as the engine's typed ConfigError.
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(_describe_validation_error(err, data.get("model_type"))) from None

    # ----- construction from Hugging Face files -----

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"no config.json in {Path(path)}")
        try:
            data = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read {config_path}: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{config_path} does not hold a JSON object")
        return cls.from_hf_dict(data)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}")
        fields = {name: hf[name] for name in cls.model_fields if name in hf and name not in _DERIVED_FIELDS}
        rope_theta, rope_scaling = _read_rope(hf)
        fields.update(rope_theta=rope_theta, rope_scaling=rope_scaling)
        # HF configs write null for "not used"; map those onto this class's meaning.
        for name in ("n_group", "topk_group"):
            if fields.get(name) is None:
                fields.pop(name, None)  # V2 leaves groups null: one group
        if fields.get("n_shared_experts") is None:
            fields.pop("n_shared_experts", None)
        if fields.get("rope_interleave") is None:
            fields.pop("rope_interleave", None)
        for name in ("first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "routed_scaling_factor"):
            if name in fields and fields[name] is None:
                fields.pop(name)
        fields.setdefault("topk_method", TOPK_METHODS_BY_MODEL[model_type][0])
        fields.setdefault("scoring_func", SCORING_FUNC_BY_MODEL[model_type])
        if fields.get("norm_topk_prob") is None:
            fields["norm_topk_prob"] = NORM_TOPK_PROB_DEFAULT[model_type]
        # transformers 5 writes `dtype`; older configs `torch_dtype`.
        dtype = hf.get("dtype") or hf.get("torch_dtype")
        fields["dtype"] = None if dtype is None else str(dtype)
        quant = hf.get("quantization_config")
        if quant is not None:
            fields["quantization_config"] = _read_quantization(quant)
        return cls(**fields)

    # ----- consistency -----

    @model_validator(mode="after")
    def _check_consistency(self) -> ModelConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.model_type == "deepseek_v2" and not self.rope_interleave:
            raise ValueError("rope_interleave=False is not supported for deepseek_v2 (its rotary layout is interleaved)")
        methods = TOPK_METHODS_BY_MODEL[self.model_type]
        if self.topk_method not in methods:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported for {self.model_type}; supported: {list(methods)}")
        scoring = SCORING_FUNC_BY_MODEL[self.model_type]
        if self.scoring_func != scoring:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported for {self.model_type}; supported: {scoring!r}")
        if self.n_routed_experts is not None:
            self._check_moe()
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        if any(t is not None and t < 0 for t in eos) or (self.bos_token_id is not None and self.bos_token_id < 0):
            raise ValueError(f"bos/eos token ids must be non-negative, got {self.bos_token_id} / {self.eos_token_id}")
        return self

    def _check_moe(self) -> None:
        experts = self.n_routed_experts
        if self.moe_intermediate_size is None:
            raise ValueError("moe_intermediate_size is required when n_routed_experts is set")
        if self.num_experts_per_tok is None:
            raise ValueError("num_experts_per_tok is required when n_routed_experts is set")
        if self.num_experts_per_tok > experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts {experts}")
        if experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} does not divide n_routed_experts {experts}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} exceeds n_group {self.n_group}")
        grouped = self.topk_method in ("noaux_tc", "group_limited_greedy") and self.n_group > 1
        if grouped and self.num_experts_per_tok > self.topk_group * (experts // self.n_group):
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds the {self.topk_group * (experts // self.n_group)} "
                f"experts in topk_group={self.topk_group} groups of {experts // self.n_group}"
            )
        if self.topk_method == "noaux_tc" and self.n_group > 1 and experts // self.n_group < 2:
            raise ValueError(f"noaux_tc ranks groups by their top-2 experts: n_group {self.n_group} leaves fewer than 2 per group")

    # ----- derived values -----

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_fp8_checkpoint(self) -> bool:
        return self.quantization_config is not None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)

    @property
    def mtp_layer_ids(self) -> range:
        """Indices of the MTP layers: they follow the main stack, `model.layers.{num_hidden_layers + k}`."""
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    def is_moe_layer(self, layer_id: int) -> bool:
        """DeepSeek's rule; note transformers' modelling ignores moe_layer_freq (treats it as 1)."""
        return (
            self.n_routed_experts is not None
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    def rope_spec(self) -> RopeSpec:
        yarn = None
        if self.rope_scaling is not None:
            s = self.rope_scaling
            yarn = YarnScaling(
                factor=s.factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
                beta_fast=s.beta_fast,
                beta_slow=s.beta_slow,
                mscale=s.mscale,
                mscale_all_dim=s.mscale_all_dim,
                truncate=s.truncate,
            )
        interleaved = True if self.model_type == "deepseek_v2" else self.rope_interleave
        return RopeSpec(dim=self.qk_rope_head_dim, theta=self.rope_theta, interleaved=interleaved, yarn=yarn)

    @property
    def softmax_scale(self) -> float:
        """Attention logits' scale: qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2."""
        return self.qk_head_dim**-0.5 * self.rope_spec().softmax_mscale

    def routing_spec(self) -> RoutingSpec:
        if self.n_routed_experts is None or self.num_experts_per_tok is None:
            raise ConfigError("this model has no routed experts (n_routed_experts is not set)")
        return RoutingSpec(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            scoring_func=self.scoring_func,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


# Fields filled by from_hf_dict's own readers, never copied straight from the HF dict.
_DERIVED_FIELDS = frozenset({"rope_theta", "rope_scaling", "dtype", "quantization_config"})


def _read_rope(hf: dict[str, Any]) -> tuple[Any, YarnRopeConfig | None]:
    """(rope_theta, YaRN parameters or None) from either `rope_parameters` or `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = hf.get("rope_scaling"), "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{field} must be a JSON object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{field} nested per layer type is not supported, got keys {sorted(params)}")
    theta = params.get("rope_theta")
    if theta is None:
        theta = hf.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{field}.rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{field}.partial_rotary_factor {params['partial_rotary_factor']!r} is not supported (only 1.0)")
    if rope_type == "default":
        return theta, None
    if params.get("attention_factor") is not None:
        raise ConfigError(
            f"{field}.attention_factor {params['attention_factor']!r} is not supported: "
            "DeepSeek derives it from factor, mscale and mscale_all_dim"
        )
    # Same fallbacks as transformers' yarn: original length defaults to max_position_embeddings, factor to their
    # ratio, and a zero/null beta to 32 / 1.
    original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and original:
        factor = hf.get("max_position_embeddings", original) / original
    yarn = {
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": params.get("beta_fast") or 32.0,
        "beta_slow": params.get("beta_slow") or 1.0,
        "mscale": 1.0 if params.get("mscale") is None else params["mscale"],
        "mscale_all_dim": params.get("mscale_all_dim") or 0.0,
        "truncate": True if params.get("truncate") is None else params["truncate"],
    }
    try:
        return theta, YarnRopeConfig(**yarn)
    except ValidationError as err:
        raise ConfigError(_describe_validation_error(err, hf.get("model_type"), prefix=f"{field}.")) from None


def _read_quantization(quant: Any) -> FP8QuantConfig:
    if not isinstance(quant, dict):
        raise ConfigError(f"quantization_config must be a JSON object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported; supported: ['fp8'] (128x128 blocks)")
    known = {k: quant[k] for k in FP8QuantConfig.model_fields if quant.get(k) is not None}
    try:
        return FP8QuantConfig(**known)
    except ValidationError as err:
        raise ConfigError(_describe_validation_error(err, None, prefix="quantization_config.")) from None


def _describe_validation_error(err: ValidationError, model_type: Any, prefix: str = "") -> str:
    """One line per problem, each naming the field and the offending value."""
    lines = []
    for e in err.errors():
        where = prefix + ".".join(str(p) for p in e["loc"])
        if e["type"] == "value_error":
            # Our own model validators: their message already names the fields.
            lines.append(f"{where + ': ' if where else ''}{e['ctx']['error']}")
        elif e["type"] == "missing":
            lines.append(f"{where}: required field is missing")
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    head = f"invalid {model_type} config" if model_type else "invalid config"
    return f"{head}: " + "; ".join(lines)


class EngineConfig(BaseModel):
    """How the engine runs a model: backend, precision, batch limits and the paged latent cache's size.

    The cache holds `kv_cache_memory` bytes when set, else `kv_cache_fraction` of the device's free memory
    after the weights are loaded (of available host memory on the CPU), less what the largest step
    (a max_num_batched_tokens chunk ending a max_model_len sequence) was measured to allocate on a GPU.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    backend: str | None = None
    precision: Literal["bf16", "fp8", "fp4"] | None = None
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    max_model_len: int | None = Field(default=None, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int = Field(default=4096, gt=0)
    block_size: int = Field(default=64, gt=0)
    kv_cache_memory: int | None = Field(default=None, gt=0)
    kv_cache_fraction: float = Field(default=0.9, gt=0, le=1)
    kv_cache_dtype: Literal["bf16", "fp16", "fp32", "fp8_e4m3"] | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    batch_invariant: bool = False
    # CUDA graphs for decode steps (backends that capture graphs, on a GPU): batch sizes 1, 2, 4, 8 and
    # multiples of 16 up to this (and max_num_seqs); larger batches and prefill run eagerly.
    enforce_eager: bool = False
    # Schedule and launch step N+1 while step N's sampled tokens are still on their way to the host
    # (deepinfer.engine.overlap); steps that need them first (penalties, logprobs, speculation) still wait.
    overlap_scheduling: bool = True
    cuda_graph_max_batch_size: int = Field(default=256, gt=0)
    load_mtp: bool = True
    progress: bool = True
    # Expert parallelism (one engine per rank: deepinfer.engine.expert_parallel) and EPLB.
    expert_parallel_size: int = Field(default=1, gt=0)
    enable_eplb: bool = False
    eplb_window_size: int = Field(default=1000, gt=0)  # engine steps of expert load the balancer looks at
    eplb_step_interval: int = Field(default=3000, ge=0)  # rebalance every this many steps (0: only on imbalance)
    eplb_imbalance_threshold: float | None = Field(default=None, ge=1.0)  # and when busiest/mean GPU load exceeds it
    num_redundant_experts: int = Field(default=0, ge=0)  # extra physical expert slots for replicas of hot experts
    # Speculative decoding (deepinfer.spec): the checkpoint's MTP module chained for num_speculative_tokens
    # (default 1), or the DSpark drafter in dspark_model (default <model>/dspark; block of
    # num_speculative_tokens, default its own). DSpark verifies while the calibrated survival stays above
    # dspark_confidence_threshold when set (0: the whole block), else by the hardware-aware prefix scheduler
    # over an SPS curve profiled at start-up and cached in speculative_sps_cache ("off": never cached), or
    # given as (tokens, seconds per step) points in speculative_sps_table.
    speculative_engine: Literal["mtp", "dspark"] | None = None
    num_speculative_tokens: int | None = Field(default=None, gt=0)
    dspark_confidence_threshold: float | None = Field(default=None, ge=0, le=1)
    dspark_model: str | None = None
    speculative_sps_cache: str | None = None
    speculative_sps_table: tuple[tuple[int, float], ...] | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(_describe_validation_error(err, None, prefix="engine.")) from None

    @model_validator(mode="after")
    def _speculation_options(self) -> EngineConfig:
        if self.speculative_engine != "dspark":
            for name in ("dspark_confidence_threshold", "dspark_model"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs speculative_engine='dspark' (got {self.speculative_engine!r})")
        if self.speculative_engine is None and self.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens needs a speculative_engine ('mtp' or 'dspark')")
        if self.speculative_engine == "mtp" and not self.load_mtp:
            raise ValueError("speculative_engine='mtp' drafts with the checkpoint's MTP layer: load_mtp must be True")
        return self

    @model_validator(mode="after")
    def _eplb_options(self) -> EngineConfig:
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb (the balancer places the replicas)")
        if self.enable_eplb and self.expert_parallel_size < 2:
            raise ValueError("enable_eplb balances experts across ranks: it needs expert_parallel_size >= 2")
        if self.enable_eplb and self.eplb_step_interval == 0 and self.eplb_imbalance_threshold is None:
            raise ValueError("enable_eplb needs a trigger: eplb_step_interval > 0 or an eplb_imbalance_threshold")
        return self
