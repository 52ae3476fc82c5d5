"""Verification lengths: static threshold, Algorithm 1 (against brute force, the paper's example, load), the
SPS curve (convexified, cached) and the STS calibration / ECE."""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.spec.confidence import (STSCalibration, expected_calibration_error, fit_sts, survival_ece,
                                       survival_labels)
from deepinfer.spec.prefix_scheduler import PrefixScheduler, hardware_aware_lengths, survival, threshold_lengths
from deepinfer.spec.sps_profile import SPSCurve, SPSTable, load_or_profile, profile, profile_table, seq_grid


def affine_curve(t0: float, per_token: float, top: int = 512) -> SPSCurve:
    return SPSCurve(tuple((b, t0 + per_token * b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, top)))


def test_threshold_cuts_where_survival_falls_below():
    conf = [[0.9, 0.9, 0.5, 0.99], [0.2, 0.9], [1.0, 1.0]]
    assert threshold_lengths(conf, 0.5) == [2, 0, 2]  # 0.9, 0.81, 0.405 ...
    assert threshold_lengths(conf, 0.0) == [4, 2, 2]


def test_paper_appendix_example_stops_early():
    """a_1 = 0.8, SPS(1) = 1, SPS(2) = 0.5: admitting d_1 lowers 1.0 to 0.9, so nothing is verified, whatever
    c_2 would have been (the early stop never looks at it)."""
    curve = SPSCurve(((1, 1.0), (2, 2.0), (3, 1 / 0.45)), smooth=False)  # as measured: not unimodal
    for c2 in (0.0, 0.9):
        assert hardware_aware_lengths([[0.8, c2]], curve, base_tokens=1, base_accepts=1) == [0]


def brute_force(conf, curve, base_tokens, base_accepts):
    best, best_l = -1.0, None
    for lengths in itertools.product(*[range(len(c) + 1) for c in conf]):
        tau = base_accepts + sum(sum(survival(c)[:n]) for c, n in zip(conf, lengths))
        theta = tau * curve.sps(base_tokens + sum(lengths))
        if theta > best + 1e-12:
            best, best_l = theta, lengths
    return best, best_l


def test_algorithm1_reaches_the_optimum_on_convex_curves():
    rng = random.Random(0)
    for trial in range(60):
        r = rng.randint(1, 4)
        conf = [[rng.uniform(0.2, 1.0) for _ in range(rng.randint(1, 4))] for _ in range(r)]
        curve = affine_curve(rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.5))
        lengths = hardware_aware_lengths(conf, curve, r, r)
        tau = r + sum(sum(survival(c)[:n]) for c, n in zip(conf, lengths))
        theta = tau * curve.sps(r + sum(lengths))
        assert theta == pytest.approx(brute_force(conf, curve, r, r)[0], rel=1e-9), (trial, conf, lengths)
        for c, n in zip(conf, lengths):  # admitted tokens are prefixes of the most likely survivors
            assert 0 <= n <= len(c)


def test_verification_length_falls_as_load_rises():
    rng = random.Random(1)
    curve = affine_curve(1.0, 0.02)
    means = []
    for r in (1, 4, 16, 64):
        conf = [[rng.uniform(0.5, 0.95) for _ in range(5)] for _ in range(r)]
        means.append(sum(hardware_aware_lengths(conf, curve, r, r)) / r)
    assert means == sorted(means, reverse=True) and means[0] > means[-1]


def test_prefix_scheduler_modes():
    conf = [[0.9, 0.5, 0.5], None]
    assert PrefixScheduler("fixed").lengths(conf, [3, 2], 2, 2) == [3, 2]
    assert PrefixScheduler("threshold", threshold=0.4).lengths(conf, [3, 2], 2, 2) == [2, 2]
    flat = SPSCurve(((1, 1.0),))  # free verification: admit every token with survival > 0
    assert PrefixScheduler("hardware", curve=flat).lengths(conf, [3, 2], 2, 2) == [3, 2]
    with pytest.raises(ConfigError):
        PrefixScheduler("hardware")
    with pytest.raises(ConfigError):
        PrefixScheduler("threshold", threshold=1.5)


def test_sps_curve_is_monotone_convex_and_cached(tmp_path):
    jagged = SPSCurve(((1, 1.0), (2, 0.8), (4, 1.5), (8, 1.6), (16, 4.0), (32, 4.2)))
    times = [jagged.time(b) for b in range(1, 40)]
    assert all(b >= a - 1e-12 for a, b in zip(times, times[1:]))
    slopes = [b - a for a, b in zip(times, times[1:])]
    assert all(b >= a - 1e-9 for a, b in zip(slopes, slopes[1:]))
    assert jagged.time(64) > jagged.time(32)  # extrapolated with the last slope
    calls = []

    def measure():
        calls.append(1)
        return profile(lambda b: 0.01 + 0.001 * b, (1, 4, 16))

    key = {"model": "m", "grid": [1, 4, 16]}
    first, cached = load_or_profile(tmp_path, key, measure)
    again, cached_again = load_or_profile(tmp_path, key, measure)
    assert (cached, cached_again, len(calls)) == (False, True, 1) and again == first
    other, cached_other = load_or_profile(tmp_path, {**key, "model": "n"}, measure)
    assert not cached_other and len(calls) == 2
    with pytest.raises(ConfigError):
        SPSCurve(((0, 1.0),))


def test_sps_table_reads_the_row_of_the_step_sequence_count(tmp_path):
    """Rows of affine step times whose fixed and per-token parts depend on R: time(B, R) between two grid rows
    is the linear interpolation in R, Algorithm 1 over a row reaches that row's optimum, and the table
    round-trips through the cache."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    k = 5
    fixed = {r: rng.uniform(0.5, 2.0) + 0.01 * r for r in seq_grid(32)}
    per_token = {r: rng.uniform(0.0, 0.2) for r in fixed}
    assert list(fixed) == [1, 2, 4, 8, 16, 32] and seq_grid(24) == (1, 2, 4, 8, 16, 24)
    calls = []

    def timer(tokens, seqs):
        calls.append((tokens, seqs))
        return fixed[seqs] + per_token[seqs] * tokens

    table = profile_table(timer, seq_grid(32), k)
    assert sorted(calls) == sorted((r * (1 + j), r) for r in fixed for j in range(k + 1))
    for _ in range(50):
        r, b = rng.randint(1, 40), rng.uniform(1, 250)
        lo = max([g for g in fixed if g <= r], default=1)
        hi = min([g for g in fixed if g >= r], default=32)
        w = 0.0 if hi == lo else (r - lo) / (hi - lo)

        def affine(g):  # the curve extends its first point's time below it, its last slope beyond it
            return fixed[g] + per_token[g] * max(b, g)

        assert table.time(b, r) == pytest.approx((1 - w) * affine(lo) + w * affine(hi), rel=1e-9)
    for _ in range(100):
        r = rng.randint(1, 32)  # sequences in the step; drafts from up to 3 of them (brute force stays small)
        conf = [[rng.uniform(0.05, 1.0) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 3))]
        row = table.for_seqs(r)
        lengths = hardware_aware_lengths(conf, row, r, r)
        tau = r + sum(sum(survival(c)[:n]) for c, n in zip(conf, lengths))
        assert tau * row.sps(r + sum(lengths)) == pytest.approx(brute_force(conf, row, r, r)[0], rel=1e-9)
        assert PrefixScheduler("hardware", curve=table).lengths(conf, [len(c) for c in conf], r, r, num_seqs=r) == lengths
    key = {"model": "m", "seqs": list(fixed)}
    first, cached = load_or_profile(tmp_path, key, lambda: table)
    again, cached_again = load_or_profile(tmp_path, key, lambda: None)
    assert (cached, cached_again) == (False, True) and again == table
    with pytest.raises(ConfigError):
        SPSTable(((0, table.rows[0][1]),))


def test_sts_list_form_matches_the_tensor_form():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for _ in range(20):
        temps = tuple((torch.rand(5, generator=gen) * 5 + 0.05).tolist())
        calib = STSCalibration(temps)
        n = int(torch.randint(1, 6, (1,), generator=gen))
        conf = torch.cat([torch.rand(n - 1, generator=gen, dtype=torch.float64), torch.tensor([0.0 if n % 2 else 1.0],
                                                                                            dtype=torch.float64)])
        assert calib.calibrate_list(conf.tolist()) == pytest.approx(calib.calibrate(conf).tolist(), rel=1e-12, abs=1e-15)
    with pytest.raises(ConfigError):
        STSCalibration((1.0,)).calibrate_list([0.5, 0.5])


def test_ece_and_sts_fix_overconfidence():
    gen = torch.Generator().manual_seed(0)
    n, k = 20000, 4
    true_c = torch.rand(n, k, generator=gen) * 0.8 + 0.15
    logit = torch.log(true_c / (1 - true_c))
    raw = torch.sigmoid(logit * torch.tensor([2.5, 1.8, 0.6, 3.0]))  # miscalibrated, order preserved
    survive = torch.rand(n, k, generator=gen) < true_c
    accepted = torch.where(survive.all(1), torch.tensor(k), (~survive).float().argmax(1))
    verified = torch.full((n,), k)
    survived, known = survival_labels(accepted, verified, k)
    before = survival_ece(raw, survived, known)
    calib = fit_sts(raw, survived, known)
    after = survival_ece(raw, survived, known, calib)
    assert min(before) > 0.03 and max(after) < 0.02
    assert calib.temperatures[0] == pytest.approx(2.5, rel=0.25)
    ranked = calib.calibrate(raw)
    for j in range(k):  # temperature scaling keeps each position's order
        assert (ranked[raw[:, j].argsort(), j].diff() >= 0).all()
    data = calib.to_json()
    assert STSCalibration.from_json(json.loads(json.dumps(data))) == calib
    with pytest.raises(ConfigError):
        STSCalibration.from_json({"method": "sequential_temperature_scaling", "temperatures": [0.0]})
    assert expected_calibration_error(torch.tensor([0.25, 0.75]), torch.tensor([0.0, 1.0])) == pytest.approx(0.25)
