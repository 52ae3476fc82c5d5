"""Load a HF DeepSeek checkpoint into a DeepseekModel, streaming one tensor at a time.

Each tensor is converted to its final format (FP8 kept, dequantised or quantised per `precision`) on
arrival; a layer is built as soon as its last tensor arrives, so at most one layer's raw tensors exist
beside the converted model.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend import Backend
from deepinfer.config import ModelConfig
from deepinfer.errors import ConfigError
from deepinfer.model.checkpoint import Checkpoint, TensorSpec, expected_tensors, optional_tensors
from deepinfer.model.deepseek import DecoderLayer, DeepseekModel, MTPLayer
from deepinfer.moe.placement import ExpertPlacement
from deepinfer.quant import FP8_DTYPE
from deepinfer.weights import LinearWeight, WeightFormat

PRECISIONS = ("bf16", "fp8", "fp4")
SCALE_SUFFIX = "_scale_inv"  # "x.weight" is dequantised by "x.weight_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class WeightPolicy:
    """How each checkpoint tensor becomes a model weight.

    precision None keeps the checkpoint's format (FP8 stays FP8 where the backend has FP8 GEMMs);
    "bf16" dequantises everything to `dtype`; "fp8" / "fp4" quantise projections at load time.
    """

    dtype: torch.dtype
    device: torch.device
    precision: str | None
    backend_formats: frozenset[str]

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        need = {"fp8": "fp8_e4m3", "fp4": "nvfp4"}.get(self.precision or "")
        if need and need not in self.backend_formats:
            raise ConfigError(f"precision {self.precision!r} needs {need} weights, which this backend lacks")

    def projection(self, weight: torch.Tensor, scale_inv: torch.Tensor | None) -> LinearWeight:
        if weight.dtype == FP8_DTYPE:
            if self.precision in (None, "fp8") and "fp8_e4m3" in self.backend_formats:
                return LinearWeight.fp8_block(weight, scale_inv).to(self.device)
            weight = LinearWeight.fp8_block(weight, scale_inv).dequantize()
        weight = weight.to(self.device)
        if self.precision == "fp8":
            return LinearWeight.quantize(weight, WeightFormat.FP8_BLOCK)
        if self.precision == "fp4":
            return LinearWeight.quantize(weight, WeightFormat.NVFP4)
        return LinearWeight.dense(weight.to(self.dtype))

    def plain(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # The router and its correction bias stay float32: expert choice hinges on small score gaps.
        keep_fp32 = name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")
        return tensor.to(device=self.device, dtype=torch.float32 if keep_fp32 else self.dtype)


def default_dtype(config: ModelConfig) -> torch.dtype:
    name = (config.dtype or "bfloat16").removeprefix("torch.")
    return {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16)


def load_model(
    path: str | Path | Checkpoint,
    backend: Backend,
    *,
    config: ModelConfig | None = None,
    precision: str | None = None,
    dtype: torch.dtype | None = None,
    max_positions: int | None = None,
    load_mtp: bool = True,
    progress: bool = True,
    placements: Mapping[int, ExpertPlacement] | None = None,
    ep_group: Any = None,
) -> DeepseekModel:
    """placements: expert parallelism, this rank's slot map per MoE layer index (MTP layers included); only
    the experts those slots hold are read. ep_group: the process group their dispatch/combine run on."""
    if isinstance(path, Checkpoint):  # e.g. a TensorDictCheckpoint of tensors already in memory
        ckpt = path
        if config is None:
            raise ConfigError("loading from an in-memory checkpoint needs its ModelConfig")
    else:
        ckpt = Checkpoint(path)
    config = config or ModelConfig.from_hf_dir(path)
    policy = WeightPolicy(dtype or default_dtype(config), backend.device, precision, backend.capabilities.weight_formats)
    with_mtp = load_mtp and config.num_nextn_predict_layers > 0 and ckpt.has_mtp_weights(config)
    expected = expected_tensors(config, include_mtp=with_mtp)
    n_main = config.num_hidden_layers
    ckpt.validate(expected, optional=optional_tensors(config, with_mtp))
    if placements is not None:
        expected = _local_experts_only(expected, placements)
    cos_sin_cache = config.rope_spec().cos_sin_cache(max_positions or config.max_position_embeddings, backend.device)

    remaining: dict[int, int] = defaultdict(int)
    for name in expected:
        m = _LAYER.match(name)
        if m:
            remaining[int(m.group(1))] += 1
    pending: dict[int, dict] = defaultdict(dict)
    top: dict = {}
    built: dict[int, DecoderLayer | MTPLayer] = {}
    held_fp8: dict[str, torch.Tensor] = {}  # an FP8 weight or its scale, waiting for the other half

    def place(name: str, value) -> None:
        m = _LAYER.match(name)
        if not m:
            top[name] = value
            return
        index, local = int(m.group(1)), m.group(2)
        pending[index][local] = value
        remaining[index] -= 1
        if remaining[index] == 0:
            weights = pending.pop(index)
            cls = DecoderLayer if index < n_main else MTPLayer
            placement = None if placements is None else placements.get(index)
            built[index] = cls(backend, config, index, weights, cos_sin_cache, placement, ep_group)

    to_read = [n for n in ckpt.names() if n in expected or n.removesuffix(SCALE_SUFFIX) in expected]
    for name, tensor in ckpt.iter_tensors(to_read, progress=progress):
        if name.endswith(SCALE_SUFFIX):
            weight_name = name.removesuffix(SCALE_SUFFIX)
            if weight_name not in held_fp8:
                held_fp8[name] = tensor
                continue
            place(weight_name, policy.projection(held_fp8.pop(weight_name), tensor))
            continue
        spec: TensorSpec = expected[name]
        if spec.quantizable:
            if tensor.dtype == FP8_DTYPE:
                scale = held_fp8.pop(name + SCALE_SUFFIX, None)
                if scale is None:
                    held_fp8[name] = tensor
                    continue
                place(name, policy.projection(tensor, scale))
            else:
                place(name, policy.projection(tensor, None))
        else:
            place(name, policy.plain(name, tensor))

    layers = [built[i] for i in range(n_main)]
    mtp = [built[i] for i in range(n_main, n_main + (config.num_nextn_predict_layers if with_mtp else 0))]
    return DeepseekModel(backend, config, top, layers, mtp)


def _local_experts_only(expected: dict[str, TensorSpec], placements: Mapping[int, ExpertPlacement]) -> dict[str, TensorSpec]:
    """Drop the routed-expert tensors of experts this rank holds no slot of (they are never read)."""
    held = {index: set(p.local_experts) for index, p in placements.items()}
    keep = {}
    for name, spec in expected.items():
        m = _EXPERT.match(name)
        if m and int(m.group(1)) in held and int(m.group(2)) not in held[int(m.group(1))]:
            continue
        keep[name] = spec
    return keep
