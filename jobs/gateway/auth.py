"""Optional Bearer API keys (``SLOTQ_API_KEYS``). With none configured every request is let in,
and the server refuses to bind anything but loopback (see ``GatewaySettings.bind_error``)."""

from __future__ import annotations

import hmac

from fastapi import Request

from jobs.gateway.errors import ApiError


async def require_key(request: Request) -> None:
    keys: list[str] = request.app.state.gateway.settings.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip().encode()
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, key.encode()) for key in keys):
        raise ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with a key from SLOTQ_API_KEYS",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
