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
