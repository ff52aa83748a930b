"""Webhooks end to end: real Valkey, real ``slotq gateway`` processes, a real HTTP receiver on
127.0.0.1 (allowed by SLOTQ_GATEWAY_WEBHOOK_ALLOW_PRIVATE, except where the refusal is the test),
signatures checked with the ``standardwebhooks`` package and the ``openai`` SDK's ``unwrap``.

Events come from a finished batch (a real worker on the tiny model) and from
:func:`~slotq.jobs.gateway.webhooks.emit_event` called here, as the Responses API calls it.
Backoff is 0.2 s, doubling to at most 1 s, so retries happen within the test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import standardwebhooks
from openai import OpenAI

from slotq.jobs.gateway.records import WebhookKeys, WebhookRecords
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.gateway.webhook_delivery import retry_delay_s
from slotq.jobs.gateway.webhooks import AddressRefused, EventType, emit_event, resolve
from slotq.jobs.protocol.connection import connect
from tests.support import free_port
from tests.support.gateway import GatewayProcess, Stack

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-webhooks"
KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
FAST_RETRIES: dict[str, Any] = {"gateway_webhook_retry_base_s": 0.2, "gateway_webhook_retry_max_s": 1,
                                "gateway_webhook_timeout_s": 2}


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float


class Receiver:
    """An HTTP server on 127.0.0.1 that answers 200 (or hangs until stopped) and keeps every POST;
    it can be down (nothing listening on its port) and come back on the same port."""

    def __init__(self, *, hang: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hooks"
        self.received: list[Received] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.hang = hang
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver.in_flight += 1
                    receiver.most_in_flight = max(receiver.most_in_flight, receiver.in_flight)
                try:
                    if receiver.hang:
                        receiver._released.wait(60)
                        return
                    with receiver._lock:
                        receiver.received.append(Received(dict(self.headers.items()), body, time.monotonic()))
                    self.send_response(200)
                    self.end_headers()
                finally:
                    with receiver._lock:
                        receiver.in_flight -= 1

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def ids(self) -> Counter[str]:
        with self._lock:
            return Counter(r.headers["webhook-id"] for r in self.received)


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(*, hang: bool = False, started: bool = True) -> Receiver:
        receiver = Receiver(hang=hang)
        if started:
            receiver.start()
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("webhooks"), tiny_model_path) as s:
        yield s


def start_gateway(stack: Stack, name: str, *, allow_private: bool = True, **settings: Any) -> GatewayProcess:
    gateway = stack.start_gateway(name, api_keys=",".join(f"{t}={k}" for t, k in KEYS.items()),
                                  admin_keys="ops=key-ops", gateway_files_dir=stack.cwd / "files",
                                  gateway_webhook_allow_private=allow_private, **(FAST_RETRIES | settings))
    gateway.wait_ready()
    return gateway


@pytest.fixture
def gateway(stack: Stack) -> Iterator[GatewayProcess]:
    g = start_gateway(stack, f"gateway-{len(stack.gateways) + 1}")
    try:
        yield g
    finally:
        g.stop()


def sdk(url: str, tenant: str = "alpha") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=30)


def register(url: str, receiver: Receiver, tenant: str = "alpha",
             event_types: tuple[str, ...] = ("response.completed",)) -> tuple[str, str]:
    """The endpoint's id and signing secret."""
    endpoint = sdk(url, tenant).webhooks.create(name=f"{tenant}-hooks", url=receiver.url,
                                                event_types=list(event_types))  # type: ignore[arg-type]
    return endpoint.id, endpoint.signing_secret


def emit(stack: Stack, tenant: str, data_ids: list[str], type: EventType = "response.completed") -> list[str]:
    async def run() -> list[str]:
        redis = await connect(stack.redis.url, patient=False)        # a cluster client on a cluster
        try:
            return [await emit_event(redis, tenant, type, data_id) for data_id in data_ids]
        finally:
            await redis.aclose()

    return asyncio.run(run())


def attempts(url: str, endpoint_id: str, tenant: str = "alpha") -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/v1/webhook_endpoints/{endpoint_id}/attempts", params={"limit": 100},
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=10)
    response.raise_for_status()
    data: list[dict[str, Any]] = response.json()["data"]
    return data


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.05)
    raise TimeoutError(f"{what} not within {timeout} s")


def verified(receiver: Receiver, secret: str) -> list[dict[str, Any]]:
    """Every event received, each signature checked by the standardwebhooks package."""
    webhook = standardwebhooks.Webhook(secret)
    return [webhook.verify(r.body, r.headers) for r in receiver.received]


@pytest.fixture(scope="module")
def served(stack: Stack) -> str:
    """The tiny model, served by one worker for the whole module (a test waits for it to be seen:
    ``stack.wait_for_models``, through its gateway)."""
    stack.start_worker("webhook-worker", MODEL, ctx=2048)
    return MODEL


# ---------------------------------------------------------------------- a batch's event, through the SDK
def test_finished_batch_sends_its_event_signed(stack: Stack, served: str, gateway: GatewayProcess,
                                               receivers: Callable[..., Receiver], tmp_path: Path) -> None:
    stack.wait_for_models({served}, url=gateway.url)
    receiver = receivers()
    client = sdk(gateway.url)
    created = client.webhooks.create(name="batches", url=receiver.url,
                                     event_types=["batch.completed", "batch.failed"])
    assert created.signing_secret.startswith("whsec_") and created.object == "webhook_endpoint"
    assert client.webhooks.retrieve(created.id).url == receiver.url
    assert [e.id for e in client.webhooks.list()] == [created.id]
    assert sdk(gateway.url, "beta").webhooks.list().data == []            # another tenant's is not seen

    path = tmp_path / "input.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": MODEL, "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": f"q{i}"}]}}) + "\n"
                            for i in (1, 2)))
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

    [delivery] = wait_for("the batch's event", lambda: list(receiver.received), timeout=120)
    event = client.webhooks.unwrap(delivery.body, delivery.headers, secret=created.signing_secret)
    assert event.type == "batch.completed" and event.data.id == batch.id and event.id.startswith("evt_")
    assert client.batches.retrieve(batch.id).status == "completed"      # final before the event is sent
    assert verified(receiver, created.signing_secret)[0]["data"] == {"id": batch.id}

    path.write_text(json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "no-such-model", "messages": []}}) + "\n")
    with open(path, "rb") as f:
        unknown = client.files.create(file=f, purpose="batch").id
    failed = client.batches.create(input_file_id=unknown, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for("the failed batch's event", lambda: len(receiver.received) == 2, timeout=60)
    event = client.webhooks.unwrap(receiver.received[1].body, receiver.received[1].headers,
                                   secret=created.signing_secret)
    assert event.type == "batch.failed" and event.data.id == failed.id
    assert client.batches.retrieve(failed.id).status == "failed"
    with pytest.raises(standardwebhooks.WebhookVerificationError):      # a test that can fail: another secret
        standardwebhooks.Webhook(client.webhooks.create(name="other", url=receiver.url, event_types=[
            "batch.failed"]).signing_secret).verify(delivery.body, delivery.headers)
    attempt = attempts(gateway.url, created.id)[-1]
    assert attempt["outcome"] == "delivered" and attempt["status_code"] == 200 and attempt["error"] is None
    assert attempt["webhook_id"] == delivery.headers["webhook-id"] and attempt["event_type"] == "batch.completed"
    assert client.webhooks.delete(created.id).deleted


# ---------------------------------------------------------------------- background responses' events
RESPONSE_EVENTS = ("response.completed", "response.failed", "response.cancelled", "response.incomplete")


def watched(stack: Stack) -> list[bytes]:
    async def run() -> list[bytes]:
        redis = await connect(stack.redis.url, patient=False)
        try:
            return list(await redis.zrange(WebhookKeys.watched, 0, -1))
        finally:
            await redis.aclose()

    return asyncio.run(run())


def test_background_responses_send_their_ending_events_signed(stack: Stack, served: str, gateway: GatewayProcess,
                                                             receivers: Callable[..., Receiver]) -> None:
    """Each background response's event names it and says how it ended, as the Response's status
    reads; a foreground response and a tenant with no endpoint send nothing."""
    stack.wait_for_models({served}, url=gateway.url)
    receiver = receivers()
    endpoint_id, secret = register(gateway.url, receiver, event_types=RESPONSE_EVENTS)
    client = sdk(gateway.url)
    answer = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    completed = client.responses.create(model=served, input="Is it sunny?", background=True, max_output_tokens=40,
                                        temperature=0, text={"format": {"type": "json_schema", "name": "answer",
                                                                        "schema": answer, "strict": True}})
    cut = client.responses.create(model=served, input="Hello", background=True, max_output_tokens=3)
    # The tiny model may end a long reply (end of generation) before the cancel reaches it, more so on a busy
    # machine: each try's event is whatever its cancel found, and a few tries make one a cancelled reply.
    raced: dict[str, str] = {}
    for _ in range(5):
        long = client.responses.create(model=served, input="Hello", background=True, max_output_tokens=1500)
        if (status := client.responses.cancel(long.id).status) == "cancelled":
            break
        raced[long.id] = f"response.{status}"
    assert client.responses.retrieve(long.id).status == "cancelled"
    # a prompt past the worker's context (2048), found only by its tokenizer: the job fails
    failed = client.responses.create(model=served, input="a" * 9000, background=True, max_output_tokens=3)
    client.responses.create(model=served, input="Hello", max_output_tokens=3)      # not a background one
    sdk(gateway.url, "beta").responses.create(model=served, input="Hello", background=True, max_output_tokens=3)

    wait_for("four events", lambda: len(receiver.received) >= 4 + len(raced), timeout=60)
    time.sleep(1.5)                                      # a look later: nothing more, nothing twice
    events = {e.data.id: e.type for e in (client.webhooks.unwrap(r.body, r.headers, secret=secret)
                                           for r in receiver.received)}
    assert len(receiver.received) == 4 + len(raced) and events == raced | {
        completed.id: "response.completed", cut.id: "response.incomplete", long.id: "response.cancelled",
        failed.id: "response.failed"}
    for response_id, type in events.items():
        assert type == f"response.{client.responses.retrieve(response_id).status}"   # final before it is sent
    assert verified(receiver, secret)[0]["data"]["id"] in events
    assert watched(stack) == []                          # every watch ended, the other tenant's too
    client.webhooks.delete(endpoint_id)


def test_a_background_response_ending_while_no_gateway_runs_is_told_by_the_next(
        stack: Stack, served: str, receivers: Callable[..., Receiver]) -> None:
    first = start_gateway(stack, "watch-1")
    stack.wait_for_models({served}, url=first.url)
    receiver = receivers()
    endpoint_id, secret = register(first.url, receiver, event_types=RESPONSE_EVENTS)
    created = sdk(first.url).responses.create(model=served, input="Hello", background=True, max_output_tokens=3)
    first.stop()
    time.sleep(2)                                        # the worker finishes it meanwhile
    assert receiver.received == []
    second = start_gateway(stack, "watch-2")
    try:
        [delivery] = wait_for("its event", lambda: list(receiver.received))
        event = sdk(second.url).webhooks.unwrap(delivery.body, delivery.headers, secret=secret)
        assert event.type == "response.incomplete" and event.data.id == created.id
        sdk(second.url).webhooks.delete(endpoint_id)
    finally:
        second.stop()


def test_rotated_secret_signs_beside_the_old_one_for_a_day(stack: Stack, gateway: GatewayProcess,
                                                             receivers: Callable[..., Receiver]) -> None:
    receiver = receivers()
    endpoint_id, old = register(gateway.url, receiver)
    client = sdk(gateway.url)
    rotated = client.webhooks.rotate_secret(endpoint_id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret != old and rotated.signing_secret_hint == rotated.signing_secret[:10] + "..."
    emit(stack, "alpha", ["resp_rotated_keep"])
    wait_for("the event", lambda: len(receiver.received) == 1)
    assert len(receiver.received[0].headers["webhook-signature"].split()) == 2
    assert verified(receiver, old) == verified(receiver, rotated.signing_secret)   # either secret verifies

    new = client.webhooks.rotate_secret(endpoint_id).signing_secret                 # the old one stops at once
    emit(stack, "alpha", ["resp_rotated_drop"])
    wait_for("the second event", lambda: len(receiver.received) == 2)
    last = receiver.received[1]
    standardwebhooks.Webhook(new).verify(last.body, last.headers)
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(rotated.signing_secret).verify(last.body, last.headers)


# ---------------------------------------------------------------------- the fault test
def test_endpoint_down_then_up_gets_every_event_once(stack: Stack, gateway: GatewayProcess,
                                                      receivers: Callable[..., Receiver]) -> None:
    receiver = receivers(started=False)                  # nothing listens on its port yet
    endpoint_id, secret = register(gateway.url, receiver)
    event_ids = emit(stack, "alpha", [f"resp_down_{i}" for i in range(20)])
    wait_for("retries", lambda: sum(a["outcome"] == "retrying" for a in attempts(gateway.url, endpoint_id)) >= 40)
    failed = attempts(gateway.url, endpoint_id)[0]
    assert failed["status_code"] is None and "ConnectError" in failed["error"] and failed["next_attempt_at"]
    receiver.start()

    wait_for("every event", lambda: len(receiver.ids()) == 20)
    time.sleep(1.5)                                       # longer than the longest retry wait: a repeat would show
    assert set(receiver.ids().values()) == {1}, receiver.ids()
    events = verified(receiver, secret)
    assert sorted(e["id"] for e in events) == sorted(event_ids)
    assert all(e["type"] == "response.completed" and e["object"] == "event" for e in events)
    history = attempts(gateway.url, endpoint_id)
    tried = {a["webhook_id"] for a in history if a["outcome"] == "retrying"}
    assert tried <= set(receiver.ids())                  # ids stable across retries
    assert sum(a["outcome"] == "delivered" for a in history) == 20
    assert emit(stack, "alpha", ["resp_down_0"]) == event_ids[:1]        # emitted again: not delivered again
    time.sleep(1)
    assert len(receiver.received) == 20


def test_a_delivery_is_given_up_after_its_retry_window(stack: Stack, receivers: Callable[..., Receiver]) -> None:
    gateway = start_gateway(stack, "give-up", gateway_webhook_retry_for_s=2)
    try:
        receiver = receivers(started=False)
        endpoint_id, _ = register(gateway.url, receiver)
        emit(stack, "alpha", ["resp_given_up"])
        last = wait_for("the last attempt", lambda: [a for a in attempts(gateway.url, endpoint_id)
                                                     if a["outcome"] == "failed"])[0]
        assert last["next_attempt_at"] is None and last["attempt"] >= 2 and "ConnectError" in last["error"]
        receiver.start()
        time.sleep(1.5)
        assert receiver.received == [] and attempts(gateway.url, endpoint_id)[0] == last     # no attempt after it
    finally:
        gateway.stop()


def test_gateway_restart_mid_retry_keeps_the_pending_deliveries(stack: Stack,
                                                                 receivers: Callable[..., Receiver]) -> None:
    first = start_gateway(stack, "restart-1")
    receiver = receivers(started=False)
    endpoint_id, secret = register(first.url, receiver)
    emit(stack, "alpha", [f"resp_restart_{i}" for i in range(3)])
    wait_for("a failed attempt of each", lambda: len({a["webhook_id"] for a in attempts(first.url, endpoint_id)}) == 3)
    tried = {a["webhook_id"] for a in attempts(first.url, endpoint_id)}
    first.stop()
    receiver.start()
    time.sleep(1)
    assert receiver.received == []                       # no gateway: nothing sent

    second = start_gateway(stack, "restart-2")
    try:
        wait_for("the pending deliveries", lambda: len(receiver.received) == 3)
        assert set(receiver.ids()) == tried and set(receiver.ids().values()) == {1}
        assert [e["data"]["id"] for e in sorted(verified(receiver, secret), key=lambda e: e["data"]["id"])] == [
            f"resp_restart_{i}" for i in range(3)]
    finally:
        second.stop()


def test_deliveries_on_a_valkey_cluster(tmp_path: Path, tiny_model_path: Path,
                                        receivers: Callable[..., Receiver]) -> None:
    """Every webhook key shares one slot: the emit, claim and finish scripts run on a cluster too."""
    with Stack.started(tmp_path, tiny_model_path, cluster=True) as cluster:
        gateway = start_gateway(cluster, "cluster-gateway")
        receiver = receivers(started=False)
        endpoint_id, secret = register(gateway.url, receiver)
        emit(cluster, "alpha", ["resp_cluster_1", "resp_cluster_2"])
        wait_for("a failed attempt", lambda: attempts(gateway.url, endpoint_id))
        receiver.start()
        wait_for("both events", lambda: len(receiver.received) == 2)
        assert sorted(e["data"]["id"] for e in verified(receiver, secret)) == ["resp_cluster_1", "resp_cluster_2"]
        gateway.stop()                                   # its own looks would take the entry first
        assert asyncio.run(watch_claim_unwatch(cluster)) == (["job-1"], [], [])


async def watch_claim_unwatch(stack: Stack) -> tuple[list[str], list[str], list[bytes]]:
    """The background responses' watch set, through a cluster client: claimed once, then not due."""
    redis = await connect(stack.redis.url, patient=False)
    try:
        records = WebhookRecords(redis)
        await records.watch("job-1", look_at_ms=1)
        claimed = await records.claim_watched(now_ms=2, next_look_ms=10_000, count=10)
        again = await records.claim_watched(now_ms=3, next_look_ms=10_000, count=10)
        await records.unwatch(claimed)
        return claimed, again, list(await redis.zrange(WebhookKeys.watched, 0, -1))
    finally:
        await redis.aclose()


# ---------------------------------------------------------------------- isolation
def test_hanging_endpoint_does_not_delay_another_tenants_delivery(stack: Stack,
                                                                   receivers: Callable[..., Receiver]) -> None:
    # 5 attempts at once in all, 3 of them to the hanging endpoint: each claim looks at 8 due deliveries,
    # at first all the hanging endpoint's, which must move behind the other tenant's for it to go out
    gateway = start_gateway(stack, "isolation", gateway_webhook_timeout_s=10, gateway_webhook_endpoint_concurrency=3,
                            gateway_webhook_concurrency=5)
    try:
        hanging, prompt = receivers(hang=True), receivers()
        hanging_id, _ = register(gateway.url, hanging, "alpha")
        register(gateway.url, prompt, "beta")
        emit(stack, "alpha", [f"resp_hang_{i}" for i in range(30)])
        wait_for("the hanging endpoint's attempts", lambda: hanging.in_flight == 3)
        emitted = time.monotonic()
        emit(stack, "beta", ["resp_prompt"])
        [delivery] = wait_for("the other tenant's event", lambda: list(prompt.received), timeout=10)
        assert delivery.at - emitted < 7         # a look every 0.5 s, 8 at a time; the hanging attempts take 10 s
        assert attempts(gateway.url, hanging_id) == []                   # none of them has ended yet
        assert hanging.most_in_flight == 3                               # SLOTQ_GATEWAY_WEBHOOK_ENDPOINT_CONCURRENCY
    finally:
        gateway.stop()


# ---------------------------------------------------------------------- no SSRF
@pytest.mark.parametrize(("host", "kind"), [("::ffff:127.0.0.1", "loopback"), ("100.64.0.1", "not globally routable"),
                                            ("fe80::1", "link-local"), ("0.0.0.0", "unspecified"),
                                            ("224.0.0.1", "multicast"), ("192.168.1.10", "private")])
def test_non_public_addresses_are_named(host: str, kind: str) -> None:
    with pytest.raises(AddressRefused, match=f"is a {kind} address"):
        asyncio.run(resolve(host, 80, allow_private=False))
    assert asyncio.run(resolve(host, 80, allow_private=True)) == [host]
    assert asyncio.run(resolve("93.184.215.14", 443, allow_private=False)) == ["93.184.215.14"]


def test_retry_schedule_spans_a_day() -> None:
    settings = GatewaySettings(_env_file=None)  # type: ignore[call-arg]
    full = [5, 20, 80, 320, 1280, 5120, 14400, 14400]
    for attempt, longest in enumerate(full, 1):
        assert 0.75 * longest <= retry_delay_s(settings, attempt) <= longest
    elapsed, attempts = 0.0, 1
    while elapsed + (wait := retry_delay_s(settings, attempts)) <= settings.gateway_webhook_retry_for_s:
        elapsed, attempts = elapsed + wait, attempts + 1
    assert 11 <= attempts <= 14 and elapsed > 20 * 3600



def test_private_addresses_are_refused_at_registration_and_at_delivery(
        stack: Stack, receivers: Callable[..., Receiver]) -> None:
    strict = start_gateway(stack, "strict", allow_private=False)
    try:
        for url, named in (("http://127.0.0.1:9/x", "127.0.0.1 is a loopback address"),
                           ("http://localhost:9/x", "'localhost', which resolves to"),
                           ("http://169.254.169.254/latest/meta-data", "169.254.169.254 is a link-local address"),
                           ("http://10.1.2.3/", "10.1.2.3 is a private address"),
                           ("http://[::1]:9/", "::1 is a loopback address")):
            response = httpx.post(f"{strict.url}/v1/webhook_endpoints", json={
                "name": "x", "url": url, "event_types": ["batch.completed"]},
                headers={"Authorization": f"Bearer {KEYS['alpha']}"})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == "url", error
            assert named in error["message"] and "SLOTQ_GATEWAY_WEBHOOK_ALLOW_PRIVATE" in error["message"], error
        response = httpx.post(f"{strict.url}/v1/webhook_endpoints", json={
            "name": "x", "url": "ftp://example.com/", "event_types": ["batch.completed"]},
            headers={"Authorization": f"Bearer {KEYS['alpha']}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "url"
        response = httpx.post(f"{strict.url}/v1/webhook_endpoints", json={
            "name": "x", "url": "https://example.com/", "event_types": ["batch.done"]},
            headers={"Authorization": f"Bearer {KEYS['alpha']}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "event_types[0]"
    finally:
        strict.stop()

    # registered where private addresses were allowed, delivered by a gateway where they are not
    lenient = start_gateway(stack, "lenient")
    receiver = receivers()
    endpoint_id, _ = register(lenient.url, receiver)
    lenient.stop()
    strict = start_gateway(stack, "strict-2", allow_private=False)
    try:
        emit(stack, "alpha", ["resp_private"])
        refused = wait_for("a refused attempt", lambda: attempts(strict.url, endpoint_id))[-1]
        assert refused["outcome"] == "retrying" and refused["status_code"] is None
        assert refused["error"].startswith("refused: 127.0.0.1 is a loopback address"), refused
        assert receiver.received == []
    finally:
        strict.stop()
