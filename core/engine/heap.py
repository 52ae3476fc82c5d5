"""Keeping Python's garbage collector off a serving process's long-lived heap.

A full (oldest-generation) collection walks every tracked object: after start-up that is the model's modules,
the captured decode graphs' bookkeeping and whatever loading left behind. It cost ~100 ms every ~100 decode
steps at 256 sequences (benchmarks/host_overhead.py --gc-freeze). (A 350 ms EP step seen after an EPLB
rebalance on 2 H200s was later traced to benchmarks/ep_e2e.py's own profiler garbage, not to the engine.)
`gc.freeze()` moves every object alive now into a permanent generation that collections skip, as vLLM's
engine process does after start-up. Reference counting still frees those objects; only garbage cycles among
them are never reclaimed, so this is for processes that serve one engine (the server and its EP ranks,
benchmarks), not for library users who build and drop engines.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exempt everything alive from later collections."""
    gc.collect()
    gc.freeze()


def refreeze() -> None:
    """After a long-lived part was rebuilt (decode graphs captured again): freeze it too, if this process froze
    its heap (freeze_startup_heap); otherwise leave the collector as the user set it."""
    if gc.get_freeze_count():
        freeze_startup_heap()
