"""The explicit package list in pyproject.toml must cover every package folder, in the source tree and the wheel."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"core": "deepinfer", "backends": "deepinfer.backends"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_in_tree() -> set[str]:
    found = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    return found


def test_every_package_folder_is_declared():
    declared = set(_pyproject()["tool"]["setuptools"]["packages"])
    in_tree = _packages_in_tree()
    assert in_tree - declared == set(), "package folders missing from [tool.setuptools] packages"
    assert declared - in_tree == set(), "declared packages without an __init__.py"


def test_package_dir_mapping():
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"deepinfer": "core", "deepinfer.backends": "backends"}


def test_torch_npu_only_in_ascend_extra():
    project = _pyproject()["project"]
    assert not any("torch-npu" in dep or "torch_npu" in dep for dep in project["dependencies"])
    assert any("torch-npu" in dep for dep in project["optional-dependencies"]["ascend"])


@pytest.mark.slow
def test_wheel_contains_every_package_and_entry_point(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    wheel = next(tmp_path.glob("deepinfer-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for package in _packages_in_tree():
        assert package.replace(".", "/") + "/__init__.py" in names, f"{package} is missing from the wheel"
    for backend in ("reference", "cuda_sm100", "ascend950"):
        assert f"{backend} = deepinfer.backends" in entry_points
    assert "deepinfer = deepinfer.cli:main" in entry_points
    assert not any(n.startswith(("core/", "backends/")) for n in names), "folders must be installed under deepinfer/"
    # The embedded default model is package data of deepinfer.models: every file of its folder ships.
    model_dir = ROOT / "core" / "models" / "deepseek_v3_tiny"
    for f in (p for p in model_dir.rglob("*") if p.is_file()):  # dspark/ (its drafter) included
        rel = f.relative_to(model_dir).as_posix()
        assert f"deepinfer/models/deepseek_v3_tiny/{rel}" in names, f"{rel} of the embedded model is missing from the wheel"
