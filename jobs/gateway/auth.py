"""API keys (a Bearer token, or Anthropic's ``x-api-key`` header) and the tenant each belongs to.

Keys come from ``SLOTQ_API_KEYS``, ``SLOTQ_ADMIN_KEYS`` and ``SLOTQ_API_KEYS_FILE`` (``name=key``
entries; a bare key is a tenant of its own). A request's key gives its :class:`Caller`: the tenant
whose jobs, streams, files and batches it may see, and whether it may see the whole fleet
(``/api``, the dashboard's data). With no keys configured every request is let in as the default
tenant with the fleet view, and the server refuses to bind anything but loopback (see
``GatewaySettings.bind_error``; :mod:`slotq.jobs.gateway.limits` guards that mode against DNS rebinding
and cross-origin posts).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from slotq.jobs.gateway.settings import GatewaySettings, KeyEntry, check_key_entries, key_entries, read_keys_file
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.keys import DEFAULT_TENANT

log = logging.getLogger(__name__)

KEYS_FILE_CHECK_S = 1.0      # how often the keys file's modification time is looked at


@dataclass(frozen=True)
class Caller:
    tenant: str
    admin: bool


KEYLESS_CALLER = Caller(DEFAULT_TENANT, admin=True)


def _digest(key: str) -> bytes:
    """Keys are looked up by their hash, so the lookup's timing says nothing about the key."""
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Every configured key, by hash. The keys file is re-read when it changes (checked at most
    every KEYS_FILE_CHECK_S, off the event loop: the file may sit on a slow volume), so a key is
    added or retired without a restart; a file that cannot be read or parsed, or that repeats a key
    (:func:`~slotq.jobs.gateway.settings.check_key_entries`), keeps the keys read last, with a warning."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.required = settings.has_keys
        self._allow_default = settings.gateway_allow_default_tenant_keys
        self._fixed_entries = settings.fixed_key_entries()
        self._fixed = {_digest(e.key): Caller(e.tenant, e.admin) for e in self._fixed_entries}
        self._file = settings.api_keys_file
        self._file_keys: dict[bytes, Caller] = {}
        self._file_mtime: float | None = None
        self._checked_at = time.monotonic()
        if self._file is not None:           # at start, before the loop runs: no request waits for a first read
            self._reload_file(self._file)

    async def caller(self, key: str) -> Caller | None:
        if self._file is not None and time.monotonic() - self._checked_at >= KEYS_FILE_CHECK_S:
            self._checked_at = time.monotonic()      # before the await: one reader at a time
            await asyncio.to_thread(self._reload_file, self._file)
        digest = _digest(key)
        return self._fixed.get(digest) or self._file_keys.get(digest)

    def _reload_file(self, path: Path) -> None:
        try:
            mtime = path.stat().st_mtime
            if mtime == self._file_mtime:
                return
            entries: list[KeyEntry] = key_entries(read_keys_file(path), str(path))
            check_key_entries(self._fixed_entries + entries, allow_default_tenant=self._allow_default)
            self._file_keys = {_digest(e.key): Caller(e.tenant, admin=False) for e in entries}
            self._file_mtime = mtime
            log.info("API keys file %s read: %d keys", path, len(self._file_keys))
        except (OSError, ValueError) as exc:
            log.warning("API keys file %s not re-read (%s); keeping the %d keys read before",
                        path, exc, len(self._file_keys))


async def authenticate(request: Request) -> Caller:
    """The caller of this request, from its ``Authorization: Bearer`` key, or its ``x-api-key``
    header as Anthropic's SDKs send the key (401 without a valid one)."""
    keys: KeyRing = request.app.state.keys
    if not keys.required:
        return KEYLESS_CALLER
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
    caller = await keys.caller(key) if key else None
    if caller is None:
        raise ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') "
                            "with a key from SLOTQ_API_KEYS", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return caller


async def require_admin(caller: Annotated[Caller, Depends(authenticate)]) -> Caller:
    """The fleet view (every queue, worker and dead letter) is for admin keys only."""
    if not caller.admin:
        raise ApiError(403, "this is the fleet view of every tenant: it needs a key from SLOTQ_ADMIN_KEYS",
                       type="permission_error", code="admin_key_required")
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]
