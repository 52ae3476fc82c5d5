"""Shared fixtures: the backends under test and fresh random generators."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# Shared test helpers (tiny checkpoints made with transformers) importable from every test folder.
sys.path.insert(0, str(Path(__file__).parent / "support"))

# The test models are tiny: intra-op threads cost more than they give (20x slower seen on 2 busy cores).
torch.set_num_threads(1)

# Without a GPU, run the cuda_sm100 Triton kernels on CPU tensors under the Triton interpreter, so the
# conformance suite covers them in CI. Must be set before triton is first imported.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def backends_under_test() -> list[str]:
    """Usable registered backends, narrowed by DEEPINFER_TEST_BACKENDS (comma-separated)."""
    from deepinfer.registry import list_backends

    usable = [info.name for info in list_backends() if info.usable]
    wanted = os.environ.get("DEEPINFER_TEST_BACKENDS")
    if wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        missing = [n for n in names if n not in usable]
        if missing:
            raise pytest.UsageError(f"DEEPINFER_TEST_BACKENDS names unusable backends: {missing}; usable: {usable}")
        return names
    return usable


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", backends_under_test())


@pytest.fixture
def backend(backend_name):
    from deepinfer.registry import load_backend

    return load_backend(backend_name)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded freshly per test (seed printed on failure through the test id's log); set
    DEEPINFER_TEST_SEED to replay a failure's seed."""
    seed = int(os.environ.get("DEEPINFER_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random seed: {seed}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g
