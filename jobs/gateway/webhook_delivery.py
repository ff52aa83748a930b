"""Sending webhook deliveries: every gateway replica runs one :class:`WebhookSender`.

The pending deliveries live in Redis (:class:`~slotq.jobs.gateway.records.WebhookRecords`): a
record each, and a sorted set by the time each is due. The sender claims due ones in a script that
moves each claimed one's due time to the end of a lease (the attempt's timeout and a margin), so no
other replica sends the same attempt meanwhile; a replica that dies mid-attempt leaves the
delivery to be claimed again when the lease runs out. After the attempt, one script records it in
the endpoint's recent attempts and retires the delivery (delivered, or out of retries) or sets its
next due time; if the lease had run out by then, only the record is written.

At least once: a 2xx answer retires a delivery; anything else (an error status, a redirect, which
is never followed, a refused or timed-out connection, a refused address) is retried after
``base * 4^(n-1)`` seconds (capped at SLOTQ_GATEWAY_WEBHOOK_RETRY_MAX_S, less up to a quarter at
random so retries of many deliveries spread out) until SLOTQ_GATEWAY_WEBHOOK_RETRY_FOR_S after the
event. Its ``webhook-id`` is the same on every attempt.

A slow or dead endpoint harms nobody else: each attempt has SLOTQ_GATEWAY_WEBHOOK_TIMEOUT_S, DNS
included; a replica runs at most SLOTQ_GATEWAY_WEBHOOK_ENDPOINT_CONCURRENCY attempts per endpoint
and SLOTQ_GATEWAY_WEBHOOK_CONCURRENCY in all; and due deliveries to an endpoint with no room left
are passed over by the claim (and moved behind the others when they fill its look), not waited
for, so the others' deliveries behind them go out.

No SSRF at delivery: the endpoint's host is resolved at each attempt, every address checked
(:func:`~slotq.jobs.gateway.webhooks.resolve`), and the request sent to the checked address (the
Host header and TLS server name stay the endpoint's), so a name re-pointed after the check is not
followed either. No proxies from the environment, no kept-alive connections (one would be keyed
by address, not name), no redirects.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import random
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from slotq.jobs.aio import wait_until_set
from slotq.jobs.gateway.records import Claim, WebhookRecords
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.gateway.webhooks import (
    KEEP_S,
    AddressRefused,
    Delivery,
    FleetAttempt,
    Outcome,
    WebhookEndpoint,
    resolve,
    signed_headers,
    url_host,
)

log = logging.getLogger(__name__)

POLL_S = 0.5              # how often a replica looks for due deliveries (emitters in other processes cannot wake it)
LEASE_MARGIN_S = 10.0     # a claim outlives its attempt's timeout by this much


def retry_delay_s(settings: GatewaySettings, attempts: int) -> float:
    """The wait after the ``attempts``-th failed attempt: ``base * 4^(attempts-1)``, capped, less
    up to a quarter at random. With the defaults (5 s, capped at 4 h): 5 s, 20 s, 80 s, 5 min,
    21 min, 85 min, then every 4 h, about 12 attempts in the day."""
    delay: float = min(settings.gateway_webhook_retry_base_s * 4.0 ** (attempts - 1),
                       settings.gateway_webhook_retry_max_s)
    return delay * random.uniform(0.75, 1.0)


def pinned(url: str, address: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``url`` sent to ``address``: the URL with the address as its host, the Host header, and the
    TLS server name (certificates are still checked against the endpoint's name)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ipaddress.ip_address(address.split("%")[0]).version == 6 else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    extensions = {"sni_hostname": parts.hostname or ""} if parts.scheme == "https" else {}
    return urlunsplit(parts._replace(netloc=netloc)), {"Host": parts.netloc}, extensions


class WebhookSender:
    def __init__(self, redis: Redis, settings: GatewaySettings) -> None:
        self.records = WebhookRecords(redis)
        self.settings = settings
        self.timeout_s = settings.gateway_webhook_timeout_s
        self.lease_ms = int((self.timeout_s + LEASE_MARGIN_S) * 1000)
        self.http = httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=self.timeout_s,
                                      limits=httpx.Limits(max_keepalive_connections=0))
        self._in_flight: dict[str, int] = {}         # endpoint id -> attempts running on this replica
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._send_forever(), name="slotq-webhook-sender")

    @property
    def running(self) -> bool:
        return self._loop is not None and not self._loop.done()

    async def close(self) -> None:
        """Stop; the attempts cut short are claimed again (by any replica) when their leases run out."""
        tasks = [t for t in (self._loop, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.http.aclose()

    async def _send_forever(self) -> None:
        while True:
            try:
                await self._claim_due()
            except (RedisError, OSError) as exc:
                log.warning("webhook deliveries not claimed (%s: %s); retrying", type(exc).__name__, exc)
            await wait_until_set(self._wake, POLL_S)
            self._wake.clear()

    async def _claim_due(self) -> None:
        room = self.settings.gateway_webhook_concurrency - len(self._tasks)
        if room <= 0:
            return
        per_endpoint = self.settings.gateway_webhook_endpoint_concurrency
        claims = await self.records.claim(
            now_ms=time.time_ns() // 1_000_000, lease_ms=self.lease_ms, count=room, endpoint_room=per_endpoint,
            rooms={endpoint: per_endpoint - n for endpoint, n in self._in_flight.items()})
        for claim in claims:
            self._in_flight[claim.endpoint_id] = self._in_flight.get(claim.endpoint_id, 0) + 1
            task = asyncio.get_running_loop().create_task(self._deliver(claim), name=f"slotq-{claim.delivery_id}")
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._ended, endpoint_id=claim.endpoint_id))

    def _ended(self, task: asyncio.Task[None], *, endpoint_id: str) -> None:
        self._tasks.discard(task)
        left = self._in_flight.pop(endpoint_id, 1) - 1
        if left > 0:
            self._in_flight[endpoint_id] = left
        self._wake.set()            # room again: claim more now, not at the next poll

    async def _deliver(self, claim: Claim) -> None:
        try:
            raw = await self.records.get_delivery(claim.delivery_id)
            endpoint_raw = await self.records.get_endpoint(claim.endpoint_id)
            if raw is None or endpoint_raw is None:       # the endpoint was deleted (or the record expired)
                await self.records.drop(claim)
                return
            delivery = Delivery.model_validate_json(raw)
            endpoint = WebhookEndpoint.model_validate_json(endpoint_raw)
            started = time.time()
            status, error = await self._post(endpoint, delivery)
            await self._record(claim, delivery, endpoint.tenant, started, status, error)
        except (RedisError, OSError) as exc:
            log.warning("webhook delivery %s: Redis unavailable (%s); it is retried when its lease runs out",
                        claim.delivery_id, exc)
        except Exception:       # logged, never raised into the sender: the lease brings it back
            log.exception("webhook delivery %s failed; it is retried when its lease runs out", claim.delivery_id)

    async def _post(self, endpoint: WebhookEndpoint, delivery: Delivery) -> tuple[int | None, str | None]:
        """The endpoint's status code, and why the attempt failed (None: delivered)."""
        headers = signed_headers(endpoint.signing_secrets(time.time()), delivery.id, delivery.body)
        headers |= {"Content-Type": "application/json", "User-Agent": "slotq-webhooks"}
        try:
            async with asyncio.timeout(self.timeout_s):
                [address, *_] = await resolve(*url_host(endpoint.url),
                                              allow_private=self.settings.gateway_webhook_allow_private)
                url, host, extensions = pinned(endpoint.url, address)
                async with self.http.stream("POST", url, content=delivery.body.encode(), headers=headers | host,
                                            extensions=extensions) as response:
                    status = response.status_code          # the body is never read: an endpoint's answer is its status
                    location = response.headers.get("location")
        except AddressRefused as exc:
            return None, f"refused: {exc}"
        except TimeoutError:
            return None, f"no answer within {self.timeout_s:g} s (SLOTQ_GATEWAY_WEBHOOK_TIMEOUT_S)"
        except (httpx.HTTPError, OSError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:500]
        if 200 <= status < 300:
            return status, None
        if 300 <= status < 400:
            return status, f"HTTP {status}: redirects are not followed (to {str(location)[:200]!r})"
        return status, f"HTTP {status}"

    async def _record(self, claim: Claim, delivery: Delivery, tenant: str, started: float, status: int | None,
                      error: str | None) -> None:
        attempts = delivery.attempts + 1
        now = time.time()
        next_at: float | None = None
        if error is not None:
            next_at = now + retry_delay_s(self.settings, attempts)
            if next_at > delivery.created_ms / 1000 + self.settings.gateway_webhook_retry_for_s:
                next_at = None
        outcome: Outcome = "delivered" if error is None else "retrying" if next_at is not None else "failed"
        attempt = FleetAttempt(tenant=tenant, endpoint_id=delivery.endpoint_id, webhook_id=delivery.id,
                               event_id=delivery.event_id, event_type=delivery.type, attempt=attempts,
                               attempted_at=round(started, 3), duration_ms=int((now - started) * 1000),
                               status_code=status, error=error, outcome=outcome,
                               next_attempt_at=None if next_at is None else round(next_at, 3))
        held = await self.records.finish(
            claim, attempt=attempt.model_dump_json(), next_due_ms=None if next_at is None else int(next_at * 1000),
            record=delivery.model_copy(update={"attempts": attempts}).model_dump_json(), keep_s=KEEP_S)
        if outcome != "delivered":
            log.info("webhook %s to %s: attempt %d %s (%s)", delivery.id, delivery.endpoint_id, attempts, outcome,
                     error)
        if not held:
            log.warning("webhook %s: its lease ran out during the attempt; another gateway may send it again",
                        delivery.id)

