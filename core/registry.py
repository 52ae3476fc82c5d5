"""Backend discovery and selection over the `deepinfer.backends` entry-point group (stevedore).

Listing is forgiving: a backend whose module fails to import is reported unusable with the error.
Loading one by name is strict: an unknown name or an unusable backend raises with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from stevedore import DriverManager, ExtensionManager

from deepinfer.backend import Backend, Capabilities, Probe
from deepinfer.errors import BackendNotFoundError, BackendUnavailableError

ENTRY_POINT_GROUP = "deepinfer.backends"
ENV_VAR = "DEEPINFER_BACKEND"
AUTO_ORDER = ("cuda_sm100", "ascend950")  # preferred when usable; reference is the fallback


@dataclass(frozen=True)
class BackendInfo:
    name: str
    usable: bool
    reason: str
    device: str = ""
    capabilities: Capabilities | None = None
    backend_class: type[Backend] | None = None


def _probe(cls: object) -> Probe:
    """Run a backend's probe, turning a broken probe into an unusable entry."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return Probe(False, f"entry point does not name a deepinfer Backend subclass (got {cls!r})")
    try:
        probe = cls.probe()
    except Exception as exc:  # a third-party probe must not break listing
        return Probe(False, f"probe raised {type(exc).__name__}: {exc}")
    return probe if isinstance(probe, Probe) else Probe(False, f"probe returned {probe!r}, not a Probe")


def _capabilities(cls: type[Backend]) -> Capabilities | None:
    caps = getattr(cls, "CAPABILITIES", None)
    return caps if isinstance(caps, Capabilities) else None


def registered_names() -> list[str]:
    return sorted(ExtensionManager(namespace=ENTRY_POINT_GROUP, invoke_on_load=False).entry_points_names())


def list_backends() -> list[BackendInfo]:
    """Every registered backend with whether it is usable here and why (never raises for a broken one)."""
    failures: dict[str, str] = {}

    def on_failure(_manager, entry_point, exc):
        failures[entry_point.name] = f"failed to import: {type(exc).__name__}: {exc}"

    manager = ExtensionManager(
        namespace=ENTRY_POINT_GROUP, invoke_on_load=False, on_load_failure_callback=on_failure
    )
    infos = [BackendInfo(name, False, reason) for name, reason in failures.items()]
    for ext in manager:
        probe = _probe(ext.plugin)
        cls = ext.plugin if isinstance(ext.plugin, type) and issubclass(ext.plugin, Backend) else None
        infos.append(BackendInfo(ext.name, probe.usable, probe.reason, probe.device, cls and _capabilities(cls), cls))
    return sorted(infos, key=lambda info: info.name)


def backend_class(name: str) -> type[Backend]:
    """The class registered as `name`; raises BackendNotFoundError / BackendUnavailableError."""
    names = registered_names()
    if name not in names:
        raise BackendNotFoundError(f"no backend named {name!r}; registered backends: {', '.join(names) or '(none)'}")
    try:
        cls = DriverManager(namespace=ENTRY_POINT_GROUP, name=name, invoke_on_load=False).driver
    except Exception as exc:
        raise BackendUnavailableError(f"backend {name!r} failed to import: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendUnavailableError(f"backend {name!r} does not name a deepinfer Backend subclass (got {cls!r})")
    return cls


def resolve_backend_name(name: str | None = None) -> str:
    """Explicit name > $DEEPINFER_BACKEND > auto (cuda_sm100, then ascend950, then reference)."""
    name = name or os.environ.get(ENV_VAR) or "auto"
    if name != "auto":
        return name
    infos = {info.name: info for info in list_backends()}
    for candidate in AUTO_ORDER:
        info = infos.get(candidate)
        # An accelerator backend usable only on the CPU (the Triton interpreter, for tests) is never auto-picked.
        if info is not None and info.usable and not info.device.startswith("cpu"):
            return candidate
    return "reference"


def load_backend(name: str | None = None, device: str | None = None, **options: Any) -> Backend:
    """Instantiate the selected backend, failing loudly with the probe's reason and the usable ones.

    `options` go to the backend's constructor (e.g. batch_invariant=True)."""
    resolved = resolve_backend_name(name)
    cls = backend_class(resolved)
    probe = _probe(cls)
    if not probe.usable:
        usable = [info.name for info in list_backends() if info.usable]
        raise BackendUnavailableError(
            f"backend {resolved!r} is not usable here: {probe.reason}; usable backends: {', '.join(usable) or '(none)'}"
        )
    if device is not None:
        options["device"] = device
    return cls(**options)
