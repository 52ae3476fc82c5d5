"""`deepinfer` command line: subcommands for listing backends (and, as they land, serving)."""

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
