"""Offline throughput on the CPU: DeepInfer's engine vs transformers' generate on the same tiny DeepSeek-V3.

    python benchmarks/bench_offline_cpu.py [--batch 16] [--prompt-len 64] [--new-tokens 64]

Both generate greedily the same number of tokens for the same prompts; prints generated tokens per second
of each and the ratio. The model is random (shape below), saved once to a temp folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def build_checkpoint(path: str) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, max_position_embeddings=1024, num_nextn_predict_layers=0,
        bos_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(cfg).float().save_pretrained(path)


def run_transformers(path: str, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed


def run_deepinfer(path: str, prompts: list[list[int]], new_tokens: int) -> float:
    from deepinfer import LLM, SamplingParams

    llm = LLM(path, backend="reference", dtype=torch.float32, progress=False, kv_cache_memory=1 << 28)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(1)
    prompts = torch.randint(2, 4096, (args.batch, args.prompt_len)).tolist()
    with tempfile.TemporaryDirectory() as path:
        build_checkpoint(path)
        ours = run_deepinfer(path, prompts, args.new_tokens)
        theirs = run_transformers(path, prompts, args.new_tokens)
    print(f"batch {args.batch}, prompt {args.prompt_len}, new tokens {args.new_tokens}, threads {torch.get_num_threads()}")
    print(f"deepinfer (reference backend): {ours:8.1f} generated tokens/s")
    print(f"transformers generate        : {theirs:8.1f} generated tokens/s")
    print(f"ratio deepinfer / transformers: {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
