"""Gateway settings: the producer's settings plus what an HTTP server needs (``SLOTQ_`` prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from jobs.settings import ClientSettings

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class GatewaySettings(ClientSettings):
    gateway_host: str = Field("127.0.0.1", description="address to bind; anything but loopback needs SLOTQ_API_KEYS")
    gateway_port: int = Field(8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated Bearer keys; empty = no auth, loopback only")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated origins allowed by CORS ('*' for any); empty = no CORS")
    gateway_keep_on_disconnect: bool = Field(
        False, description="default for requests that do not say: keep a job running when its streaming client leaves")
    gateway_keepalive_s: float = Field(5.0, gt=0, le=60, description="SSE comment sent when a stream is quiet this long")
    gateway_retry_after_s: int = Field(2, ge=1, description="Retry-After of a 429 when the queue is full")
    gateway_routing_ttl_s: float = Field(1.0, gt=0, le=60, description="how long the model -> queue map from heartbeats is reused")
    gateway_model_memory_s: int = Field(
        86_400, ge=0, description="a model seen this recently but with no live worker is a 503, not a 404")
    gateway_files_dir: Path | None = Field(
        None, description="where uploaded files and batch outputs are kept (a volume every replica shares); "
                          "unset = <SLOTQ_DATA_DIR>/gateway-files")
    gateway_max_file_mb: int = Field(200, ge=1, description="largest file POST /v1/files accepts (OpenAI's batch limit)")
    gateway_batch_lease_s: float = Field(
        30.0, ge=1, le=3600, description="a batch whose gateway stopped renewing its lease this long is resumed by another")
    gateway_batch_window: int = Field(256, ge=1, le=100_000, description="lines of one batch in Redis at once")

    @property
    def files_dir(self) -> Path:
        return self.gateway_files_dir or self.data_dir / "gateway-files"

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def bind_error(self, host: str) -> str | None:
        """Why ``host`` must not be bound with these settings, or None."""
        if not self.api_keys and host not in LOOPBACK_HOSTS:
            return (f"refusing to bind {host}: no API keys are configured, so the gateway serves 127.0.0.1 only. "
                    "Set SLOTQ_API_KEYS=key1,key2 to serve other hosts.")
        return None
