"""benchmarks/e2e.py's graph-replay timeline under PDL, where kernels start early and wait: the path column (how
much later each kernel ends than the one before it) adds up to each replay's span whatever the overlap, and the
layer chain starts at the kernel launched once a layer."""

from __future__ import annotations

import random

import pytest

from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def e2e():
    return load_benchmark("e2e")


def replays(layers: int, count: int, rng: random.Random) -> list[tuple[float, float, str]]:
    """`count` replays of a model of `layers` layers (a head kernel, then norm, rope, attention, gemv a layer),
    each kernel starting before its predecessor ends (PDL) and ending after it; 1 ms between replays."""
    acts, t = [], 0.0
    for _ in range(count):
        start, end = t, t + 3.0
        acts.append((start, 3.0, "embed"))
        for _ in range(layers):
            for name in ("norm", "rope", "attn", "gemv", "gemv"):
                start = start + rng.uniform(0.1, 2.0)
                new_end = end + rng.uniform(0.5, 9.0)
                acts.append((start, new_end - start, name))
                end = new_end
        t = end + 1000.0
    return acts


def test_the_path_column_adds_up_to_each_replay(e2e, capsys):
    rng = random.Random(5)
    acts = replays(4, 3, rng)
    per_replay = len(acts) // 3
    spans = [acts[i + per_replay - 1][0] + acts[i + per_replay - 1][1] - acts[i][0]
             for i in range(0, len(acts), per_replay)]
    e2e._print_timeline(acts, 3, "t", 10, max_gap=50.0)
    rows = capsys.readouterr().out.splitlines()[2:]  # under the summary and the header, a row a kernel name
    path = sum(float(row.split()[-1]) for row in rows)  # printed to 0.1
    assert len(rows) == 5 and path == pytest.approx(sum(spans) / 3, abs=0.05 * len(rows))


def test_the_layer_chain_starts_at_the_kernel_launched_once_a_layer(e2e, capsys):
    acts = replays(6, 1, random.Random(7))
    e2e._print_layer_chain(acts, 6)
    lines = capsys.readouterr().out.splitlines()
    assert "from layer 3 (of 6)" in lines[0]
    assert [line.split()[-1] for line in lines[1:]] == ["norm", "rope", "attn", "gemv", "gemv"] * 2
    e2e._print_layer_chain(acts, 5)  # no kernel launched exactly five times: nothing printed
    assert capsys.readouterr().out == ""
    e2e._print_layer_chain(replays(2, 1, random.Random(8)), 2)  # two layers: the second one, to the end
    assert [line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]] == ["norm", "rope", "attn",
                                                                                        "gemv", "gemv"]
