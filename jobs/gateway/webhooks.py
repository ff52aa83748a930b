"""Webhooks: a tenant's endpoints, the events they receive, and how each delivery is signed.

Shapes are OpenAI's (``client.webhooks.create/list/retrieve/update/delete`` in the official SDK):
an endpoint has a ``name``, an ``url`` and the ``event_types`` it receives; its signing secret
(``whsec_`` + base64 of 24 random bytes) is shown when it is created or rotated, never after. An event is OpenAI's
``{"id": "evt_...", "object": "event", "created_at": ..., "type": ..., "data": {"id": ...}}``,
delivered signed with the Standard Webhooks scheme (the headers ``webhook-id``,
``webhook-timestamp`` and ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``),
which the SDK's ``client.webhooks.unwrap`` verifies.

Events enter through :func:`emit_event`, the one call an API that finishes something makes (the
Batch API's driver; :mod:`~slotq.jobs.gateway.response_watch` for background responses). It writes
a pending delivery per subscribed endpoint into Redis in one step (:class:`~slotq.jobs.gateway.records.WebhookRecords`);
:mod:`slotq.jobs.gateway.webhook_delivery` sends them, with retries, from any gateway replica.

No SSRF: an endpoint whose host resolves to an address that is not globally routable (loopback,
private, link-local, carrier-grade NAT, multicast, reserved) is refused, at registration and again
at each delivery (a name can be pointed elsewhere after registration), unless
SLOTQ_GATEWAY_WEBHOOK_ALLOW_PRIVATE is set.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import hashlib
import hmac
import ipaddress
import json
import secrets
import socket
import time
from collections.abc import Collection
from typing import Annotated, Literal, get_args
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from slotq.jobs.gateway.records import WebhookRecords
from slotq.jobs.openai.errors import ApiError

EventType = Literal["batch.completed", "batch.failed", "batch.cancelled", "batch.expired",
                    "response.completed", "response.failed", "response.cancelled", "response.incomplete"]
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)
Outcome = Literal["delivered", "retrying", "failed"]
KEEP_S = 3 * 86_400           # event markers, pending deliveries and attempt lists outlive any retry window
MAX_URL_CHARS = 2048
SECRET_PREFIX = "whsec_"


# ---------------------------------------------------------------------- the objects
def _endpoint_url(value: str) -> str:
    url_host(value)
    return value


EndpointUrl = Annotated[str, Field(min_length=1, max_length=MAX_URL_CHARS), AfterValidator(_endpoint_url)]
EndpointName = Annotated[str, Field(min_length=1, max_length=256)]
EventTypes = Annotated[list[EventType], Field(min_length=1, max_length=len(EVENT_TYPES))]


class CreateWebhookEndpoint(BaseModel):
    """The body of ``POST /v1/webhook_endpoints``."""

    model_config = ConfigDict(extra="forbid")

    name: EndpointName
    url: EndpointUrl
    event_types: EventTypes


class UpdateWebhookEndpoint(BaseModel):
    """The body of ``POST /v1/webhook_endpoints/{id}``: the fields given replace the endpoint's."""

    model_config = ConfigDict(extra="forbid")

    name: EndpointName | None = None
    url: EndpointUrl | None = None
    event_types: EventTypes | None = None


class RotateSecret(BaseModel):
    """The body of ``POST /v1/webhook_endpoints/{id}/rotate_secret``."""

    model_config = ConfigDict(extra="forbid")

    keep_old_secret_active_for_24_hours: bool = False


class WebhookEndpoint(BaseModel):
    """OpenAI's webhook endpoint object; ``signing_secret`` and ``tenant`` are kept in Redis, never
    sent (but the secret by :meth:`with_secret`, when it is created or rotated)."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    name: str
    url: str
    event_types: list[EventType]
    created_at: int
    updated_at: int
    signing_secret_hint: str
    signing_secret: str = Field(exclude=True)
    tenant: str = Field(exclude=True)
    # after a rotation that keeps the old secret for 24 hours: it, and until when it also signs
    previous_secret: str | None = Field(None, exclude=True)
    previous_secret_until: int | None = Field(None, exclude=True)

    def with_secret(self) -> WebhookEndpointWithSecret:
        return WebhookEndpointWithSecret.model_validate_json(self.stored())

    def stored(self) -> str:
        """What Redis keeps: the object, its secrets and its tenant."""
        kept = {"signing_secret": self.signing_secret, "tenant": self.tenant, "previous_secret": self.previous_secret,
                "previous_secret_until": self.previous_secret_until}      # excluded from the object, not from Redis
        return json.dumps(self.model_dump(mode="json") | kept)

    def signing_secrets(self, now: float) -> list[str]:
        """The secrets a delivery is signed with now: the current one, and the previous one in its 24 hours."""
        if self.previous_secret is not None and now < (self.previous_secret_until or 0):
            return [self.signing_secret, self.previous_secret]
        return [self.signing_secret]


class WebhookEndpointWithSecret(WebhookEndpoint):
    """The endpoint as ``POST /v1/webhook_endpoints`` returns it: the only time its secret is shown."""

    signing_secret: str


class WebhookEndpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookEndpoint]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedWebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class EventTypeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventType] = Field(default_factory=lambda: list(EVENT_TYPES))


class Delivery(BaseModel):
    """One event on its way to one endpoint. ``id`` is its ``webhook-id``, the same on every attempt
    (a receiver drops a repeat by it); ``body`` is the event exactly as signed."""

    id: str
    endpoint_id: str
    event_id: str
    type: EventType
    body: str
    created_ms: int
    attempts: int = 0


class DeliveryAttempt(BaseModel):
    """One attempt to deliver an event, as ``GET /v1/webhook_endpoints/{id}/attempts`` lists it."""

    object: Literal["webhook_endpoint.attempt"] = "webhook_endpoint.attempt"
    endpoint_id: str
    webhook_id: str
    event_id: str
    event_type: EventType
    attempt: int
    attempted_at: float
    duration_ms: int
    status_code: int | None
    error: str | None
    outcome: Outcome
    next_attempt_at: float | None


class FleetAttempt(DeliveryAttempt):
    """An attempt as stored, and as the dashboard's fleet view lists every tenant's."""

    tenant: str


class DeliveryAttemptList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeliveryAttempt]


# ---------------------------------------------------------------------- signing
def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def secret_hint(secret: str) -> str:
    """Enough of the secret to tell which one a receiver holds (4 of its 32 base64 characters)."""
    return secret[:len(SECRET_PREFIX) + 4] + "..."


def signature(secret: str, webhook_id: str, timestamp: int, body: str) -> str:
    """The Standard Webhooks signature: ``v1,`` + base64 of the HMAC-SHA256, keyed with the
    base64-decoded secret, of ``<webhook-id>.<webhook-timestamp>.<body>``."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{webhook_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(keys: list[str], webhook_id: str, body: str, timestamp: int | None = None) -> dict[str, str]:
    """The Standard Webhooks headers; with several secrets (a rotation in progress), one signature
    each, space-separated: a receiver that knows either accepts the delivery."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {"webhook-id": webhook_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(signature(key, webhook_id, timestamp, body) for key in keys)}


# ---------------------------------------------------------------------- where an endpoint is
class AddressRefused(Exception):
    """The endpoint's host is, or resolves to, an address SLOTQ_GATEWAY_WEBHOOK_ALLOW_PRIVATE must allow."""


def url_host(url: str) -> tuple[str, int]:
    """The host and port of an endpoint URL (ValueError naming what is wrong)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url[:100]!r} is not an http:// or https:// URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{url[:100]!r} has an invalid port") from None
    if not parts.hostname:
        raise ValueError(f"{url[:100]!r} names no host")
    if parts.username or parts.password:
        raise ValueError("an endpoint URL may not carry credentials (user:password@); the signature proves the sender")
    return parts.hostname, port


def _kind(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``address`` is not one to deliver to, or None for a globally routable one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):   # most telling first
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if address.is_global else "not globally routable"


async def resolve(host: str, port: int, *, allow_private: bool) -> list[str]:
    """The addresses ``host`` resolves to now; AddressRefused naming the first that is not public,
    unless private ones are allowed. Every address is checked, not just the first: a client could
    connect to any of them."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {host!r}: {exc.strerror}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not allow_private:
        for address in addresses:
            kind = _kind(ipaddress.ip_address(address.split("%")[0]))
            if kind is not None:
                shown = host if host == address else f"{host!r}, which resolves to {address}"
                raise AddressRefused(f"{shown} is a {kind} address: webhooks are delivered to public addresses only "
                                     "(set SLOTQ_GATEWAY_WEBHOOK_ALLOW_PRIVATE=true to allow private ones)")
    return addresses


# ---------------------------------------------------------------------- the endpoints
def endpoint_not_found(endpoint_id: str) -> ApiError:
    return ApiError(404, f"no webhook endpoint {endpoint_id!r}", param="webhook_endpoint_id",
                    code="webhook_endpoint_not_found")


class WebhookStore:
    """A tenant's webhook endpoints (another tenant's are looked up as ones that do not exist)."""

    def __init__(self, redis: Redis, *, allow_private: bool, tenant_max_endpoints: int) -> None:
        self.records = WebhookRecords(redis)
        self.allow_private = allow_private
        self.tenant_max_endpoints = tenant_max_endpoints

    async def check_url(self, url: str) -> None:
        """400 naming ``url`` when its host is refused or does not resolve."""
        try:
            await resolve(*url_host(url), allow_private=self.allow_private)
        except (AddressRefused, OSError) as exc:
            raise ApiError.invalid(f"url: {exc}", "url", code="invalid_url") from None

    async def create(self, request: CreateWebhookEndpoint, tenant: str) -> WebhookEndpoint:
        await self.check_url(request.url)
        if len(await self.records.endpoint_ids(tenant)) >= self.tenant_max_endpoints:
            raise ApiError.invalid(f"this tenant has {self.tenant_max_endpoints} webhook endpoints, the most "
                                   "SLOTQ_GATEWAY_WEBHOOK_TENANT_MAX_ENDPOINTS allows; delete one first", None,
                                   code="too_many_webhook_endpoints")
        now = int(time.time())
        secret = new_secret()
        endpoint = WebhookEndpoint(id="we_" + secrets.token_hex(12), name=request.name, url=request.url,
                                   event_types=list(dict.fromkeys(request.event_types)), created_at=now,
                                   updated_at=now, signing_secret_hint=secret_hint(secret), signing_secret=secret,
                                   tenant=tenant)
        await self.records.put_endpoint(endpoint.id, tenant, endpoint.stored(), created_ms=time.time_ns() // 1_000_000)
        return endpoint

    async def find(self, endpoint_id: str) -> WebhookEndpoint | None:
        raw = await self.records.get_endpoint(endpoint_id)
        return WebhookEndpoint.model_validate_json(raw) if raw else None

    async def get(self, endpoint_id: str, tenant: str) -> WebhookEndpoint:
        endpoint = await self.find(endpoint_id)
        if endpoint is None or endpoint.tenant != tenant:
            raise endpoint_not_found(endpoint_id)
        return endpoint

    async def of_tenant(self, tenant: str) -> list[WebhookEndpoint]:
        """The tenant's endpoints, newest first."""
        raws = await self.records.get_endpoints(await self.records.endpoint_ids(tenant))
        return [WebhookEndpoint.model_validate_json(raw) for raw in raws if raw]

    async def list(self, tenant: str, *, limit: int, after: str | None) -> WebhookEndpointList:
        endpoints = await self.of_tenant(tenant)
        if after is not None:
            ids = [e.id for e in endpoints]
            if after not in ids:
                raise ApiError.invalid(f"after: no webhook endpoint {after!r}", "after")
            endpoints = endpoints[ids.index(after) + 1:]
        data = endpoints[:limit]
        return WebhookEndpointList(data=data, first_id=data[0].id if data else None,
                                   last_id=data[-1].id if data else None, has_more=len(endpoints) > limit)

    async def update(self, endpoint_id: str, tenant: str, request: UpdateWebhookEndpoint) -> WebhookEndpoint:
        endpoint = await self.get(endpoint_id, tenant)
        if request.url is not None:
            await self.check_url(request.url)
        changes = request.model_dump(exclude_none=True)
        if changes:
            endpoint = endpoint.model_copy(update={**changes, "updated_at": int(time.time())})
            await self.records.put_endpoint(endpoint.id, tenant, endpoint.stored(), created_ms=None)
        return endpoint

    async def rotate_secret(self, endpoint_id: str, tenant: str, *, keep_old: bool) -> WebhookEndpoint:
        """A new secret; with ``keep_old``, deliveries carry a signature with the old one too for 24
        hours (OpenAI's ``keep_old_secret_active_for_24_hours``), so receivers can switch in that time."""
        endpoint = await self.get(endpoint_id, tenant)
        now = int(time.time())
        secret = new_secret()
        endpoint = endpoint.model_copy(update={
            "signing_secret": secret, "signing_secret_hint": secret_hint(secret), "updated_at": now,
            "previous_secret": endpoint.signing_secret if keep_old else None,
            "previous_secret_until": now + 86_400 if keep_old else None})
        await self.records.put_endpoint(endpoint.id, tenant, endpoint.stored(), created_ms=None)
        return endpoint

    async def delete(self, endpoint_id: str, tenant: str) -> DeletedWebhookEndpoint:
        await self.get(endpoint_id, tenant)
        await self.records.remove_endpoint(endpoint_id, tenant)
        return DeletedWebhookEndpoint(id=endpoint_id)

    async def attempts(self, endpoint_id: str, tenant: str, limit: int) -> DeliveryAttemptList:
        await self.get(endpoint_id, tenant)
        raws = await self.records.attempts(endpoint_id, limit)
        return DeliveryAttemptList(data=[DeliveryAttempt.model_validate_json(raw) for raw in raws])

    async def fleet_attempts(self, limit: int) -> builtins.list[FleetAttempt]:  # builtins: this class has a list()
        """Every tenant's most recent attempts (the dashboard: admin keys only)."""
        return [FleetAttempt.model_validate_json(raw) for raw in await self.records.attempts(None, limit)]


# ---------------------------------------------------------------------- events
def event_id(tenant: str, type: EventType, data_id: str) -> str:
    """An event's id follows from what it says: emitting it again (a driver that retried after a
    crash) names the same event, which is then not delivered twice."""
    return "evt_" + hashlib.sha256(f"{tenant}\0{type}\0{data_id}".encode()).hexdigest()[:32]


async def subscribed_endpoints(records: WebhookRecords, tenant: str,
                               types: Collection[EventType]) -> list[WebhookEndpoint]:
    """The tenant's endpoints that receive any of ``types`` (one read when it has none)."""
    raws = await records.get_endpoints(await records.endpoint_ids(tenant))
    return [e for e in (WebhookEndpoint.model_validate_json(raw) for raw in raws if raw)
            if not set(types).isdisjoint(e.event_types)]


async def emit_event(redis: Redis, tenant: str, type: EventType, data_id: str) -> str:
    """Deliver the event ``type`` about the object ``data_id`` (a batch's or a response's id) to every
    endpoint of ``tenant`` that subscribes to it, with retries, from whichever gateway replica is up.

    ``type`` is one of :data:`EVENT_TYPES`: ``batch.completed`` / ``.failed`` / ``.cancelled`` /
    ``.expired`` (the Batch API's driver emits them) and ``response.completed`` / ``.failed`` /
    ``.cancelled`` / ``.incomplete`` (a background response that ends). Call it once the object's
    final state is stored (a receiver fetches it by ``data.id``). Cheap when the tenant has no
    endpoint (one read). Returns the event's id; calling again for the same (tenant, type, data_id)
    adds nothing.
    """
    if type not in EVENT_TYPES:
        raise ValueError(f"type: {type!r} is not a webhook event type ({', '.join(EVENT_TYPES)})")
    records = WebhookRecords(redis)
    evt = event_id(tenant, type, data_id)
    endpoints = await subscribed_endpoints(records, tenant, {type})
    if not endpoints:
        return evt
    now_ms = time.time_ns() // 1_000_000
    body = Event(id=evt, created_at=now_ms // 1000, type=type, data=EventData(id=data_id)).model_dump_json()
    deliveries = {}
    for endpoint in endpoints:
        delivery = Delivery(id="wh_" + secrets.token_hex(16), endpoint_id=endpoint.id, event_id=evt, type=type,
                            body=body, created_ms=now_ms)
        deliveries[(endpoint.id, delivery.id)] = delivery.model_dump_json()
    await records.emit(evt, deliveries, due_ms=now_ms, keep_s=KEEP_S)
    return evt


class EventData(BaseModel):
    id: str


class Event(BaseModel):
    """OpenAI's webhook event."""

    id: str
    object: Literal["event"] = "event"
    created_at: int
    type: EventType
    data: EventData
