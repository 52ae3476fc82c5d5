"""The programmatic-dependent-launch switch: on by default where the GPU has it, off with DEEPINFER_PDL=0, and
never under the Triton interpreter (which has no griddepcontrol); what PDL does on the GPU is covered by the
GPU suite (gpu_suite.sh tests and pdl)."""

from __future__ import annotations

import pytest

pdl = pytest.importorskip("deepinfer.backends.cuda_sm100.pdl")


@pytest.fixture(autouse=True)
def fresh_switch():
    pdl.launch_kwargs.cache_clear()
    pdl.early_trigger.cache_clear()
    yield
    pdl.launch_kwargs.cache_clear()
    pdl.early_trigger.cache_clear()


def test_off_when_asked(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.launch_kwargs() == {}


def test_default_follows_the_gpu(monkeypatch):
    import torch

    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    has_pdl = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    assert pdl.launch_kwargs() == ({"PDL": True, "launch_pdl": True} if has_pdl else {})


def test_never_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_kwargs() == {}


def test_early_triggers_only_with_pdl_and_unless_asked(monkeypatch):
    """EARLY (the MLA block's kernels letting their successor launch before their wait) goes with PDL, and
    DEEPINFER_PDL_EARLY=0 turns it off alone."""
    monkeypatch.delenv("DEEPINFER_PDL_EARLY", raising=False)
    monkeypatch.setattr(pdl, "launch_kwargs", lambda: {"PDL": True, "launch_pdl": True})
    assert pdl.early_trigger()
    pdl.early_trigger.cache_clear()
    monkeypatch.setenv("DEEPINFER_PDL_EARLY", "0")
    assert not pdl.early_trigger()
    pdl.early_trigger.cache_clear()
    monkeypatch.delenv("DEEPINFER_PDL_EARLY")
    monkeypatch.setattr(pdl, "launch_kwargs", lambda: {})
    assert not pdl.early_trigger()
