"""Gateway settings: the producer's settings plus what an HTTP server needs (``SLOTQ_`` prefix)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from slotq.jobs.protocol.keys import DEFAULT_TENANT
from slotq.jobs.protocol.schemas import TENANT_PATTERN
from slotq.jobs.settings import ClientSettings

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def key_tenant(key: str) -> str:
    """The tenant of a key given without a name: its own, named after a hash of it (the name
    shows in job ids, so it must not reveal the key)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_key_entries(entries: list[str], where: str) -> list[tuple[str, str]]:
    """``name=key`` entries (several keys may share a name: one tenant, keys to rotate) and bare
    keys (a tenant each) as (tenant, key) pairs. Errors name the entry by position, never by its
    text, which holds a key."""
    pairs = []
    for number, entry in enumerate(entries, 1):
        name, sep, key = entry.partition("=")
        if not sep:
            pairs.append((key_tenant(entry), entry))
        elif not re.fullmatch(TENANT_PATTERN, name) or not key.strip("="):
            raise ValueError(f"{where}: entry {number} is neither a key nor name=key (a name is 1-64 characters of "
                             "A-Z a-z 0-9 _ -; a key that contains '=' needs a name: name=key)")
        else:
            pairs.append((name, key))
    return pairs


@dataclass(frozen=True)
class KeyEntry:
    """One configured key, and where it was given (for errors, which never show the key)."""

    tenant: str
    key: str
    admin: bool
    where: str              # "SLOTQ_API_KEYS entry 2"

    @property
    def named(self) -> str:
        return f"{self.where} (tenant {self.tenant!r})"


def key_entries(pairs: list[tuple[str, str]], where: str, *, admin: bool = False) -> list[KeyEntry]:
    """(tenant, key) pairs from :func:`parse_key_entries` as entries that know their place."""
    return [KeyEntry(tenant, key, admin, f"{where} entry {number}") for number, (tenant, key) in enumerate(pairs, 1)]


def check_key_entries(entries: list[KeyEntry], *, allow_default_tenant: bool) -> None:
    """Refuse the two key configurations that silently do what nobody meant (ValueError naming the
    entries, never a key):

    * one key in two entries: the lookup would keep one of them, so a tenant's key would quietly
      act as another tenant's (or as an admin's), and its own jobs would turn into 404s;
    * a key for the ``default`` tenant, unless SLOTQ_GATEWAY_ALLOW_DEFAULT_TENANT_KEYS says it is
      meant: that tenant owns every job enqueued without one (``slotq enqueue``, the Python client)
      and everything made in keyless mode, so its key reads all of them.
    """
    seen: dict[str, KeyEntry] = {}
    for entry in entries:
        if entry.tenant == DEFAULT_TENANT and not allow_default_tenant:
            raise ValueError(f"{entry.where} gives a key to the reserved tenant {DEFAULT_TENANT!r}, which owns every "
                             "job enqueued without a tenant (slotq enqueue, the Python client) and everything made "
                             "without keys: name another tenant, or set SLOTQ_GATEWAY_ALLOW_DEFAULT_TENANT_KEYS=true "
                             "if that key is meant to read them")
        if entry.key in seen:
            raise ValueError(f"{entry.named} has the same key as {seen[entry.key].named}: a key must belong to one "
                             "entry (one tenant, admin or not); give each its own key")
        seen[entry.key] = entry


def read_keys_file(path: Path) -> list[tuple[str, str]]:
    """The keys file: one ``name=key`` (or bare key) per line; blank lines and ``#`` comments skipped."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    return parse_key_entries([line for line in lines if line and not line.startswith("#")], str(path))


class GatewaySettings(ClientSettings):
    # A settings error must not print the keys it was given.
    model_config = SettingsConfigDict(hide_input_in_errors=True)

    gateway_host: str = Field("127.0.0.1", description="address to bind; anything but loopback needs SLOTQ_API_KEYS")
    gateway_port: int = Field(8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated Bearer keys, each 'tenant=key' or a bare key (a tenant of "
                                          "its own); no keys at all = no auth, loopback only")
    api_keys_file: Path | None = Field(
        None, description="a file of more keys, one 'tenant=key' per line, re-read when it changes (rotation "
                          "without a restart)")
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated keys ('name=key' or bare) that also see the whole fleet: "
                                          "the dashboard's /api (workers, queues, dead letters, requeue)")
    gateway_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="without API keys: Host names served besides loopback ones (DNS "
                                          "rebinding protection); comma-separated")
    gateway_max_body_mb: float = Field(4.0, gt=0, description="largest request body (413 above it); a file upload "
                                                              "has SLOTQ_GATEWAY_MAX_FILE_MB instead")
    gateway_max_metadata_bytes: int = Field(16_384, ge=0, description="largest `metadata` of a job, as JSON")
    gateway_response_ttl_s: int = Field(
        86_400, ge=60, description="how long a stored response (store, previous_response_id) is kept; never longer "
                                   "than its job's result (SLOTQ_KEEP_RESULT_S), which holds its output")
    gateway_response_max_items: int = Field(
        1000, ge=1, description="most items a stored conversation holds (previous_response_id chains included)")
    gateway_header_timeout_s: float = Field(10.0, gt=0, le=3600, description="a request's headers must arrive within "
                                                                              "this long, or the connection is closed")
    gateway_body_timeout_s: float = Field(60.0, gt=0, le=86_400, description="a request's whole body must arrive "
                                                                             "within this long (408 after)")
    gateway_allow_default_tenant_keys: bool = Field(
        False, description="allow keys for the reserved tenant 'default', which owns every job enqueued without a "
                           "tenant and everything made without keys (refused at start unless this is set)")
    gateway_metrics_port: int = Field(
        0, ge=0, le=65535, description="a second, private port on SLOTQ_GATEWAY_HOST serving only /metrics (with "
                                       "the per-tenant families), the detailed /health and /ready, with no key: "
                                       "for Prometheus inside the cluster, never published; 0 = off")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated origins allowed by CORS ('*' for any, with API keys "
                                          "only); empty = no CORS")
    gateway_keep_on_disconnect: bool = Field(
        False, description="default for requests that do not say: keep a job running when its streaming client leaves")
    gateway_keepalive_s: float = Field(
        5.0, gt=0, le=60, description="SSE comment sent when a stream is quiet this long")
    gateway_retry_after_s: int = Field(2, ge=1, description="Retry-After of a 429 when the queue is full, or a "
                                                               "tenant's waiting or in-flight quota is reached")
    gateway_routing_ttl_s: float = Field(
        1.0, gt=0, le=60, description="how long the model -> queue map from heartbeats is reused")
    gateway_model_memory_s: int = Field(
        86_400, ge=0, description="a model seen this recently but with no live worker is a 503, not a 404")
    gateway_files_dir: Path | None = Field(
        None, description="where uploaded files and batch outputs are kept (a volume every replica shares); "
                          "unset = <SLOTQ_DATA_DIR>/gateway-files")
    gateway_max_file_mb: int = Field(
        200, ge=1, description="largest file POST /v1/files accepts (OpenAI's batch limit)")
    gateway_tenant_max_files: int = Field(
        1000, ge=1, description="files one tenant may keep (uploads and batch outputs); an upload past it is a 400")
    gateway_tenant_max_files_mb: int = Field(
        10_240, ge=1, description="MB of files one tenant may keep (uploads and batch outputs); an upload past it is "
                                  "a 400")
    gateway_file_expiry_s: int = Field(
        30 * 86_400, ge=1, description="a file's lifetime when its upload sets no expires_after (OpenAI's default "
                                       "for batch files: 30 days); batch outputs get it too")
    gateway_batch_lease_s: float = Field(
        30.0, ge=1, le=3600, description="a batch whose gateway stopped renewing its lease this long is resumed "
                                         "by another")
    gateway_batch_window: int = Field(256, ge=1, le=100_000, description="lines of one batch in Redis at once")
    gateway_webhook_allow_private: bool = Field(
        False, description="allow webhook endpoints on loopback, private, link-local and other non-public addresses "
                           "(checked at registration and at each delivery); off = no SSRF into the network")
    gateway_webhook_timeout_s: float = Field(
        10.0, gt=0, le=60, description="one webhook attempt, DNS to status line; no answer by then is a failed "
                                       "attempt")
    gateway_webhook_retry_base_s: float = Field(
        5.0, gt=0, le=3600, description="the wait after a webhook's first failed attempt; each next wait is 4 times "
                                        "longer")
    gateway_webhook_retry_max_s: float = Field(
        4 * 3600, gt=0, le=86_400, description="the longest wait between two attempts of a webhook")
    gateway_webhook_retry_for_s: int = Field(
        86_400, ge=1, le=2 * 86_400, description="how long after its event a webhook is retried before it is given up")
    gateway_webhook_endpoint_concurrency: int = Field(
        4, ge=1, le=1000, description="webhook attempts at once to one endpoint, per gateway replica")
    gateway_webhook_concurrency: int = Field(
        64, ge=1, le=10_000, description="webhook attempts at once, per gateway replica")
    gateway_webhook_tenant_max_endpoints: int = Field(
        20, ge=1, le=10_000, description="webhook endpoints one tenant may register")

    @property
    def files_dir(self) -> Path:
        return self.gateway_files_dir or self.data_dir / "gateway-files"

    @field_validator("api_keys", "admin_keys", "cors_origins", "gateway_allowed_hosts", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _keys_parse(self) -> GatewaySettings:
        """Bad key entries, duplicate keys, an unmeant key for the default tenant or an unreadable keys
        file stop the gateway at start, not at the first request."""
        entries = self.fixed_key_entries()
        if self.api_keys_file is not None:
            try:
                entries += key_entries(read_keys_file(self.api_keys_file), str(self.api_keys_file))
            except OSError as exc:
                raise ValueError(f"SLOTQ_API_KEYS_FILE: cannot read {self.api_keys_file}: {exc.strerror}") from None
        check_key_entries(entries, allow_default_tenant=self.gateway_allow_default_tenant_keys)
        return self

    @model_validator(mode="after")
    def _no_open_cors_without_keys(self) -> GatewaySettings:
        """Without keys the gateway trusts every request that reaches it from this machine; what keeps a
        web page the user visits out is the browser's same-origin rule, and '*' switches it off."""
        if "*" in self.cors_origins and not self.has_keys:
            raise ValueError("SLOTQ_CORS_ORIGINS=*: without API keys every request from this machine is trusted, "
                             "so '*' would let any web page the user visits read the gateway and post jobs to it. "
                             "List the origins that may call it, or set SLOTQ_API_KEYS")
        return self

    @model_validator(mode="after")
    def _metrics_port_apart(self) -> GatewaySettings:
        if self.gateway_metrics_port and self.gateway_metrics_port == self.gateway_port:
            raise ValueError(f"SLOTQ_GATEWAY_METRICS_PORT={self.gateway_metrics_port} is SLOTQ_GATEWAY_PORT: the "
                             "private metrics port must be another one")
        return self

    def fixed_key_entries(self) -> list[KeyEntry]:
        """The keys given in SLOTQ_API_KEYS and SLOTQ_ADMIN_KEYS (the keys file is read apart: it changes)."""
        return (key_entries(parse_key_entries(self.api_keys, "SLOTQ_API_KEYS"), "SLOTQ_API_KEYS")
                + key_entries(parse_key_entries(self.admin_keys, "SLOTQ_ADMIN_KEYS"), "SLOTQ_ADMIN_KEYS", admin=True))

    @property
    def has_keys(self) -> bool:
        """Whether requests must carry a key (else every request is let in, from loopback only)."""
        return bool(self.api_keys or self.admin_keys or self.api_keys_file)

    def bind_error(self, host: str) -> str | None:
        """Why ``host`` must not be bound with these settings, or None."""
        if not self.has_keys and host not in LOOPBACK_HOSTS:
            return (f"refusing to bind {host}: no API keys are configured, so the gateway serves 127.0.0.1 only. "
                    "Set SLOTQ_API_KEYS=key1,key2 to serve other hosts.")
        return None
