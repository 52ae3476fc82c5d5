"""Backend discovery and selection: stevedore listing, strict loading, env/auto selection, third-party plugins."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import deepinfer
from deepinfer.errors import BackendNotFoundError, BackendUnavailableError
from deepinfer.registry import list_backends, load_backend, resolve_backend_name


def _infos():
    return {info.name: info for info in list_backends()}


def test_builtin_backends_are_registered_and_reference_is_usable():
    infos = _infos()
    assert {"reference", "cuda_sm100", "ascend950"} <= set(infos)
    assert infos["reference"].usable
    for name in ("cuda_sm100", "ascend950"):
        assert infos[name].reason, f"{name} must explain its probe result"
        assert infos[name].capabilities is not None


def test_unknown_name_lists_registered_backends():
    with pytest.raises(BackendNotFoundError) as err:
        load_backend("nosuch")
    for name in ("reference", "cuda_sm100", "ascend950"):
        assert name in str(err.value)


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BACKEND", "nosuch")
    with pytest.raises(BackendNotFoundError, match="registered backends: .*reference"):
        deepinfer.load_backend()
    monkeypatch.setenv("DEEPINFER_BACKEND", "reference")
    assert deepinfer.load_backend().name == "reference"


def test_explicit_name_beats_env(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BACKEND", "nosuch")
    assert load_backend("reference").name == "reference"


def test_auto_picks_a_usable_backend(monkeypatch):
    monkeypatch.delenv("DEEPINFER_BACKEND", raising=False)
    name = resolve_backend_name(None)
    assert _infos()[name].usable
    if not _infos()["cuda_sm100"].usable and not _infos()["ascend950"].usable:
        assert name == "reference"


def test_unusable_backend_fails_with_probe_reason():
    infos = _infos()
    unusable = [n for n in ("cuda_sm100", "ascend950") if not infos[n].usable]
    if not unusable:
        pytest.skip("every built-in backend is usable on this machine")
    with pytest.raises(BackendUnavailableError) as err:
        load_backend(unusable[0])
    assert infos[unusable[0]].reason in str(err.value)
    assert "usable backends: " in str(err.value) and "reference" in str(err.value)


def _write_plugin_dist(root, dist: str, module: str, entry_points: dict[str, str], source: str) -> None:
    """A minimal installed distribution: a module plus a dist-info with entry points, on `root`."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[deepinfer.backends]\n{lines}\n")


PLUGIN_SOURCE = """
    import torch
    from deepinfer.backend import Capabilities, Probe
    from deepinfer.backends.reference import ReferenceBackend

    class ToyBackend(ReferenceBackend):
        name = "toy"
        CAPABILITIES = Capabilities(frozenset({"bf16"}), frozenset({"fp32"}), False, "gloo")

        @classmethod
        def probe(cls):
            return Probe(True, "toy plugin from a separate distribution", "cpu")

    class ShyBackend(ReferenceBackend):
        name = "shy"

        @classmethod
        def probe(cls):
            return Probe(False, "shy needs hardware this machine lacks")

    class RaisingProbeBackend(ReferenceBackend):
        name = "raising"

        @classmethod
        def probe(cls):
            raise RuntimeError("driver exploded")
"""


def test_third_party_plugins_are_listed_and_loadable(tmp_path):
    """Runs in a subprocess so the extra distribution on sys.path cannot leak into other tests."""
    _write_plugin_dist(
        tmp_path,
        "toy_backend",
        "toy_backend_mod",
        {
            "toy": "toy_backend_mod:ToyBackend",
            "shy": "toy_backend_mod:ShyBackend",
            "raising": "toy_backend_mod:RaisingProbeBackend",
            "broken": "toy_backend_missing_module:Nothing",
        },
        PLUGIN_SOURCE,
    )
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import pytest
        from deepinfer.errors import BackendUnavailableError
        from deepinfer.registry import list_backends, load_backend
        infos = {{i.name: i for i in list_backends()}}
        assert infos["toy"].usable and infos["toy"].reason.startswith("toy plugin"), infos["toy"]
        assert not infos["shy"].usable and "lacks" in infos["shy"].reason
        assert not infos["raising"].usable and "driver exploded" in infos["raising"].reason
        assert not infos["broken"].usable and "toy_backend_missing_module" in infos["broken"].reason
        assert infos["reference"].usable
        backend = load_backend("toy")
        assert type(backend).__name__ == "ToyBackend" and str(backend.device) == "cpu"
        for name, text in (("shy", "lacks"), ("broken", "failed to import"), ("raising", "driver exploded")):
            with pytest.raises(BackendUnavailableError, match=text):
                load_backend(name)
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_cli_lists_backends():
    result = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "backends"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "USABLE", "DEVICE", "CAPABILITIES"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["reference"].split()[1] == "yes"
    for name in ("cuda_sm100", "ascend950"):
        assert name in rows


def test_backend_module_import_is_cheap():
    """Importing the GPU/NPU backends must not import triton or torch_npu (listing stays safe)."""
    script = (
        "import sys; import deepinfer.backends.cuda_sm100, deepinfer.backends.ascend950; "
        "from deepinfer.registry import list_backends; list_backends(); "
        "print(sorted(m for m in ('triton', 'torch_npu') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
