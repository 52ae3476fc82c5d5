"""Hugging Face safetensors checkpoints: which tensors a DeepSeek model needs, and streaming them off disk.

`Checkpoint` reads only the shards' JSON headers up front (names, shapes, dtypes, and whether each file is as
long as its header says), so validation is cheap; tensor data is read one tensor at a time by `iter_tensors`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from deepinfer.config import ModelConfig
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.quant import FP8_BLOCK, FP8_DTYPE, cdiv

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "weight_scale_inv"
# safetensors refuses headers above 100 MB; a larger length means a corrupt file.
MAX_HEADER_BYTES = 100_000_000
LISTED_PER_PROBLEM = 10

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
FLOAT_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape of one checkpoint tensor; quantizable: an FP8 checkpoint may store it block-quantised."""

    shape: tuple[int, ...]
    quantizable: bool = False


# ----- the tensors a config implies -----


def _linear(out_features: int, in_features: int) -> TensorSpec:
    return TensorSpec((out_features, in_features), quantizable=True)


def _vector(size: int) -> TensorSpec:
    return TensorSpec((size,))


def _mlp_tensors(prefix: str, hidden: int, intermediate: int) -> dict[str, TensorSpec]:
    return {
        f"{prefix}.gate_proj.weight": _linear(intermediate, hidden),
        f"{prefix}.up_proj.weight": _linear(intermediate, hidden),
        f"{prefix}.down_proj.weight": _linear(hidden, intermediate),
    }


def decoder_layer_tensors(config: ModelConfig, layer_id: int) -> dict[str, TensorSpec]:
    """Tensors of `model.layers.{layer_id}` as a decoder layer (MTP layers add their own on top)."""
    c = config
    p = f"model.layers.{layer_id}"
    hidden, heads = c.hidden_size, c.num_attention_heads
    out: dict[str, TensorSpec] = {
        f"{p}.input_layernorm.weight": _vector(hidden),
        f"{p}.post_attention_layernorm.weight": _vector(hidden),
    }
    attn = f"{p}.self_attn"
    if c.q_lora_rank is None:
        out[f"{attn}.q_proj.weight"] = _linear(heads * c.qk_head_dim, hidden)
    else:
        out[f"{attn}.q_a_proj.weight"] = _linear(c.q_lora_rank, hidden)
        out[f"{attn}.q_a_layernorm.weight"] = _vector(c.q_lora_rank)
        out[f"{attn}.q_b_proj.weight"] = _linear(heads * c.qk_head_dim, c.q_lora_rank)
    out[f"{attn}.kv_a_proj_with_mqa.weight"] = _linear(c.kv_lora_rank + c.qk_rope_head_dim, hidden)
    out[f"{attn}.kv_a_layernorm.weight"] = _vector(c.kv_lora_rank)
    out[f"{attn}.kv_b_proj.weight"] = _linear(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    out[f"{attn}.o_proj.weight"] = _linear(hidden, heads * c.v_head_dim)

    mlp = f"{p}.mlp"
    if not c.is_moe_layer(layer_id):
        out.update(_mlp_tensors(mlp, hidden, c.intermediate_size))
        return out
    experts, moe_inter = c.n_routed_experts, c.moe_intermediate_size
    if experts is None or moe_inter is None:  # unreachable for a validated ModelConfig; keeps types honest
        raise ConfigError("an MoE layer needs n_routed_experts and moe_intermediate_size")
    # The router stays in high precision in every DeepSeek checkpoint.
    out[f"{mlp}.gate.weight"] = TensorSpec((experts, hidden))
    if c.topk_method == "noaux_tc":
        out[f"{mlp}.gate.e_score_correction_bias"] = _vector(experts)
    for e in range(experts):
        out.update(_mlp_tensors(f"{mlp}.experts.{e}", hidden, moe_inter))
    if c.n_shared_experts:
        out.update(_mlp_tensors(f"{mlp}.shared_experts", hidden, moe_inter * c.n_shared_experts))
    return out


def mtp_layer_tensors(config: ModelConfig, layer_id: int) -> dict[str, TensorSpec]:
    """An MTP module: input norms and projection, a full decoder layer, and its own head."""
    hidden, p = config.hidden_size, f"model.layers.{layer_id}"
    out = {
        f"{p}.enorm.weight": _vector(hidden),
        f"{p}.hnorm.weight": _vector(hidden),
        f"{p}.eh_proj.weight": _linear(hidden, 2 * hidden),
    }
    out.update(decoder_layer_tensors(config, layer_id))
    out[f"{p}.shared_head.norm.weight"] = _vector(hidden)
    out[f"{p}.shared_head.head.weight"] = TensorSpec((config.vocab_size, hidden))
    return out


def expected_tensors(config: ModelConfig, include_mtp: bool) -> dict[str, TensorSpec]:
    """Every tensor name (HF naming) the model needs, with its shape."""
    hidden = config.hidden_size
    out = {"model.embed_tokens.weight": TensorSpec((config.vocab_size, hidden))}
    for layer_id in range(config.num_hidden_layers):
        out.update(decoder_layer_tensors(config, layer_id))
    out["model.norm.weight"] = _vector(hidden)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((config.vocab_size, hidden))
    if include_mtp:
        for layer_id in config.mtp_layer_ids:
            out.update(mtp_layer_tensors(config, layer_id))
    return out


def optional_tensors(config: ModelConfig, include_mtp: bool) -> Callable[[str], bool]:
    """Names a checkpoint may hold beyond expected_tensors(config, include_mtp) without being wrong.

    - DeepSeek-V3 stores a copy of the embedding inside each MTP layer (`model.layers.{N+k}.embed_tokens.weight`);
    - when MTP is not loaded, all of the MTP layers' tensors;
    - transformers saves zero-sized `mlp.shared_experts.*` tensors when n_shared_experts is 0.
    """
    mtp = "|".join(str(i) for i in config.mtp_layer_ids)
    patterns = []
    if mtp:
        patterns.append(rf"model\.layers\.({mtp})\.embed_tokens\.weight")
        if not include_mtp:
            patterns.append(rf"model\.layers\.({mtp})\..*")
    if not config.n_shared_experts:
        patterns.append(r"model\.layers\.\d+\.mlp\.shared_experts\..*")
    if not patterns:
        return lambda name: False
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    return lambda name: regex.fullmatch(name) is not None


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`, the companion of an FP8 block-quantised weight."""
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def fp8_scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(cdiv(d, FP8_BLOCK) for d in weight_shape)


# ----- reading the files -----


@dataclass(frozen=True)
class _TensorEntry:
    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # start of the tensor's bytes in the data section


@dataclass(frozen=True)
class CheckpointReport:
    """What validate() found in a checkpoint that matches the expected tensors."""

    num_tensors: int
    nbytes: int
    fp8_weights: frozenset[str]  # quantizable weights stored as float8_e4m3fn (each with its weight_scale_inv)
    optional_present: frozenset[str]  # names accepted only through the `optional` predicate
    has_mtp: bool  # the expected tensors include MTP layers (an `eh_proj`) and they are present

    @property
    def is_fp8(self) -> bool:
        return bool(self.fp8_weights)


def _read_header(path: Path) -> dict[str, _TensorEntry]:
    """Parse one shard's header and check the file holds all the bytes it promises; never reads tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"shard {path} is truncated: {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"shard {path} is truncated or corrupt: header claims {header_len} bytes, file has {size}"
                )
            raw = f.read(header_len)
    except OSError as err:
        raise CheckpointError(f"cannot read shard {path}: {err}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"shard {path} has a corrupt header: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path} has a corrupt header: not a JSON object")

    entries: dict[str, _TensorEntry] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"shard {path} has a corrupt header entry for {name!r}: {info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != nbytes:
            raise CheckpointError(
                f"shard {path}: tensor {name!r} {list(shape)} {info['dtype']} needs {nbytes} bytes, header gives {end - begin}"
            )
        data_end = max(data_end, end)
        entries[name] = _TensorEntry(path, dtype, shape, nbytes, begin)
    expected_size = 8 + header_len + data_end
    if size < expected_size:
        raise CheckpointError(f"shard {path} is truncated: {size} bytes, its header needs {expected_size}")
    if size > expected_size:
        raise CheckpointError(f"shard {path} is corrupt: {size - expected_size} bytes beyond its header's last tensor")
    return entries


def _list(title: str, items: list[str]) -> str:
    shown = ", ".join(items[:LISTED_PER_PROBLEM])
    more = f", ... ({len(items) - LISTED_PER_PROBLEM} more)" if len(items) > LISTED_PER_PROBLEM else ""
    return f"{len(items)} {title}: {shown}{more}"


class Checkpoint:
    """A HF checkpoint directory: `model.safetensors.index.json` + shards, or exactly one `*.safetensors`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        shard_of = self._locate_shards()
        self._entries: dict[str, _TensorEntry] = {}
        headers = {shard: _read_header(self.path / shard) for shard in sorted(set(shard_of.values()))}
        for name, shard in shard_of.items():
            entry = headers[shard].get(name)
            if entry is None:
                raise CheckpointError(f"{INDEX_FILE} places {name!r} in {shard}, whose header does not list it")
            self._entries[name] = entry
        # Tensors a shard holds but the index omits are invisible to every HF loader; do the same.

    def _locate_shards(self) -> dict[str, str]:
        """name -> shard file name, from the index or the single file's header."""
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"cannot read {index}: {type(err).__name__}: {err}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
            missing = sorted({s for s in weight_map.values() if not (self.path / s).is_file()})
            if missing:
                raise CheckpointError(f"checkpoint {self.path} is missing shard files named by {INDEX_FILE}: {missing}")
            return dict(weight_map)
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files (and no {INDEX_FILE}) in {self.path}")
        if len(files) > 1:
            raise CheckpointError(f"{self.path} has {len(files)} .safetensors files but no {INDEX_FILE}: {files}")
        return {name: files[0] for name in _read_header(self.path / files[0])}

    # ----- metadata, no tensor data -----

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, name: str) -> _TensorEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}")
        return entry

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def has_mtp_weights(self, config: ModelConfig) -> bool:
        """Whether any tensor of an MTP layer is stored (transformers' save_pretrained never writes them)."""
        prefixes = tuple(f"model.layers.{i}." for i in config.mtp_layer_ids)
        return bool(prefixes) and any(name.startswith(prefixes) for name in self._entries)

    def validate(
        self, expected: dict[str, TensorSpec], optional: Callable[[str], bool] | None = None
    ) -> CheckpointReport:
        """Check names, shapes and FP8 companions against `expected`; one CheckpointError lists every problem."""
        missing, wrong_shape, wrong_dtype = [], [], []
        fp8: set[str] = set()
        companions: set[str] = set()
        for name, spec in expected.items():
            entry = self._entries.get(name)
            if entry is None:
                missing.append(name)
                continue
            if entry.shape != spec.shape:
                wrong_shape.append(f"{name} {list(entry.shape)} (expected {list(spec.shape)})")
            if entry.dtype == FP8_DTYPE and spec.quantizable:
                fp8.add(name)
                scale = scale_name(name)
                companions.add(scale)
                scale_entry = self._entries.get(scale)
                if scale_entry is None:
                    missing.append(f"{scale} (scale of float8_e4m3fn weight {name})")
                elif scale_entry.shape != fp8_scale_shape(spec.shape):
                    wrong_shape.append(f"{scale} {list(scale_entry.shape)} (expected {list(fp8_scale_shape(spec.shape))})")
                elif scale_entry.dtype not in FLOAT_WEIGHT_DTYPES:
                    wrong_dtype.append(f"{scale} {scale_entry.dtype}")
            elif entry.dtype not in FLOAT_WEIGHT_DTYPES:
                wrong_dtype.append(f"{name} {entry.dtype}")
        optional = optional or (lambda name: False)
        optional_present = set()
        unexpected = []
        for name in self._entries:
            if name in expected or name in companions:
                continue
            if optional(name):
                optional_present.add(name)
            else:
                unexpected.append(name)

        problems = [
            _list(title, sorted(items))
            for title, items in (
                ("missing tensors", missing),
                ("unexpected tensors", unexpected),
                ("tensors of the wrong shape", wrong_shape),
                ("tensors of an unsupported dtype", wrong_dtype),
            )
            if items
        ]
        if problems:
            raise CheckpointError(f"checkpoint {self.path} does not match the model: " + "; ".join(problems))
        used = set(expected) | companions
        return CheckpointReport(
            num_tensors=len(used),
            nbytes=sum(self._entries[n].nbytes for n in used),
            fp8_weights=frozenset(fp8),
            optional_present=frozenset(optional_present),
            has_mtp=any(n.endswith(".eh_proj.weight") for n in expected),
        )

    # ----- tensor data -----

    def iter_tensors(
        self, names: Iterable[str] | None = None, device: str | torch.device = "cpu", progress: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, shard by shard, each shard opened once (memory-mapped).

        Unknown names raise CheckpointError here, before anything is read. Each name is yielded once.
        """
        wanted = self.names() if names is None else list(dict.fromkeys(names))
        by_shard: dict[Path, list[str]] = {}
        for name in wanted:
            by_shard.setdefault(self._entry(name).shard, []).append(name)
        return self._stream(by_shard, device, progress)

    def _stream(
        self, by_shard: dict[Path, list[str]], device: str | torch.device, progress: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        total = sum(self._entries[n].nbytes for names in by_shard.values() for n in names)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"Loading {self.path.name}", disable=not progress) as bar:
            for shard in sorted(by_shard):
                with safe_open(str(shard), framework="pt", device=str(device)) as f:
                    # Reading in file order keeps the page cache streaming forward.
                    for name in sorted(by_shard[shard], key=lambda n: self._entries[n].offset):
                        tensor = f.get_tensor(name)
                        bar.update(self._entries[name].nbytes)
                        yield name, tensor

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        entry = self._entry(name)
        with safe_open(str(entry.shard), framework="pt", device=str(device)) as f:
            return f.get_tensor(name)


class TensorDictCheckpoint(Checkpoint):
    """Tensors already in memory (e.g. a transformers model's state_dict) seen as a checkpoint: the same
    validation and loading path as files, without writing them to disk first."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], name: str = "in-memory") -> None:
        self.path = Path(name)
        self._tensors = dict(tensors)
        self._entries = {
            n: _TensorEntry(self.path, t.dtype, tuple(t.shape), t.numel() * t.element_size(), 0)
            for n, t in self._tensors.items()
        }

    @classmethod
    def from_transformers(cls, model: torch.nn.Module) -> TensorDictCheckpoint:
        """A transformers DeepseekV2/V3ForCausalLM's weights under checkpoint names, sharing its memory.

        transformers 5 keeps each MoE layer's experts stacked (`experts.gate_up_proj` [E, 2I, H], gate rows
        first, and `experts.down_proj` [E, H, I]); checkpoints name each expert's projections apart."""
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            prefix, _, leaf = name.rpartition(".experts.")
            if leaf == "gate_up_proj":
                inter = tensor.shape[1] // 2
                for e in range(tensor.shape[0]):
                    tensors[f"{prefix}.experts.{e}.gate_proj.weight"] = tensor[e, :inter]
                    tensors[f"{prefix}.experts.{e}.up_proj.weight"] = tensor[e, inter:]
            elif leaf == "down_proj":
                for e in range(tensor.shape[0]):
                    tensors[f"{prefix}.experts.{e}.down_proj.weight"] = tensor[e]
            else:
                tensors[name] = tensor
        return cls(tensors, name=type(model).__name__)

    def _stream(self, by_shard, device, progress):
        # Tensors are yielded where they live; the loader moves and converts them.
        for names in by_shard.values():
            for name in names:
                yield name, self._tensors[name]

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        self._entry(name)
        return self._tensors[name]
