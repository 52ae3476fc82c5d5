"""The exported folder's README.md (model card with held-out figures) and train_summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUMMARY_FILE = "train_summary.json"


def _fmt_eval(name: str, e: dict[str, float]) -> str:
    return (f"| {name} | {e['tokens']:,} | {e['loss']:.4f} | {e['perplexity']:.2f} | {e['accuracy']:.4f} "
            f"| {e['mtp_loss']:.4f} | {e['mtp_accuracy']:.4f} |")


def _calibration_line(s: dict[str, Any]) -> list[str]:
    cal = s.get("calibration")
    if not cal:
        return []
    return [f"  (steps chosen by `--time-budget {cal['time_budget']:.0f}`: calibrated at {cal['ms_per_step']:.0f} ms/step; "
            f"the run averaged {1000 * s['train_seconds'] / s['steps']:.0f} ms/step)"]


def render_readme(s: dict[str, Any]) -> str:
    c = s["config"]
    lines = [
        "# deepseek_v3_tiny: DeepInfer's embedded default model",
        "",
        "A small model with DeepSeek-V3's architecture, trained by DeepInfer's own command on the Python standard",
        "library's source, so that `deepinfer-serve` with no model path serves something real and MTP drafts mean",
        "something. It writes Python-looking code; it knows nothing else. Not for any real use.",
        "",
        "## Architecture (config.json, HF DeepseekV3 layout)",
        "",
        f"- {c['num_hidden_layers']} layers (first {c['first_k_dense_replace']} dense, then MoE) + "
        f"{c['num_nextn_predict_layers']} MTP layer (`model.layers.{c['num_hidden_layers']}`), hidden {c['hidden_size']}, "
        f"vocab {c['vocab_size']}",
        f"- MLA: {c['num_attention_heads']} heads, q_lora_rank {c['q_lora_rank']}, kv_lora_rank {c['kv_lora_rank']}, "
        f"qk_nope {c['qk_nope_head_dim']} + qk_rope {c['qk_rope_head_dim']}, v {c['v_head_dim']}, interleaved RoPE",
        f"- MoE: {c['n_routed_experts']} routed experts (intermediate {c['moe_intermediate_size']}), top-{c['num_experts_per_tok']}, "
        f"sigmoid scores, {c['n_group']} groups of which {c['topk_group']} kept (noaux_tc), e_score_correction_bias, "
        f"{c['n_shared_experts']} shared expert, routed_scaling_factor {c['routed_scaling_factor']}",
        f"- {s['params']:,} trained parameters; stored with projections in FP8 (e4m3, 128x128 blocks, "
        "`weight_scale_inv`), embeddings / norms / heads bf16, router fp32",
        "",
        "## Training",
        "",
        f"- Command: `{s['command']}`",
        *_calibration_line(s),
        f"- Date {s['date']}; hardware: {s['hardware']}; torch {s['torch']}; {s['train_seconds']:.0f} s of training",
        f"- Corpus: the `.py` files of the Python {s['python']} standard library (site-packages excluded): "
        f"{s['train_files']} training files ({s['train_tokens']:,} tokens), {s['heldout_files']} held-out files "
        f"({s['heldout_tokens']:,} tokens) listed in `heldout_files.txt`",
        f"- Tokenizer: byte-level BPE (HF tokenizers), vocabulary {c['vocab_size']} including DeepSeek-V3's 15 special "
        "tokens (bos = 0, eos = 1) and its chat template in tokenizer_config.json; trained on the training files only",
        f"- {s['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens ({s['steps'] * s['batch_size'] * s['seq_len']:,} "
        f"tokens seen), AdamW (lr {s['lr']}, warm-up then cosine), loss = CE + {s['mtp_lambda']} x MTP CE "
        "(token t+2 from the main model's hidden state at t and the embedding of token t+1), aux-loss-free balancing "
        f"(bias += {s['bias_gamma']} x sign(mean load - load) per step); autograd through deepinfer.model on the "
        "reference backend",
        f"- Final training loss (last 20 steps): main {s['final_train_main']:.4f}, MTP {s['final_train_mtp']:.4f}",
        "",
        "## Held-out figures",
        "",
        f"Windows of {s['seq_len']} tokens from the held-out files; MTP accuracy: top-1 of the MTP head on token t+2 "
        "given the true token t+1.",
        "",
        "| model | tokens | loss | perplexity | next-token acc. | MTP loss | MTP next-next-token acc. |",
        "|---|---|---|---|---|---|---|",
        _fmt_eval("shipped (FP8 + bf16, loaded by DeepInfer)", s["eval_exported"]),
        _fmt_eval("float32 before export", s["eval_float"]),
        "",
        "## Greedy completions (deepinfer.LLM on this folder, reference backend)",
        "",
    ]
    for prompt, completion in s["completions"]:
        lines += ["```python", prompt + completion, "```", ""]
    lines += [
        "## Use",
        "",
        "```python",
        "from deepinfer import LLM, SamplingParams",
        "from deepinfer.models import embedded_model_path",
        "",
        "llm = LLM(embedded_model_path())",
        'print(llm.generate("def fibonacci(n):", SamplingParams(max_tokens=48, temperature=0))[0].outputs[0].text)',
        "```",
        "",
    ]
    return "\n".join(lines)


def write_report(folder: Path, summary: dict[str, Any]) -> None:
    (folder / "README.md").write_text(render_readme(summary), encoding="utf-8")
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
