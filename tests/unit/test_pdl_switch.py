"""The programmatic-dependent-launch switch: opt-in, and never under the Triton interpreter (which has no
griddepcontrol); what PDL does on the GPU is covered by the GPU suite with DEEPINFER_PDL=1."""

from __future__ import annotations

import pytest

pdl = pytest.importorskip("deepinfer.backends.cuda_sm100.pdl")


@pytest.fixture(autouse=True)
def fresh_switch():
    pdl.launch_kwargs.cache_clear()
    yield
    pdl.launch_kwargs.cache_clear()


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.launch_kwargs() == {}


def test_never_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_kwargs() == {}
