"""SPS(B): the target's verification steps per second at B tokens per forward, profiled once and cached.

The engine times its own runner on synthetic verification batches (sequences of 1 + k tokens over a short
cached context, logits for every row, as verification computes them) at a grid of B, at start-up. The
curve is stored as a small JSON table keyed by everything that changes it (model files, backend, dtypes,
threads, device, grid), so later starts read it instead of profiling again.

Measured step times are noisy and jagged; the curve keeps the lower convex hull of the running maximum of
the times, so time(B) is non-decreasing and convex and tau * SPS(B) is unimodal along Algorithm 1's path.

A step's time depends on how many sequences share its B tokens, not only on B (attention, sampling and the
host work per sequence): B tokens as B / (1 + k) sequences cost less than the same B as R decode sequences
with short drafts. Along Algorithm 1's path the sequences are fixed (R) and only B grows, so the engine
profiles an SPSTable: one curve per sequence count R on a grid, each over B = R, R + R, ..., R (1 + k)
tokens split evenly over exactly R sequences, and a step of R sequences reads the curve interpolated
linearly between its two neighbouring grid rows (still non-decreasing and convex in B).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.attention import AttentionBatch
from deepinfer.errors import ConfigError
from deepinfer.quant import cdiv

DEFAULT_GRID = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class SPSCurve:
    """Piecewise-linear step time over (tokens, seconds) points, convexified unless smooth=False (then the
    points as measured); sps(B) = 1 / time(B)."""

    points: tuple[tuple[int, float], ...]
    smooth: bool = True

    def __post_init__(self) -> None:
        if not self.points or any(b < 1 or not t > 0 for b, t in self.points):
            raise ConfigError(f"an SPS curve needs points (tokens >= 1, seconds > 0), got {self.points!r}")
        pts = sorted(self.points)
        hull = _convex_hull(pts) if self.smooth else [(float(b), float(t)) for b, t in pts]
        object.__setattr__(self, "_hull", hull)

    def time(self, tokens: float) -> float:
        hull: list[tuple[float, float]] = self._hull  # type: ignore[attr-defined]
        if len(hull) == 1 or tokens <= hull[0][0]:
            return hull[0][1]
        for (b0, t0), (b1, t1) in zip(hull, hull[1:]):
            if tokens <= b1:
                return t0 + (t1 - t0) * (tokens - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = hull[-2], hull[-1]
        return t1 + (t1 - t0) * (tokens - b1) / (b1 - b0)  # beyond the grid: the last slope

    def sps(self, tokens: float) -> float:
        return 1.0 / self.time(tokens)

    def to_json(self) -> list[list[float]]:
        return [[b, t] for b, t in self.points]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[float]]) -> SPSCurve:
        return cls(tuple((int(b), float(t)) for b, t in data))


def seq_grid(max_seqs: int) -> tuple[int, ...]:
    """Sequence counts profiled: powers of two up to max_seqs, and max_seqs itself."""
    out, r = [], 1
    while r < max_seqs:
        out.append(r)
        r *= 2
    return tuple(out) + (max(1, max_seqs),)


@dataclass(frozen=True)
class SPSTable:
    """Step time over (tokens, sequences): rows of (sequence count R, SPSCurve over tokens)."""

    rows: tuple[tuple[int, SPSCurve], ...]

    def __post_init__(self) -> None:
        if not self.rows or any(r < 1 for r, _ in self.rows) or len({r for r, _ in self.rows}) != len(self.rows):
            raise ConfigError(f"an SPS table needs rows of distinct sequence counts >= 1, got {[r for r, _ in self.rows]}")
        object.__setattr__(self, "rows", tuple(sorted(self.rows, key=lambda x: x[0])))

    def time(self, tokens: float, seqs: int | None = None) -> float:
        """Step time of `tokens` over `seqs` sequences (default: the largest profiled count)."""
        rows = self.rows
        if seqs is None or seqs >= rows[-1][0]:
            return rows[-1][1].time(tokens)
        if seqs <= rows[0][0]:
            return rows[0][1].time(tokens)
        for (r0, c0), (r1, c1) in zip(rows, rows[1:]):
            if seqs <= r1:
                w = (seqs - r0) / (r1 - r0)
                return (1 - w) * c0.time(tokens) + w * c1.time(tokens)
        raise AssertionError("unreachable")

    def for_seqs(self, seqs: int) -> _TableRow:
        return _TableRow(self, seqs)

    @property
    def points(self) -> tuple[tuple[int, float], ...]:
        """The largest row's measured points (what a single curve would show)."""
        return self.rows[-1][1].points

    def to_json(self) -> dict:
        return {"rows": [[r, c.to_json()] for r, c in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> SPSTable:
        return cls(tuple((int(r), SPSCurve.from_json(c)) for r, c in data["rows"]))


@dataclass(frozen=True)
class _TableRow:
    """One sequence count's view of an SPSTable, with SPSCurve's time / sps."""

    table: SPSTable
    seqs: int

    def time(self, tokens: float) -> float:
        return self.table.time(tokens, self.seqs)

    def sps(self, tokens: float) -> float:
        return 1.0 / self.time(tokens)


def step_time(curve: SPSCurve | SPSTable, tokens: float, seqs: int | None) -> float:
    return curve.time(tokens, seqs) if isinstance(curve, SPSTable) else curve.time(tokens)


def _convex_hull(points: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of the running maximum of the times (non-decreasing, convex)."""
    running, best = [], 0.0
    for b, t in points:
        best = max(best, t)
        if running and running[-1][0] == b:
            running[-1] = (b, best)
        else:
            running.append((float(b), best))
    hull: list[tuple[float, float]] = []
    for p in running:
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (p[1] - y0) - (y1 - y0) * (p[0] - x0) <= 0:  # hull[-1] lies on or above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def profile(step_seconds: Callable[[int], float], grid: Sequence[int]) -> SPSCurve:
    return SPSCurve(tuple((b, step_seconds(b)) for b in grid))


def profile_table(step_seconds: Callable[[int, int], float], seqs_grid: Sequence[int], draft_len: int) -> SPSTable:
    """step_seconds(tokens, seqs): one curve per R in seqs_grid over B = R (1 + j), j = 0..draft_len."""
    return SPSTable(tuple((r, SPSCurve(tuple((r * (1 + j), step_seconds(r * (1 + j), r)) for j in range(draft_len + 1))))
                          for r in seqs_grid))


def runner_step_timer(runner, draft_len: int, context_len: int = 64, repeats: int = 5) -> Callable[..., float]:
    """Fastest of `repeats` runner.execute on a synthetic verification batch of B tokens (the minimum: other
    processes only ever add time): `seqs` sequences sharing the B tokens evenly (default ceil(B / (1 + k))
    sequences of at most 1 + k queries each), over `context_len` cached tokens, logits for every row. All
    sequences share one block table (the cache is empty at start-up; what it holds does not matter)."""
    spec = runner.spec
    per_seq = 1 + draft_len
    ctx = max(0, min(context_len, spec.num_blocks * spec.block_size - per_seq))
    table = tuple(range(cdiv(ctx + per_seq, spec.block_size)))

    def run(tokens: int, seqs: int | None = None) -> float:
        if seqs is None:
            n = cdiv(tokens, per_seq)
            qlens = [per_seq] * (n - 1) + [tokens - per_seq * (n - 1)]
        else:
            n = max(1, min(seqs, tokens))
            if tokens > n * per_seq:
                raise ConfigError(f"{tokens} tokens over {n} sequences exceed {per_seq} per sequence")
            qlens = [tokens // n + (1 if i < tokens % n else 0) for i in range(n)]
        batch = AttentionBatch(tuple(qlens), tuple(ctx + q for q in qlens), (table,) * n)
        ids = [2 + (i % 7) for i in range(tokens)]
        rows = list(range(tokens))
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            out = runner.execute(batch, ids, rows)
            if out.logits.device.type == "cuda":
                torch.cuda.synchronize(out.logits.device)
            if i:  # the first run warms up
                times.append(time.perf_counter() - start)
        return min(times)

    return run


def default_cache_dir() -> Path:
    root = os.environ.get("DEEPINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(root) / "sps"


def cache_key(model_dir: str, backend: str, dtype: str, kv_dtype: str, draft_len: int, grid: Sequence[int],
              device: torch.device) -> dict:
    files = []
    folder = Path(model_dir)
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        if path.exists():
            st = path.stat()
            files.append([path.name, st.st_size, int(st.st_mtime)])
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} {platform.processor()}"
    return {"model": str(folder.resolve()), "files": files, "backend": backend, "dtype": dtype, "kv": kv_dtype,
            "draft_len": draft_len, "grid": list(grid), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": hw, "cpus": os.cpu_count()}


def _decode(points) -> SPSCurve | SPSTable:
    return SPSTable.from_json(points) if isinstance(points, dict) else SPSCurve.from_json(points)


def load_or_profile(cache_dir: Path | None, key: dict, measure: Callable[[], SPSCurve | SPSTable]) -> tuple[SPSCurve | SPSTable, bool]:
    """(curve, True if read from the cache). cache_dir None profiles without caching."""
    if cache_dir is None:
        return measure(), False
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir / f"sps-{digest}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("key") == key:
                return _decode(data["points"]), True
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            pass  # a damaged cache entry is re-measured
    curve = measure()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "points": curve.to_json()}, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home still runs, it just profiles at every start
    return curve, False
