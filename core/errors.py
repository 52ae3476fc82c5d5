"""Typed exceptions: every user-facing failure is one of these, with a message naming the problem."""


class DeepInferError(Exception):
    """Base class of every error DeepInfer raises on purpose."""


class InvalidInputError(DeepInferError, ValueError):
    """An argument (tensor, prompt, parameter) is malformed: wrong dtype, shape, device or range."""


class BackendNotFoundError(DeepInferError, LookupError):
    """No backend is registered under the requested name."""


class BackendUnavailableError(DeepInferError, RuntimeError):
    """The backend is registered but cannot run here (its probe says why)."""


class ConfigError(DeepInferError, ValueError):
    """A model or engine configuration is invalid or uses an unsupported feature."""


class CheckpointError(DeepInferError, RuntimeError):
    """A checkpoint directory is missing files, has truncated shards, or tensors of the wrong shape."""
