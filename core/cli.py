"""`deepinfer` command line: list backends, serve (`deepinfer serve`), benchmark a server (`deepinfer bench serve`), ..."""

from __future__ import annotations

import argparse
import sys


def _cmd_backends(_args: argparse.Namespace) -> int:
    from deepinfer.registry import list_backends

    rows = [("NAME", "USABLE", "DEVICE", "CAPABILITIES", "REASON")]
    for info in list_backends():
        caps = info.capabilities.describe() if info.capabilities else "-"
        rows.append((info.name, "yes" if info.usable else "no", info.device or "-", caps, info.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: serve DeepSeek-family models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list registered backends and whether they can run here")
    p.set_defaults(func=_cmd_backends)
    from deepinfer.serve.cli import add_serve_arguments, run as run_serve  # cheap: the engine loads only when it runs

    p = sub.add_parser("serve", help="run the OpenAI-compatible server (same flags as deepinfer-serve)")
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    from deepinfer.serve.bench import add_bench_arguments, run as run_bench

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("serve", help="load generator for a running server: throughput, TTFT/ITL/E2E percentiles")
    add_bench_arguments(p)
    p.set_defaults(func=run_bench)
    from deepinfer.train.cli import add_parser as add_train_tiny_parser  # cheap: torch loads only when it runs

    add_train_tiny_parser(sub)
    from deepinfer.spec.train_cli import add_parser as add_train_dspark_parser  # cheap: torch loads only when it runs

    add_train_dspark_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
