"""`deepinfer train-dspark --target DIR --data ... --out DIR`: train a DSpark drafter, then calibrate it.

Writes into --out: config.json and model.safetensors (the drafter; the target's embedding and LM head are
shared, not copied), calibration.json (STS temperatures and the ECE before / after on the calibration
traces), train_summary.json and README.md. Serve it with `speculative_engine="dspark"` and
`dspark_model=OUT`, or put it in the target's folder as `dspark/` (the default place the engine looks).
Importing this module stays cheap (no torch): deepinfer.cli registers the subcommand.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-dspark", help="train a DSpark drafter (parallel backbone + Markov head + confidence head) "
                                            "for a target checkpoint, then calibrate its confidences (STS)")
    p.add_argument("--target", type=Path, required=True, help="the target model's HF checkpoint folder")
    p.add_argument("--data", nargs="+", required=True,
                   help="text files or folders (.py/.txt/.md/.rst), or 'stdlib': the Python standard library minus "
                        "the target's heldout_files.txt")
    p.add_argument("--out", type=Path, required=True, help="folder to write the drafter into")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: fit --time-budget)")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds of training when --steps is not given")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--anchors", type=int, default=32, help="draft blocks trained per window")
    p.add_argument("--block-size", type=int, default=5, help="gamma: draft tokens per block")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--markov-rank", type=int, default=128)
    p.add_argument("--window", type=int, default=256, help="context positions a block attends to")
    p.add_argument("--target-layers", default=None, help="comma-separated target layers to read (default: up to "
                                                         "three, evenly spaced, the last included)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="backend for the target (default: auto)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="target activation dtype (default: the engine's default for the checkpoint)")
    p.add_argument("--calib-fraction", type=float, default=0.05, help="share of the data files kept for calibration")
    p.add_argument("--calib-prompts", type=int, default=512, help="prompts decoded to collect calibration drafts")
    p.add_argument("--calib-tokens", type=int, default=64, help="tokens generated per calibration prompt")
    p.add_argument("--no-calibrate", action="store_true", help="skip STS calibration")
    p.add_argument("--calibrate-only", action="store_true",
                   help="no training: refit the STS calibration of the drafter already in --out")
    p.add_argument("--pool-windows", type=int, default=512,
                   help="windows whose target features are computed once and reused with fresh anchors (0: run "
                        "the target at every step)")
    p.add_argument("--device", default=None, help="torch device to train on, e.g. cuda (default: the backend's)")
    p.add_argument("--token-cache", type=Path, default=None,
                   help="file holding the tokenised data split: written on first use, read (with its file lists) "
                        "after, so that another machine trains on exactly this split")
    p.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: 3 x hidden)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer.spec.train_pipeline import TrainDSparkOptions, run_train_dspark

    layers = None if args.target_layers is None else tuple(int(x) for x in args.target_layers.split(","))
    run_train_dspark(TrainDSparkOptions(
        target=args.target, data=list(args.data), out=args.out, steps=args.steps, time_budget=args.time_budget,
        batch_size=args.batch_size, seq_len=args.seq_len, anchors=args.anchors, block_size=args.block_size,
        layers=args.layers, markov_rank=args.markov_rank, window=args.window, target_layers=layers, lr=args.lr,
        seed=args.seed, backend=args.backend, dtype=args.dtype, calib_fraction=args.calib_fraction,
        calib_prompts=args.calib_prompts, calib_tokens=args.calib_tokens, calibrate=not args.no_calibrate,
        pool_windows=args.pool_windows, calibrate_only=args.calibrate_only, device=args.device,
        token_cache=args.token_cache, intermediate_size=args.intermediate_size,
    ))
    return 0
