"""Run a function on N spawned CPU ranks (gloo) with a hard deadline: nothing a test starts can hang CI."""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

# Hang guards, not speed limits: CI's two cores are shared by a test's ranks and the other pytest-xdist worker,
# and on a slow day (2026-12-01) test_comm's two ranks ran past a 120 s deadline that had sufficed before. So the
# deadline of a spawned run and the collectives' timeout inside it are generous; a real hang still ends.
RANKS_DEADLINE_S = 600.0
COLLECTIVE_TIMEOUT_S = 300


def run_ranks(fn: Callable, world: int, args: tuple, tmp: Path, timeout_s: float = RANKS_DEADLINE_S) -> list[object]:
    """fn(rank, world, store_path, *args) on `world` spawned processes; returns each rank's torch.save'd result
    from tmp/out{rank}.pt (fn writes it via save_result). Kills every child past the deadline."""
    ctx = mp.start_processes(_entry, args=(fn, world, str(tmp), args, timeout_s), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(tmp / f"out{r}.pt", weights_only=False) for r in range(world)]


def _entry(rank: int, fn: Callable, world: int, tmp: str, args: tuple, timeout_s: float) -> None:
    # A hung collective shows where each rank waits: every thread's stack, just before the parent kills it.
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 5), exit=False)
    torch.set_num_threads(1)  # two cores shared by every rank and the test itself
    result = fn(rank, world, f"file://{tmp}/store", *args)
    torch.save(result, f"{tmp}/out{rank}.pt")
    # The result is on disk: skip interpreter teardown, where torch's gloo objects can race their own
    # threads ("terminate called without an active exception") after the process group is gone.
    os._exit(0)
