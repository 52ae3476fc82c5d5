"""Held-out figures of a model (main next-token loss, perplexity, accuracy; MTP next-next-token accuracy)
and greedy completions of prompts through `deepinfer.LLM` on an exported folder."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.backend import Backend
from deepinfer.model.deepseek import DeepseekModel
from deepinfer.train.trainer import forward_logits, prefill_plan

PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
)


def heldout_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of seq_len + 2 tokens (input, next and next-next targets)."""
    length = seq_len + 2
    n = min(stream.numel() // length, max(1, max_tokens // seq_len))
    return stream[: n * length].view(n, length)


@torch.no_grad()
def evaluate(model: DeepseekModel, backend: Backend, stream: torch.Tensor, seq_len: int, batch_size: int,
             max_tokens: int = 131072) -> dict[str, float]:
    """Mean over held-out target tokens: main loss / perplexity / top-1 accuracy, MTP loss / top-1 accuracy on
    token t+2 (teacher-forced with the true token t+1, as in training)."""
    windows = heldout_windows(stream.to(backend.device), seq_len, max_tokens)
    sums = {"main_nll": 0.0, "main_correct": 0.0, "mtp_nll": 0.0, "mtp_correct": 0.0}
    count = 0
    for start in range(0, windows.shape[0], batch_size):
        tokens = windows[start : start + batch_size]
        plan = prefill_plan(backend, model.config, tokens.shape[0], seq_len)
        logits, mtp_logits = forward_logits(model, backend, plan, tokens)
        target = tokens[:, 1 : seq_len + 1].reshape(-1)
        sums["main_nll"] += F.cross_entropy(logits, target, reduction="sum").item()
        sums["main_correct"] += (logits.argmax(-1) == target).sum().item()
        if mtp_logits is not None:
            target2 = tokens[:, 2 : seq_len + 2].reshape(-1)
            sums["mtp_nll"] += F.cross_entropy(mtp_logits, target2, reduction="sum").item()
            sums["mtp_correct"] += (mtp_logits.argmax(-1) == target2).sum().item()
        count += target.numel()
    loss = sums["main_nll"] / count
    return {
        "tokens": count,
        "loss": loss,
        "perplexity": math.exp(loss),
        "accuracy": sums["main_correct"] / count,
        "mtp_loss": sums["mtp_nll"] / count,
        "mtp_accuracy": sums["mtp_correct"] / count,
    }


def greedy_completions(folder: Path, prompts: tuple[str, ...] = PROMPTS, max_tokens: int = 64) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from the exported folder, greedy, on the reference backend (CPU)."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(folder), backend="reference", kv_cache_memory=64 << 20, max_num_seqs=len(prompts), progress=False)
    outputs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [(p, out.outputs[0].text) for p, out in zip(prompts, outputs)]
