"""Fixtures of the conformance tests that exercise the cuda_sm100 backend's launchers directly."""

from __future__ import annotations

import pytest


@pytest.fixture
def cuda_backend():
    """The cuda_sm100 backend (on CPU its kernels run under the Triton interpreter); skipped where unusable."""
    from deepinfer.registry import list_backends, load_backend

    if not any(info.name == "cuda_sm100" and info.usable for info in list_backends()):
        pytest.skip("cuda_sm100 is not usable here")
    return load_backend("cuda_sm100")


@pytest.fixture
def kern(backend):
    """The backend under test where it is cuda_sm100 (its kernels beyond the op contract); skipped elsewhere."""
    if backend.name != "cuda_sm100":
        pytest.skip("cuda_sm100 kernel tests")
    return backend


@pytest.fixture
def ref():
    """The reference backend: what every other backend is compared with."""
    from deepinfer.registry import load_backend

    return load_backend("reference")
