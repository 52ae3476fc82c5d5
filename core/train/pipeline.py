"""`deepinfer train-tiny`: corpus -> tokenizer -> training -> HF folder -> held-out figures and README.

With --time-budget and no --steps, a few throwaway steps time the machine and fix the step count before the
real run starts from the seed again; the README records the resulting `--steps N` command, which reproduces
the run (up to GPU kernels' non-determinism).
"""

from __future__ import annotations

import datetime
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import ModelConfig
from deepinfer.train.corpus import build_corpus, write_heldout_list
from deepinfer.train.evaluate import evaluate, greedy_completions
from deepinfer.train.export import write_checkpoint
from deepinfer.train.model_init import count_params, hf_config, trainable
from deepinfer.train.report import write_report
from deepinfer.train.tokenizer_train import encode_documents, save_tokenizer, train_tokenizer
from deepinfer.train.trainer import Trainer, TrainSettings, seconds_per_step


@dataclass
class TrainTinyOptions:
    out: Path
    device: str = "cpu"
    steps: int | None = None
    seed: int = 0
    time_budget: float | None = None  # seconds of training, used to pick steps when steps is None
    batch_size: int = 32
    seq_len: int = 512
    vocab_size: int = 6144
    lr: float = 3e-3
    max_files: int | None = None
    eval_tokens: int = 131072
    completions: bool = True
    model_overrides: dict[str, Any] = field(default_factory=dict)  # smaller dims for tests; not on the CLI

    def command(self, steps: int) -> str:
        """The CLI line that reproduces this run."""
        parts = ["deepinfer train-tiny", f"--out {Path(self.out).name}", f"--device {self.device}", f"--steps {steps}", f"--seed {self.seed}"]
        defaults = TrainTinyOptions(out=self.out)
        for f in fields(self):
            if f.name in ("out", "device", "steps", "seed", "time_budget", "completions", "model_overrides"):
                continue
            value = getattr(self, f.name)
            if value != getattr(defaults, f.name):
                parts.append(f"--{f.name.replace('_', '-')} {value}")
        return " ".join(parts)


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x {torch.cuda.get_device_name(device)}"
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def _stream(docs: list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor([t for d in docs for t in d], dtype=torch.int64, device=device)


def run_train_tiny(opts: TrainTinyOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    device = torch.device(opts.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the reference ops compute in float32; TF32 keeps it fast
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    corpus = build_corpus(opts.seed, max_files=opts.max_files)
    train_texts = corpus.texts(corpus.train)
    tok = train_tokenizer(train_texts, opts.vocab_size)
    train_stream = _stream(encode_documents(tok, train_texts), device)
    heldout_stream = _stream(encode_documents(tok, corpus.texts(corpus.heldout)), device)
    log(f"corpus: {len(corpus.train)} train files ({train_stream.numel():,} tokens), {len(corpus.heldout)} held-out "
        f"({heldout_stream.numel():,} tokens); tokenizer vocab {tok.get_vocab_size()} [{time.perf_counter() - t0:.0f}s]")

    hf = hf_config(tok.get_vocab_size(), **opts.model_overrides)
    config = ModelConfig.from_hf_dict(hf)
    settings = TrainSettings(batch_size=opts.batch_size, seq_len=opts.seq_len, lr=opts.lr, seed=opts.seed)
    steps = opts.steps
    calibration = None
    if steps is None:
        if opts.time_budget is None:
            raise ValueError("give steps or time_budget")
        per_step = seconds_per_step(config, settings, opts.device, train_stream)
        steps = max(1, int(opts.time_budget / per_step))
        calibration = {"time_budget": opts.time_budget, "ms_per_step": round(per_step * 1000, 1)}
        log(f"calibration: {per_step * 1000:.0f} ms/step -> {steps} steps in {opts.time_budget:.0f}s")
    settings = TrainSettings(**{**settings.__dict__, "steps": steps, "warmup_steps": min(settings.warmup_steps, max(1, steps // 10))})

    trainer = Trainer(config, settings, opts.device)
    log(f"model: {count_params(trainable(trainer.params)):,} trained parameters; {steps} steps of "
        f"{settings.batch_size}x{settings.seq_len}")
    recent: list[tuple[float, float]] = []
    t_train = time.perf_counter()
    for step in range(steps):
        m = trainer.step(train_stream)
        if step % 25 == 0 or step >= steps - 20:
            main, mtp = m["main"].item(), m["mtp"].item()
            if step >= steps - 20:
                recent.append((main, mtp))
            if step % 25 == 0 or step == steps - 1:
                log(f"step {step:5d}  loss {m['loss'].item():.4f}  main {main:.4f}  mtp {mtp:.4f}  "
                    f"gnorm {m['grad_norm'].item():.2f}  lr {settings.lr_at(step):.2e}  [{time.perf_counter() - t_train:.0f}s]")
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t_train

    eval_float = evaluate(trainer.model(), trainer.backend, heldout_stream, settings.seq_len, settings.batch_size, opts.eval_tokens)
    log(f"held-out (float32): {eval_float}")
    write_checkpoint(out, hf, trainer.params)
    save_tokenizer(tok, out, hf["max_position_embeddings"])
    write_heldout_list(corpus, out)

    from deepinfer.model.loader import load_model
    from deepinfer.registry import load_backend

    backend = load_backend("reference", device=opts.device)
    shipped = load_model(out, backend, dtype=torch.float32, progress=False)
    eval_exported = evaluate(shipped, backend, heldout_stream, settings.seq_len, settings.batch_size, opts.eval_tokens)
    log(f"held-out (shipped FP8): {eval_exported}")
    completions = greedy_completions(out) if opts.completions else []
    for prompt, text in completions:
        log(f"--- {prompt!r} ->\n{prompt}{text}")

    summary = {
        "command": opts.command(steps),
        "date": datetime.date.today().isoformat(),
        "hardware": _hardware(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": hf,
        "params": count_params(trainable(trainer.params)),
        "train_files": len(corpus.train),
        "heldout_files": len(corpus.heldout),
        "train_tokens": train_stream.numel(),
        "heldout_tokens": heldout_stream.numel(),
        "steps": steps,
        "calibration": calibration,  # how --time-budget chose steps, when it did
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "lr": settings.lr,
        "mtp_lambda": settings.mtp_lambda,
        "bias_gamma": settings.bias_gamma,
        "train_seconds": train_seconds,
        "final_train_main": sum(r[0] for r in recent) / max(1, len(recent)),
        "final_train_mtp": sum(r[1] for r in recent) / max(1, len(recent)),
        "eval_float": eval_float,
        "eval_exported": eval_exported,
        "completions": completions,
        "total_seconds": time.perf_counter() - t0,
    }
    write_report(out, summary)
    log(f"wrote {out} in {summary['total_seconds']:.0f}s")
    return summary


if __name__ == "__main__":  # pragma: no cover - the CLI is deepinfer.cli
    sys.exit("use: deepinfer train-tiny --out DIR")
