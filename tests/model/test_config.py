"""ModelConfig: HF config.json in both layouts, checked against transformers' own rope and attention scale."""

from __future__ import annotations

import json
import math

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.errors import ConfigError
from deepinfer.ops import RoutingSpec

# DeepSeek-V3's config.json as published (classic layout: rope_theta + rope_scaling with "type", FP8).
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# DeepSeek-V2-Lite's: no q_lora, softmax gate, greedy top-k, two shared experts.
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


def yarn(factor, original, **extra):
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": original, **extra}


def transformers_rope_and_scale(hf_cfg):
    """(inv_freq, cos/sin attention factor, softmax scale) as transformers' DeepSeek modelling computes them."""
    if hf_cfg.model_type == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention as Attention,
            DeepseekV3RotaryEmbedding as Rotary,
        )
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2Attention as Attention,
            DeepseekV2RotaryEmbedding as Rotary,
        )
    rotary = Rotary(hf_cfg)
    with torch.device("meta"):  # only the scale is needed, not the projections
        scaling = Attention(hf_cfg, 0).scaling
    return rotary.inv_freq, rotary.attention_scaling, scaling


# Each: (model_type, transformers config overrides).
PARITY_CASES = {
    "v3-yarn-mscale-all-dim": ("deepseek_v3", dict(rope_parameters=yarn(4.0, 32, mscale=1.0, mscale_all_dim=0.707))),
    "v3-yarn-deepseek-real": (
        "deepseek_v3",
        dict(qk_rope_head_dim=64, max_position_embeddings=163840,
             rope_parameters=yarn(40, 4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    ),
    "v3-yarn-mscale-only": ("deepseek_v3", dict(rope_parameters=yarn(8.0, 16, mscale=0.707))),
    "v3-yarn-untruncated-betas": (
        "deepseek_v3",
        dict(qk_rope_head_dim=16, rope_parameters=yarn(5.0, 64, beta_fast=16, beta_slow=2, truncate=False,
                                                        mscale=1.0, mscale_all_dim=1.0)),
    ),
    "v3-default-rope": ("deepseek_v3", dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "v3-no-q-lora-no-interleave": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
    "v2-yarn-lite": ("deepseek_v2", dict(rope_parameters=yarn(40, 4096, mscale=0.707, mscale_all_dim=0.707))),
    "v2-default-group-limited": (
        "deepseek_v2", dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_saved_transformers_config_matches_transformers_rope_and_scale(case, hf_config, tmp_path):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type, overrides = PARITY_CASES[case]
    hf_config(model_type, **overrides).save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dir(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)

    inv_freq, attention_factor, scaling = transformers_rope_and_scale(reloaded)
    spec = config.rope_spec()
    assert spec.dim == reloaded.qk_rope_head_dim
    torch.testing.assert_close(spec.inv_freq(), inv_freq, rtol=1e-6, atol=0)
    assert spec.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert config.softmax_scale == pytest.approx(scaling, rel=1e-12)
    if reloaded.rope_parameters["rope_type"] == "yarn":
        yarn_inv_freq, yarn_factor = ROPE_INIT_FUNCTIONS["yarn"](reloaded)
        torch.testing.assert_close(spec.inv_freq(), yarn_inv_freq, rtol=1e-6, atol=0)
        assert spec.attention_factor == pytest.approx(yarn_factor, rel=1e-12)
    else:
        assert spec.yarn is None
    # transformers' V2 rotates interleaved pairs whatever the config says; V3 follows rope_interleave.
    assert spec.interleaved == (model_type == "deepseek_v2" or reloaded.rope_interleave)


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_saved_transformers_config_fields(case, hf_config, tmp_path):
    model_type, overrides = PARITY_CASES[case]
    hf = hf_config(model_type, **overrides)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dir(tmp_path)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                 "routed_scaling_factor", "norm_topk_prob", "tie_word_embeddings", "max_position_embeddings",
                 "rms_norm_eps", "bos_token_id", "eos_token_id"):
        assert getattr(config, name) == getattr(hf, name), name
    assert config.model_type == model_type
    assert config.n_group == (hf.n_group or 1) and config.topk_group == (hf.topk_group or 1)
    assert config.qk_head_dim == hf.qk_nope_head_dim + hf.qk_rope_head_dim
    assert config.dtype in (None, "float32")  # a bare config save writes no dtype
    assert not config.is_fp8_checkpoint
    if model_type == "deepseek_v3":
        assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")
        assert config.num_nextn_predict_layers == hf.num_nextn_predict_layers
    else:
        assert (config.topk_method, config.scoring_func) == (hf.topk_method, "softmax")


def test_deepseek_v3_classic_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    config = ModelConfig.from_hf_dir(tmp_path)

    assert config.model_type == "deepseek_v3" and config.q_lora_rank == 1536 and config.qk_head_dim == 192
    assert config.is_fp8_checkpoint and config.quantization_config.weight_block_size == (128, 128)
    assert config.dtype == "bfloat16"
    assert config.num_nextn_predict_layers == 1 and list(config.mtp_layer_ids) == [61]
    assert [config.is_moe_layer(i) for i in (0, 2, 3, 60, 61)] == [False, False, True, True, True]
    spec = config.rope_spec()
    assert spec.interleaved and spec.theta == 10000.0
    assert spec.yarn is not None and spec.yarn.factor == 40 and spec.yarn.original_max_position_embeddings == 4096
    assert spec.attention_factor == pytest.approx(1.0)  # mscale == mscale_all_dim
    mscale = 0.1 * math.log(40) + 1.0
    assert config.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert config.routing_spec() == RoutingSpec(
        num_experts=256, top_k=8, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )
    assert config.eos_token_ids == (1,)


def test_classic_config_agrees_with_transformers_reading_it(tmp_path):
    """transformers converts rope_scaling to rope_parameters on load; both readings give the same rope and scale."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    reloaded = AutoConfig.from_pretrained(tmp_path)
    inv_freq, attention_factor, scaling = transformers_rope_and_scale(reloaded)
    config = ModelConfig.from_hf_dir(tmp_path)
    torch.testing.assert_close(config.rope_spec().inv_freq(), inv_freq, rtol=1e-6, atol=0)
    assert config.rope_spec().attention_factor == pytest.approx(attention_factor)
    assert config.softmax_scale == pytest.approx(scaling, rel=1e-12)


def test_deepseek_v2_lite_classic_config():
    config = ModelConfig.from_hf_dict(DEEPSEEK_V2_LITE_CONFIG)
    assert config.q_lora_rank is None and config.n_shared_experts == 2
    assert (config.topk_method, config.scoring_func, config.norm_topk_prob) == ("greedy", "softmax", False)
    assert [config.is_moe_layer(i) for i in (0, 1, 26)] == [False, True, True]
    spec = config.rope_spec()
    assert spec.interleaved and spec.attention_factor == pytest.approx(1.0)
    assert config.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1.0) ** 2)
    routing = config.routing_spec()
    assert (routing.num_experts, routing.top_k, routing.topk_method, routing.scoring_func) == (64, 6, "greedy", "softmax")
    assert not config.is_fp8_checkpoint and config.num_nextn_predict_layers == 0


def test_v2_null_groups_and_defaults():
    hf = {**DEEPSEEK_V2_LITE_CONFIG, "n_group": None, "topk_group": None}
    for key in ("scoring_func", "topk_method", "norm_topk_prob", "moe_layer_freq"):
        hf.pop(key)
    config = ModelConfig.from_hf_dict(hf)
    assert (config.n_group, config.topk_group) == (1, 1)
    assert (config.scoring_func, config.topk_method, config.norm_topk_prob, config.moe_layer_freq) == ("softmax", "greedy", False, 1)


def test_v3_defaults_by_model_type():
    hf = dict(DEEPSEEK_V3_CONFIG)
    for key in ("scoring_func", "topk_method", "norm_topk_prob", "num_nextn_predict_layers", "quantization_config"):
        hf.pop(key)
    config = ModelConfig.from_hf_dict(hf)
    assert (config.scoring_func, config.topk_method, config.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert config.num_nextn_predict_layers == 0 and not config.is_fp8_checkpoint and config.rope_interleave


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "mscale": 1.0, "mscale_all_dim": 1.0}},
        {"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000, "factor": 40,
                                                   "original_max_position_embeddings": 4096, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0}},
        {"rope_scaling": None, "rope_theta": 10000,
         "rope_parameters": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": None, "beta_slow": None}},
    ],
    ids=["rope_scaling-with-rope_type", "rope_parameters", "rope_parameters-theta-outside"],
)
def test_rope_layouts_read_the_same(rope):
    reference = ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG)
    hf = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    config = ModelConfig.from_hf_dict({**hf, **rope})
    assert config.rope_spec() == reference.rope_spec()
    assert config.softmax_scale == reference.softmax_scale


@pytest.mark.parametrize("rope", [{"rope_scaling": None}, {"rope_scaling": {"type": "default"}},
                                  {"rope_parameters": {"rope_type": None, "rope_theta": 10000}}])
def test_plain_rope(rope):
    hf = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "rope_scaling"}
    config = ModelConfig.from_hf_dict({**hf, **rope})
    assert config.rope_spec().yarn is None and config.rope_scaling is None
    assert config.softmax_scale == pytest.approx(192**-0.5)


def test_moe_layer_freq_and_dense_models():
    config = ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE_CONFIG, "moe_layer_freq": 2, "first_k_dense_replace": 1})
    assert [config.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]
    dense = ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE_CONFIG, "n_routed_experts": None})
    assert not any(dense.is_moe_layer(i) for i in range(27))
    with pytest.raises(ConfigError, match="no routed experts"):
        dense.routing_spec()


def test_eos_list_and_immutability():
    config = ModelConfig.from_hf_dict({**DEEPSEEK_V3_CONFIG, "eos_token_id": [1, 7]})
    assert config.eos_token_ids == (1, 7)
    with pytest.raises(Exception):
        config.hidden_size = 3


# (overrides of DeepSeek-V3's config, words the error must contain)
BAD_CONFIGS = {
    "model_type": ({"model_type": "llama"}, ["model_type", "'llama'", "deepseek_v2", "deepseek_v3"]),
    "no-model_type": ({"model_type": None}, ["model_type", "None"]),
    "rope-type": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling.rope_type", "'linear'"]),
    "rope-params-type": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, ["rope_parameters.rope_type", "'dynamic'"]),
    "rope-attention-factor": ({"rope_parameters": yarn(4.0, 32, attention_factor=0.5)}, ["attention_factor", "0.5"]),
    "rope-factor": ({"rope_parameters": yarn(0.5, 32)}, ["rope_parameters.factor", "0.5"]),
    "rope-partial": ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, ["partial_rotary_factor"]),
    "quant-method": ({"quantization_config": {"quant_method": "awq", "bits": 4}}, ["quantization_config.quant_method", "'awq'"]),
    "quant-block": ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
                    ["quantization_config.weight_block_size", "[64, 64]"]),
    "quant-fmt": ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, ["quantization_config.fmt", "'e5m2'"]),
    "quant-activations": ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
                          ["quantization_config.activation_scheme", "'static'"]),
    "hidden_act": ({"hidden_act": "gelu"}, ["hidden_act", "'gelu'"]),
    "attention_bias": ({"attention_bias": True}, ["attention_bias", "True"]),
    "mlp_bias": ({"mlp_bias": True}, ["mlp_bias", "True"]),
    "negative-dim": ({"hidden_size": -1}, ["hidden_size", "-1"]),
    "zero-heads": ({"num_attention_heads": 0}, ["num_attention_heads", "0"]),
    "odd-rope-dim": ({"qk_rope_head_dim": 63}, ["qk_rope_head_dim", "63"]),
    "missing-field": ({"kv_lora_rank": None}, ["kv_lora_rank"]),
    "n_group": ({"n_group": 7}, ["n_group 7", "n_routed_experts 256"]),
    "topk_group": ({"topk_group": 9}, ["topk_group 9", "n_group 8"]),
    "experts_per_tok": ({"num_experts_per_tok": 300}, ["num_experts_per_tok 300", "n_routed_experts 256"]),
    "experts-in-groups": ({"num_experts_per_tok": 70, "topk_group": 2}, ["num_experts_per_tok 70", "topk_group=2"]),
    "v3-topk_method": ({"topk_method": "greedy"}, ["topk_method", "'greedy'", "noaux_tc"]),
    "v3-scoring": ({"scoring_func": "softmax"}, ["scoring_func", "'softmax'"]),
    "moe_layer_freq": ({"moe_layer_freq": 0}, ["moe_layer_freq", "0"]),
    "scaling-factor": ({"routed_scaling_factor": -2.5}, ["routed_scaling_factor", "-2.5"]),
    "nextn": ({"num_nextn_predict_layers": -1}, ["num_nextn_predict_layers", "-1"]),
    "eps": ({"rms_norm_eps": 0}, ["rms_norm_eps", "0"]),
    "moe-size": ({"moe_intermediate_size": None}, ["moe_intermediate_size"]),
    "nested-rope": ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, ["nested"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unsupported_values_name_the_field(case):
    overrides, words = BAD_CONFIGS[case]
    hf = {**DEEPSEEK_V3_CONFIG, **overrides}
    if hf.get("kv_lora_rank") is None:
        hf.pop("kv_lora_rank")
    if "rope_parameters" in overrides:
        hf.pop("rope_scaling")
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(hf)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_v2_rejects_v3_routing_and_non_interleaved_rope():
    with pytest.raises(ConfigError, match="topk_method 'noaux_tc'"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE_CONFIG, "topk_method": "noaux_tc"})
    with pytest.raises(ConfigError, match="scoring_func 'sigmoid'"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE_CONFIG, "scoring_func": "sigmoid"})
    with pytest.raises(ConfigError, match="rope_interleave"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE_CONFIG, "rope_interleave": False})


def test_direct_construction_raises_config_error():
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig(**{**ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG).model_dump(), "hidden_size": 0})


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_hf_dir(tmp_path)
