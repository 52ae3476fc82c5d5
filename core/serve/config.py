"""ServeConfig: what the HTTP layer needs beyond the engine's own EngineConfig."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deepinfer.errors import ConfigError

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any prompt the largest context window holds as JSON
DEFAULT_MAX_QUEUED_REQUESTS = 1024


class ServeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    served_model_names: tuple[str, ...] = Field(min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = Field(default=None, repr=False)  # never printed in logs or reprs
    # Requests beyond the running batch (max_num_seqs) that may wait; more get 503 + Retry-After.
    max_queued_requests: int = Field(default=DEFAULT_MAX_QUEUED_REQUESTS, ge=0)
    max_request_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, gt=0)
    # SIGTERM: in-flight requests get this long to finish before they are aborted.
    drain_timeout: float = Field(default=30.0, ge=0)
    speculative_engine: str = "none"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ConfigError(f"invalid server configuration: {problems}") from None

    @field_validator("api_key")
    @classmethod
    def _non_empty_key(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("an API key must not be empty or blank")
        return value
