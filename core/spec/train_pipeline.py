"""The train-dspark pipeline: data -> drafter training -> save -> STS calibration -> summary and README."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.errors import ConfigError
from deepinfer.spec.calibrate import calibrate, collect_traces, prompts_from_stream, write_calibration
from deepinfer.spec.data import DataSplit, encode_files, resolve_files, split_files
from deepinfer.spec.dspark_model import DSparkConfig, DSparkModel, save_dspark
from deepinfer.spec.train import DSparkTrainer, DSparkTrainSettings, FeaturePool, TargetRunner, evaluate, train

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TrainDSparkOptions:
    target: Path
    data: list[str]
    out: Path
    steps: int | None = None
    time_budget: float = 600.0
    batch_size: int = 8
    seq_len: int = 256
    anchors: int = 32
    block_size: int = 5
    layers: int = 2
    markov_rank: int = 128
    window: int = 256
    target_layers: tuple[int, ...] | None = None
    lr: float = 2e-3
    seed: int = 0
    backend: str | None = None
    dtype: str | None = None
    calib_fraction: float = 0.05
    calib_prompts: int = 512
    calib_tokens: int = 64
    calibrate: bool = True
    pool_windows: int = 512  # windows whose target features are computed once (0: run the target every step)
    calibrate_only: bool = False  # refit the calibration of the drafter already in `out`
    device: str | None = None  # where the target and the drafter train (default: the backend's device)
    token_cache: Path | None = None  # the tokenised split, written on first use and read after (same data)
    num_heads: int = 4  # not on the CLI: tests shrink the drafter
    intermediate_size: int | None = None

    def command(self) -> str:
        budget = f"--steps {self.steps}" if self.steps else f"--time-budget {self.time_budget:g}"
        if self.calibrate_only:
            budget = "--calibrate-only"
        parts = ["deepinfer train-dspark", f"--target {self.target}", f"--data {' '.join(self.data)}",
                 f"--out {self.out}", budget]
        defaults = TrainDSparkOptions(self.target, self.data, self.out)
        for f in dataclasses.fields(self):
            if f.name in ("target", "data", "out", "steps", "time_budget", "calibrate", "num_heads",
                          "calibrate_only", "token_cache"):
                continue
            value = getattr(self, f.name)
            if value != getattr(defaults, f.name):
                shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
                parts.append(f"--{f.name.replace('_', '-')} {shown}")
        return " ".join(parts)


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Up to three target layers, evenly spaced from the first to the last."""
    m = min(3, num_layers)
    if m == 1:
        return (num_layers - 1,)
    return tuple(sorted({round(i * (num_layers - 1) / (m - 1)) for i in range(m)}))


def _hardware(device: torch.device | None = None) -> str:
    if device is not None and device.type == "cuda":
        return f"GPU ({torch.cuda.get_device_name(device)})"
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def _calibrate(opts: TrainDSparkOptions, target: Path, out: Path, calib_stream: torch.Tensor,
               log: Callable[[str], None]) -> dict:
    prompts = prompts_from_stream(calib_stream, opts.calib_prompts, 64, opts.seed)
    traces, stats = collect_traces(target, out, prompts, opts.calib_tokens, seed=opts.seed, backend=opts.backend,
                                   dtype=opts.dtype)
    calibration, report = calibrate(traces)
    report["mean_accepted_length"] = stats.mean_accepted_length
    write_calibration(out, calibration, report)
    log(f"STS: temperatures {[round(t, 3) for t in calibration.temperatures]}; mean survival ECE (expected / observed) "
        f"{report['mean_ece_before']:.4f} / {report['mean_ece_before_observed']:.4f} -> {report['mean_ece_after']:.4f} / "
        f"{report['mean_ece_after_observed']:.4f} over {report['drafts']} drafts (in-sample)")
    return report


def _token_streams(opts: TrainDSparkOptions, target: Path):
    """(split, training stream, calibration stream). With --token-cache: read from that file when it exists
    (it records the files it was encoded from, so training elsewhere, e.g. on a GPU machine whose Python has
    another standard library, uses exactly this split), else encoded here and written there."""
    cache = Path(opts.token_cache) if opts.token_cache else None
    if cache is not None and cache.exists():
        data = torch.load(cache, weights_only=True)
        names = json.loads(data["files"])
        split = DataSplit(tuple(Path(p) for p in names["train"]), tuple(Path(p) for p in names["calibration"]))
        return split, data["train"].long(), data["calibration"].long()
    split = split_files(resolve_files(opts.data, target), opts.calib_fraction, opts.seed)
    calib_stream = encode_files(target / "tokenizer.json", split.calibration or split.train)
    train_stream = encode_files(target / "tokenizer.json", split.train)
    if cache is not None:
        if max(int(train_stream.max()), int(calib_stream.max())) >= 2**15:
            raise ConfigError("--token-cache stores int16 token ids: this vocabulary is too large for it")
        names = {"train": [str(p) for p in split.train], "calibration": [str(p) for p in split.calibration]}
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"files": json.dumps(names), "train": train_stream.to(torch.int16),
                    "calibration": calib_stream.to(torch.int16)}, cache)
    return split, train_stream, calib_stream


def run_train_dspark(opts: TrainDSparkOptions, log: Callable[[str], None] = print) -> dict:
    from deepinfer.config import ModelConfig
    from deepinfer.model.loader import load_model
    from deepinfer.registry import load_backend

    t0 = time.perf_counter()
    target, out = Path(opts.target), Path(opts.out)
    config = ModelConfig.from_hf_dir(target)
    if not (target / "tokenizer.json").exists():
        raise ConfigError(f"{target} has no tokenizer.json: train-dspark tokenises --data with the target's tokenizer")
    layers = opts.target_layers or default_target_layers(config.num_hidden_layers)
    if any(not 0 <= i < config.num_hidden_layers for i in layers):
        raise ConfigError(f"--target-layers {layers}: the target has layers 0..{config.num_hidden_layers - 1}")
    split, train_stream, calib_stream = _token_streams(opts, target)

    if opts.calibrate_only:  # refit STS of the drafter already in --out (same data split, same seed)
        summary_path = out / "train_summary.json"
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else {}
        summary["calibration"] = _calibrate(opts, target, out, calib_stream, log)
        summary["calibration_command"] = opts.command()
        if "drafter" in summary:
            summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
            (out / "README.md").write_text(_readme(summary), encoding="utf-8")
        return summary

    backend = load_backend(opts.backend, device=opts.device)
    model = load_model(target, backend, config=config, dtype=_DTYPES.get(opts.dtype) if opts.dtype else None,
                       load_mtp=False, progress=False)
    if backend.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    log(f"data: {len(split.train)} training files ({train_stream.numel():,} tokens), "
        f"{len(split.calibration)} calibration files ({calib_stream.numel():,} tokens)")

    h = config.hidden_size
    dcfg = DSparkConfig(target_hidden_size=h, vocab_size=config.vocab_size, target_layers=layers, hidden_size=h,
                        num_layers=opts.layers, num_heads=opts.num_heads, head_dim=h // opts.num_heads,
                        intermediate_size=opts.intermediate_size or 3 * h, markov_rank=opts.markov_rank,
                        block_size=opts.block_size, window=opts.window)
    torch.manual_seed(opts.seed)
    drafter = DSparkModel(dcfg, model.embed_tokens, model.lm_head.dequantize()).to(backend.device)
    with torch.no_grad():
        drafter.norm.weight.copy_(model.norm.float())  # start in the LM head's input space
    settings = DSparkTrainSettings(steps=opts.steps or 10**9, batch_size=opts.batch_size, seq_len=opts.seq_len,
                                   anchors=opts.anchors, lr=opts.lr, seed=opts.seed,
                                   time_budget=None if opts.steps else opts.time_budget)
    runner = TargetRunner(model, opts.batch_size, opts.seq_len, layers)
    pool = None
    if opts.pool_windows:
        pool = FeaturePool(runner, train_stream, opts.pool_windows, torch.Generator().manual_seed(opts.seed + 3), log)
    trainer = DSparkTrainer(drafter, runner, settings, pool)
    history = train(trainer, train_stream, log)
    train_seconds = time.perf_counter() - t0
    figures = evaluate(drafter, runner, calib_stream, trainer.s, max_windows=256)
    log(f"calibration-split figures (teacher-forced): {json.dumps({k: [round(x, 3) for x in v] for k, v in figures.items()})}")
    save_dspark(out, drafter.cpu())
    report = _calibrate(opts, target, out, calib_stream, log) if opts.calibrate else None

    summary = {
        "command": opts.command(), "date": datetime.date.today().isoformat(), "hardware": _hardware(backend.device),
        "torch": torch.__version__, "target": str(target), "drafter": dcfg.to_json(),
        "parameters": sum(p.numel() for p in drafter.trainable_parameters()),
        "settings": dataclasses.asdict(trainer.s), "steps": trainer.step_num, "seconds": round(train_seconds, 1),
        "data": {"train_files": len(split.train), "train_tokens": int(train_stream.numel()),
                 "calibration_files": len(split.calibration), "calibration_tokens": int(calib_stream.numel())},
        "history": history, "calibration_split_figures": figures, "calibration": report,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(_readme(summary), encoding="utf-8")
    return summary


def _readme(s: dict) -> str:
    d, f = s["drafter"], s["calibration_split_figures"]
    cal = s["calibration"]
    lines = [
        "# DSpark drafter", "",
        f"Trained by `{s['command']}` on {s['date']} ({s['hardware']}, torch {s['torch']}): {s['steps']} steps, "
        f"{s['seconds']} s in all.", "",
        f"- Backbone: {d['num_layers']} decoder layers (hidden {d['hidden_size']}, {d['num_heads']} heads), reading target "
        f"layers {d['target_layers']} over a {d['window']}-position window; blocks of {d['block_size']} (anchor + "
        f"{d['block_size'] - 1} masks); Markov head of rank {d['markov_rank']}; confidence head on [h_k ; W1[x_(k-1)]]",
        f"- {s['parameters']:,} trained parameters (the target's embedding and LM head are shared, frozen, not stored)",
        f"- Data: {s['data']['train_files']} files, {s['data']['train_tokens']:,} tokens; calibration split "
        f"{s['data']['calibration_files']} files",
        "- Loss: 0.1 CE + 0.9 L1(p_draft, p_target) + 1.0 BCE(c_k, 1 - TV), position weights exp(-(k-1)/4)", "",
        "Teacher-forced figures on the calibration split, per block position:", "",
        "| position | " + " | ".join(str(i + 1) for i in range(len(f["accept"]))) + " |",
        "|---|" + "---|" * len(f["accept"]),
        "| expected acceptance at T=1 (1 - TV) | " + " | ".join(f"{x:.3f}" for x in f["accept"]) + " |",
        "| greedy agreement with the target | " + " | ".join(f"{x:.3f}" for x in f["top1"]) + " |",
        "| mean raw confidence | " + " | ".join(f"{x:.3f}" for x in f["conf"]) + " |", "",
    ]
    if s.get("note"):
        lines += [s["note"], ""]
    if cal:
        lines += [f"STS calibration{' (`' + s['calibration_command'] + '`)' if 'calibration_command' in s else ''} on "
                  f"{cal['drafts']} whole-block drafts decoded at T=1 from calibration-split prompts, fitted to expected "
                  f"survival: mean survival ECE against expected survival {cal['mean_ece_before']:.2%} before, "
                  f"{cal['mean_ece_after']:.2%} after; against observed 0/1 survival {cal['mean_ece_before_observed']:.2%} "
                  f"before, {cal['mean_ece_after_observed']:.2%} after (in-sample). Mean accepted length with whole "
                  f"blocks: {cal['mean_accepted_length']:.3f}.", ""]
    return "\n".join(lines)
