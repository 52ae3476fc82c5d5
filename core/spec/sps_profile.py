"""SPS(B): the target's verification steps per second at B tokens per forward, profiled once and cached.

The engine times its own runner on synthetic verification batches (sequences of 1 + k tokens over a short
cached context, logits for every row, as verification computes them) at a grid of B, at start-up. The
curve is stored as a small JSON table keyed by everything that changes it (model files, backend, dtypes,
threads, device, grid), so later starts read it instead of profiling again.

Measured step times are noisy and jagged; the curve keeps the lower convex hull of the running maximum of
the times, so time(B) is non-decreasing and convex and tau * SPS(B) is unimodal along Algorithm 1's path.
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


def runner_step_timer(runner, draft_len: int, context_len: int = 64, repeats: int = 5) -> Callable[[int], float]:
    """Fastest of `repeats` runner.execute on a synthetic verification batch of B tokens (the minimum: other
    processes only ever add time): ceil(B / (1 + k))
    sequences of at most 1 + k queries each, over `context_len` cached tokens, logits for every row. All
    sequences share one block table (the cache is empty at start-up; what it holds does not matter)."""
    spec = runner.spec
    per_seq = 1 + draft_len
    ctx = max(0, min(context_len, spec.num_blocks * spec.block_size - per_seq))
    table = tuple(range(cdiv(ctx + per_seq, spec.block_size)))

    def run(tokens: int) -> float:
        n = cdiv(tokens, per_seq)
        qlens = [per_seq] * (n - 1) + [tokens - per_seq * (n - 1)]
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


def load_or_profile(cache_dir: Path | None, key: dict, measure: Callable[[], SPSCurve]) -> tuple[SPSCurve, bool]:
    """(curve, True if read from the cache). cache_dir None profiles without caching."""
    if cache_dir is None:
        return measure(), False
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir / f"sps-{digest}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("key") == key:
                return SPSCurve.from_json(data["points"]), True
        except (OSError, ValueError, KeyError, ConfigError):
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
