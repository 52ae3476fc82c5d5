"""The `train-tiny` subcommand's arguments; deepinfer.cli registers it. Importing this stays cheap (no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-tiny", help="train the embedded tiny DeepSeek-V3 model (with MTP) on the Python stdlib")
    p.add_argument("--out", type=Path, required=True, help="folder to write the HF checkpoint into")
    p.add_argument("--device", default="cpu", help="torch device: cuda or cpu (default cpu)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: fit --time-budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training; used to choose --steps when it is not given (default 180)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-files", type=int, default=None, help="train on a deterministic subset of files (smoke runs)")
    p.add_argument("--eval-tokens", type=int, default=131072, help="held-out tokens to evaluate")
    p.add_argument("--no-completions", action="store_true", help="skip the greedy completions in the README")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer.train.pipeline import TrainTinyOptions, run_train_tiny

    budget = args.time_budget if args.time_budget is not None or args.steps is not None else 180.0
    run_train_tiny(TrainTinyOptions(
        out=args.out, device=args.device, steps=args.steps, seed=args.seed, time_budget=budget,
        batch_size=args.batch_size, seq_len=args.seq_len, vocab_size=args.vocab_size, lr=args.lr,
        max_files=args.max_files, eval_tokens=args.eval_tokens, completions=not args.no_completions,
    ))
    return 0
