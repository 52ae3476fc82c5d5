"""Checkpoint: expected tensor names against transformers' own saves, header checks, FP8 companions, streaming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer import quant
from deepinfer.config import ModelConfig
from deepinfer.errors import CheckpointError
from deepinfer.model.checkpoint import (
    INDEX_FILE,
    Checkpoint,
    TensorSpec,
    expected_tensors,
    optional_tensors,
    scale_name,
)


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes as safetensors itself reads them from every shard."""
    out = {}
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def load_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in path.glob("*.safetensors"):
        out.update(load_file(shard))
    return out


def rewrite_single_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the checkpoint's tensors with `tensors`, as one model.safetensors."""
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    (path / INDEX_FILE).unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


EXPECTED_CASES = {
    "v3-q-lora": ("deepseek_v3", {}),
    "v3-no-q-lora": ("deepseek_v3", dict(q_lora_rank=None)),
    "v3-two-shared-all-moe": ("deepseek_v3", dict(n_shared_experts=2, first_k_dense_replace=0)),
    "v3-tied-odd-dims": ("deepseek_v3", dict(tie_word_embeddings=True, hidden_size=36, vocab_size=70, n_routed_experts=6,
                                             n_group=3, topk_group=2, num_attention_heads=3, num_key_value_heads=3)),
    "v2-greedy": ("deepseek_v2", {}),
    "v2-group-limited-q-lora": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, q_lora_rank=12)),
}


@pytest.mark.parametrize("case", list(EXPECTED_CASES))
def test_expected_tensors_match_transformers_save(case, tiny_checkpoint):
    model_type, overrides = EXPECTED_CASES[case]
    path, _ = tiny_checkpoint(model_type, **overrides)
    config = ModelConfig.from_hf_dir(path)

    expected = expected_tensors(config, include_mtp=False)
    assert {name: spec.shape for name, spec in expected.items()} == saved_shapes(path)
    report = Checkpoint(path).validate(expected)
    assert report.num_tensors == len(expected) and not report.is_fp8 and not report.has_mtp
    assert not report.optional_present


def test_quantizable_marks_projections_only(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", num_nextn_predict_layers=1)
    config = ModelConfig.from_hf_dir(path)
    expected = expected_tensors(config, include_mtp=True)
    quantizable = {n for n, s in expected.items() if s.quantizable}
    for name, spec in expected.items():
        never = ("layernorm", "norm.weight", "mlp.gate.", "embed_tokens", "lm_head", "shared_head.head")
        assert spec.quantizable == (len(spec.shape) == 2 and not any(k in name for k in never)), name
    assert "model.layers.3.eh_proj.weight" in quantizable
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantizable


def test_moe_layer_freq_skips_layers():
    config = ModelConfig.from_hf_dict({**_tiny_v2_dict(), "moe_layer_freq": 2, "first_k_dense_replace": 1, "num_hidden_layers": 4})
    names = expected_tensors(config, include_mtp=False)
    assert "model.layers.1.mlp.gate_proj.weight" in names  # 1 % 2 != 0: dense
    assert "model.layers.2.mlp.gate.weight" in names
    assert "model.layers.2.mlp.gate.e_score_correction_bias" not in names  # V2 has no correction bias
    assert "model.layers.3.mlp.down_proj.weight" in names


def _tiny_v2_dict() -> dict:
    return dict(model_type="deepseek_v2", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, max_position_embeddings=64)


def test_sharded_reads_like_single_file(tiny_checkpoint):
    single_path, _ = tiny_checkpoint("deepseek_v3", name="single")
    sharded_path, _ = tiny_checkpoint("deepseek_v3", name="sharded", max_shard_size="50KB")
    assert (sharded_path / INDEX_FILE).is_file() and len(list(sharded_path.glob("*.safetensors"))) > 2
    single, sharded = Checkpoint(single_path), Checkpoint(sharded_path)

    assert single.names() == sharded.names() and len(single) == len(sharded)
    for name in single.names():
        assert single.shape(name) == sharded.shape(name) and single.dtype(name) == sharded.dtype(name) == torch.float32
    config = ModelConfig.from_hf_dir(sharded_path)
    sharded.validate(expected_tensors(config, include_mtp=False))
    a = dict(single.iter_tensors(progress=False))
    b = dict(sharded.iter_tensors(progress=False))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_iter_tensors_yields_each_tensor_once_equal_to_safetensors(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v2", max_shard_size="50KB")
    checkpoint = Checkpoint(path)
    reference = load_all(path)

    seen = []
    for name, tensor in checkpoint.iter_tensors(progress=False):
        seen.append(name)
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    assert sorted(seen) == sorted(reference) and len(seen) == len(set(seen))

    subset = ["model.norm.weight", "lm_head.weight", "model.norm.weight"]
    got = list(checkpoint.iter_tensors(subset, progress=False))
    assert sorted(n for n, _ in got) == ["lm_head.weight", "model.norm.weight"]
    torch.testing.assert_close(checkpoint.get("lm_head.weight"), reference["lm_head.weight"], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="no tensor 'model.nope'"):
        checkpoint.iter_tensors(["model.norm.weight", "model.nope"], progress=False)  # fails before reading
    with pytest.raises(CheckpointError, match="model.nope"):
        checkpoint.shape("model.nope")


def test_iter_tensors_with_progress_bar(tiny_checkpoint, capsys):
    path, _ = tiny_checkpoint("deepseek_v3")
    assert len(list(Checkpoint(path).iter_tensors(progress=True))) == len(Checkpoint(path))
    assert "Loading" in capsys.readouterr().err


def test_missing_shard(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", max_shard_size="50KB")
    victim = sorted(path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard.*{victim.name}"):
        Checkpoint(path)


@pytest.mark.parametrize("cut", [1, 1000])
def test_truncated_shard(tiny_checkpoint, cut):
    path, _ = tiny_checkpoint("deepseek_v3", max_shard_size="50KB")
    victim = sorted(path.glob("*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - cut])
    with pytest.raises(CheckpointError, match=f"{victim.name} is truncated"):
        Checkpoint(path)


@pytest.mark.parametrize("content", [b"", b"\x05\x00", b"\xff" * 8 + b"{}", b"\x04\x00\x00\x00\x00\x00\x00\x00{xx}"])
def test_corrupt_single_file(tmp_path, content):
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Checkpoint(tmp_path)


def test_wrong_shape(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3")
    config = ModelConfig.from_hf_dir(path)
    tensors = load_all(path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name][:-2]
    rewrite_single_file(path, tensors)
    with pytest.raises(CheckpointError, match=rf"wrong shape: {name} \[30, 16\] \(expected \[32, 16\]\)"):
        Checkpoint(path).validate(expected_tensors(config, include_mtp=False))


def test_missing_and_unexpected_tensors(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", max_shard_size="50KB")
    config = ModelConfig.from_hf_dir(path)
    tensors = load_all(path)
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    rewrite_single_file(path, tensors)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(path).validate(expected_tensors(config, include_mtp=False))
    message = str(info.value)
    assert "1 missing tensors: model.layers.2.mlp.experts.3.up_proj.weight" in message
    assert "1 unexpected tensors: model.layers.0.self_attn.rotary_emb.inv_freq" in message


def test_problem_lists_are_capped(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3")
    config = ModelConfig.from_hf_dir(path)
    expected = expected_tensors(config, include_mtp=False)
    expected.update({f"extra.{i}.weight": TensorSpec((1,)) for i in range(25)})
    with pytest.raises(CheckpointError, match=r"25 missing tensors: .*\.\.\. \(15 more\)"):
        Checkpoint(path).validate(expected)


def test_several_files_without_index_or_none(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointError, match="2 .safetensors files but no model.safetensors.index.json"):
        Checkpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Checkpoint(empty)
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "absent")


def test_index_naming_a_tensor_its_shard_lacks(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", max_shard_size="50KB")
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["model.ghost.weight"] = next(iter(index["weight_map"].values()))
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.ghost.weight"):
        Checkpoint(path)


def quantise_checkpoint(path: Path, config: ModelConfig) -> set[str]:
    """Rewrite a checkpoint the way DeepSeek ships FP8: quantizable weights as e4m3 + weight_scale_inv."""
    expected = expected_tensors(config, include_mtp=False)
    tensors = load_all(path)
    quantised = set()
    for name, spec in expected.items():
        if spec.quantizable:
            tensors[name], tensors[scale_name(name)] = quant.quantize_fp8_block(tensors[name])
            quantised.add(name)
    rewrite_single_file(path, tensors)
    return quantised


def test_fp8_checkpoint_validates_with_scales(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", intermediate_size=136, vocab_size=130)  # 136 rows -> 2 scale blocks
    config = ModelConfig.from_hf_dir(path)
    quantised = quantise_checkpoint(path, config)
    checkpoint = Checkpoint(path)
    assert checkpoint.dtype("model.layers.0.mlp.up_proj.weight") == torch.float8_e4m3fn
    assert checkpoint.shape("model.layers.0.mlp.up_proj.weight_scale_inv") == (2, 1)
    report = checkpoint.validate(expected_tensors(config, include_mtp=False))
    assert report.is_fp8 and report.fp8_weights == quantised
    assert report.num_tensors == len(expected_tensors(config, include_mtp=False)) + len(quantised)


def test_fp8_weight_without_scale(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3")
    config = ModelConfig.from_hf_dir(path)
    quantise_checkpoint(path, config)
    tensors = load_all(path)
    victim = "model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"
    del tensors[victim]
    rewrite_single_file(path, tensors)
    with pytest.raises(CheckpointError, match=f"missing tensors: {victim} \\(scale of float8_e4m3fn weight"):
        Checkpoint(path).validate(expected_tensors(config, include_mtp=False))


def test_fp8_scale_of_wrong_shape_and_fp8_norm(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3")
    config = ModelConfig.from_hf_dir(path)
    quantise_checkpoint(path, config)
    tensors = load_all(path)
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 1)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    rewrite_single_file(path, tensors)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(path).validate(expected_tensors(config, include_mtp=False))
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv [2, 1] (expected [1, 1])" in str(info.value)
    assert "unsupported dtype: model.norm.weight torch.float8_e4m3fn" in str(info.value)


def test_orphan_scale_is_unexpected(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3")
    config = ModelConfig.from_hf_dir(path)
    tensors = load_all(path)
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)  # its weight is not FP8
    rewrite_single_file(path, tensors)
    with pytest.raises(CheckpointError, match="unexpected tensors: model.layers.0.self_attn.o_proj.weight_scale_inv"):
        Checkpoint(path).validate(expected_tensors(config, include_mtp=False))


def add_mtp_shard(path: Path, config: ModelConfig) -> set[str]:
    """transformers never saves MTP weights: write them as an extra shard, DeepSeek-V3 style (with embed copy)."""
    base = expected_tensors(config, include_mtp=False)
    mtp = {n: s for n, s in expected_tensors(config, include_mtp=True).items() if n not in base}
    generator = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s.shape, generator=generator) for n, s in mtp.items()}
    embed_copy = f"model.layers.{config.num_hidden_layers}.embed_tokens.weight"
    tensors[embed_copy] = torch.randn(config.vocab_size, config.hidden_size, generator=generator)
    save_file(tensors, str(path / "mtp.safetensors"))
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"].update({n: "mtp.safetensors" for n in tensors})
    (path / INDEX_FILE).write_text(json.dumps(index))
    return set(mtp)


def test_mtp_weights(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", num_nextn_predict_layers=1, max_shard_size="50KB")
    config = ModelConfig.from_hf_dir(path)
    assert config.num_nextn_predict_layers == 1
    checkpoint = Checkpoint(path)
    assert not checkpoint.has_mtp_weights(config)  # transformers saves none
    checkpoint.validate(expected_tensors(config, include_mtp=False), optional_tensors(config, include_mtp=False))

    mtp_names = add_mtp_shard(path, config)
    # The MTP layer (index 3 >= first_k_dense_replace) is MoE, as in DeepSeek-V3.
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in mtp_names
    assert {"model.layers.3.enorm.weight", "model.layers.3.shared_head.head.weight"} <= mtp_names
    checkpoint = Checkpoint(path)
    assert checkpoint.has_mtp_weights(config)
    report = checkpoint.validate(expected_tensors(config, include_mtp=True), optional_tensors(config, include_mtp=True))
    assert report.has_mtp and report.optional_present == {"model.layers.3.embed_tokens.weight"}
    # Not loading MTP: its tensors are tolerated, not required.
    report = checkpoint.validate(expected_tensors(config, include_mtp=False), optional_tensors(config, include_mtp=False))
    assert not report.has_mtp and mtp_names <= report.optional_present
    with pytest.raises(CheckpointError, match="unexpected tensors: model.layers.3."):
        checkpoint.validate(expected_tensors(config, include_mtp=False))

    # A partial MTP layer is reported, not ignored.
    index = json.loads((path / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.3.eh_proj.weight"]
    (path / INDEX_FILE).write_text(json.dumps(index))
    checkpoint = Checkpoint(path)
    assert checkpoint.has_mtp_weights(config)
    with pytest.raises(CheckpointError, match="missing tensors: model.layers.3.eh_proj.weight"):
        checkpoint.validate(expected_tensors(config, include_mtp=True), optional_tensors(config, include_mtp=True))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_zero_shared_experts_saved_by_transformers_are_tolerated(tiny_checkpoint):
    path, _ = tiny_checkpoint("deepseek_v3", n_shared_experts=0)
    config = ModelConfig.from_hf_dir(path)
    expected = expected_tensors(config, include_mtp=False)
    assert not any("shared_experts" in n for n in expected)
    report = Checkpoint(path).validate(expected, optional_tensors(config, include_mtp=False))
    assert report.optional_present and all("shared_experts" in n for n in report.optional_present)



@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_in_memory_transformers_weights_equal_the_saved_checkpoint(model_type, tmp_path):
    """TensorDictCheckpoint.from_transformers names and splits the stacked experts exactly as save_pretrained."""
    from deepinfer.model.checkpoint import TensorDictCheckpoint
    from deepinfer.model.loader import load_model
    from deepinfer.registry import load_backend

    from tiny_checkpoints import build_hf_model, save_checkpoint

    hf = build_hf_model(model_type, seed=int(torch.randint(0, 1000, ())))
    path = save_checkpoint(hf, tmp_path / "saved")
    saved = load_all(path)
    memory = TensorDictCheckpoint.from_transformers(hf)
    assert memory.names() == sorted(saved)
    for name, tensor in memory.iter_tensors(progress=False):
        assert torch.equal(tensor, saved[name]), name
    config = ModelConfig.from_hf_dir(path)
    memory.validate(expected_tensors(config, include_mtp=False))
    backend = load_backend("reference")
    from_disk = load_model(path, backend, dtype=torch.float32, progress=False)
    from_memory = load_model(memory, backend, config=config, dtype=torch.float32, progress=False)
    assert from_memory.layers[1].mlp.experts.gate_up.data.shape == from_disk.layers[1].mlp.experts.gate_up.data.shape
    for a, b in zip(from_disk.layers, from_memory.layers):
        assert torch.equal(a.mlp.down.data if hasattr(a.mlp, "down") else a.mlp.experts.down.data,
                           b.mlp.down.data if hasattr(b.mlp, "down") else b.mlp.experts.down.data)
    with pytest.raises(Exception, match="ModelConfig"):
        load_model(memory, backend, dtype=torch.float32, progress=False)
