"""The gateway's surfaces beyond its API are bounded and private (issue 32), through real processes
(Valkey, a ``slotq worker`` on the tiny model, ``slotq gateway``) where a user would have them:

* metric labels come from bounded sets, whatever method or path a caller sends (the probe's
  repro: one 12,000-byte method added 24 KB to /metrics for good, 300 methods 105 KB);
* tenants' names and usage (/metrics) and the fleet (/health) only for an admin key or on the
  private metrics port; ``/ready``;
* ``Content-Length`` with ``Transfer-Encoding`` is a 400 and the connection closes, so a request
  smuggled behind it is never served;
* the dashboard's security headers, a key in a query string kept out of the access log;
* files: caps per tenant (checked where the file is recorded, so a race cannot pass them),
  OpenAI's ``expires_after``, a default expiry, and the sweep;
* settings that would silently do what nobody meant refuse to start, saying why, never the key.
"""

from __future__ import annotations

import asyncio
import io
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from redis.asyncio import Redis

from slotq.jobs.gateway.files import FileStore
from slotq.jobs.gateway.metrics import STANDARD_METHODS
from slotq.jobs.openai.errors import ApiError
from tests.support import free_port
from tests.support.gateway import GatewayProcess, Stack
from tests.support.jobs import SLOTQ_BIN, clean_env

pytestmark = pytest.mark.timeout(180)

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}
ALICE, BOB, CAROL = ({"Authorization": f"Bearer {key}"} for key in KEYS.values())
ADMIN = {"Authorization": "Bearer sk-ops"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("surfaces"), tiny_model_path) as s:
        s.start_worker("surfaces-worker", "tiny")
        s.start_gateway("keyed", api_keys=",".join(f"{name}={key}" for name, key in KEYS.items()),
                        admin_keys="ops=sk-ops", gateway_metrics_port=free_port(), gateway_files_dir=s.cwd / "files",
                        gateway_tenant_max_files=2, gateway_tenant_max_files_mb=1)
        s.gateways[0].wait_ready()
        s.wait_for_models({"tiny"})
        yield s


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> GatewayProcess:
    return stack.gateways[0]


def _exchange(port: int, request: bytes, *, quiet_s: float = 5) -> bytes:
    """Send raw bytes; everything the server sends until it closes (or says nothing for quiet_s:
    a connection it keeps open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=quiet_s) as sock:
        sock.sendall(request)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out


# ---------------------------------------------------------------------- metrics
def _request_series(gateway: GatewayProcess) -> tuple[int, list[str]]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return len(text), [line for line in text.splitlines() if line.startswith("slotq_gateway_requests_total{")]


def test_metric_labels_stay_bounded_whatever_the_method_or_path(gateway):
    def odd(method: str, path: str) -> None:
        answer = _exchange(gateway.port, f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                                         .encode())
        assert answer.startswith((b"HTTP/1.1 404", b"HTTP/1.1 405")), answer[:100]

    for path in ("/", "/v1/models", "/v1/no/such"):        # the series an odd method can make, made once
        odd("PROBE", path)
    _request_series(gateway)                               # and GET /metrics' own
    size_before, series_before = _request_series(gateway)
    odd("X" * 12_000, "/v1/models")
    for i in range(300):
        odd(f"M{i:03d}", ("/", "/v1/models", f"/v1/no/such-{i}")[i % 3])
    size_after, series_after = _request_series(gateway)
    methods = {re.search(r'method="([^"]*)"', line).group(1) for line in series_after}    # type: ignore[union-attr]
    assert methods <= STANDARD_METHODS | {"other"}, methods
    assert len(series_after) == len(series_before), series_after
    assert size_after - size_before < 1000, (size_before, size_after)       # counts grew a digit or two


def test_tenant_names_and_the_fleet_are_for_the_fleet_view_only(gateway):
    assert httpx.post(f"{gateway.url}/v1/jobs", headers=ALICE, json=CHAT, timeout=30).status_code == 202
    public = httpx.get(f"{gateway.url}/metrics", timeout=10)
    assert public.status_code == 200 and "slotq_gateway_requests_total" in public.text
    assert "tenant=" not in public.text and "alice" not in public.text
    for view in (httpx.get(f"{gateway.url}/metrics", headers=ADMIN, timeout=10),
                 httpx.get(f"{gateway.private_url}/metrics", timeout=10)):          # no key on the private port
        assert 'slotq_gateway_tenant_jobs_total{tenant="alice"} 1.0' in view.text, view.text[-2000:]
    refused = httpx.get(f"{gateway.url}/metrics", headers=BOB, timeout=10)          # a key, but not an admin's
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert httpx.get(f"{gateway.url}/metrics", headers={"Authorization": "Bearer sk-nope"}).status_code == 401

    assert httpx.get(f"{gateway.url}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{gateway.url}/health", headers=BOB, timeout=10).status_code == 403
    for detailed in (httpx.get(f"{gateway.url}/health", headers=ADMIN, timeout=10).json(),
                     httpx.get(f"{gateway.private_url}/health", timeout=10).json()):
        assert detailed["models"]["tiny"]["workers"] == 1 and detailed["redis"] == "ok"

    for url in (gateway.url, gateway.private_url):
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert (ready.status_code, ready.json()) == (200, {"ok": True, "state": "ready"})
    for path in ("/v1/models", "/", "/api/fleet"):                                 # the private port serves no more
        assert httpx.get(f"{gateway.private_url}{path}", headers=ALICE, timeout=10).status_code == 404, path


# ---------------------------------------------------------------------- framing, headers, logs
def test_content_length_with_transfer_encoding_is_a_400_and_the_smuggled_request_is_never_served(gateway):
    smuggled = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-alice\r\n"
                b"Content-Type: application/json\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"0\r\n\r\n"
                b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-alice\r\n\r\n")
    answer = _exchange(gateway.port, smuggled)
    assert answer.startswith(b"HTTP/1.1 400") and b'"code":"ambiguous_framing"' in answer, answer
    assert answer.count(b"HTTP/1.1 ") == 1 and b'"object":"list"' not in answer, answer     # closed, not served
    assert b"connection: close" in answer.lower()


def test_the_dashboard_is_served_with_security_headers(gateway):
    for path in ("/", "/app.js"):
        headers = httpx.get(f"{gateway.url}{path}", timeout=10).headers
        policy = headers["content-security-policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe" not in policy
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"


def test_the_access_log_never_holds_a_key_sent_in_the_url(gateway):
    reply = httpx.get(f"{gateway.url}/v1/models?api_key=sk-carol-in-the-url&limit=3", headers=CAROL, timeout=10)
    assert reply.status_code == 200
    deadline = time.monotonic() + 10
    while "GET /v1/models?" not in gateway.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = gateway.log.read_text()
    assert "GET /v1/models?api_key=***&limit=3" in log and "sk-carol-in-the-url" not in log


# ---------------------------------------------------------------------- files
def _upload(gateway: GatewayProcess, key: dict[str, str], size: int = 100, **form: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/files", headers=key, data={"purpose": "batch", **form},
                      files={"file": ("in.jsonl", b"x" * (size - 1) + b"\n")}, timeout=30)


def test_files_are_capped_per_tenant(gateway):
    """SLOTQ_GATEWAY_TENANT_MAX_FILES=2 and SLOTQ_GATEWAY_TENANT_MAX_FILES_MB=1 for this gateway."""
    first, _second = (_upload(gateway, ALICE).json()["id"] for _ in range(2))
    third = _upload(gateway, ALICE)
    assert third.status_code == 400, third.text
    error = third.json()["error"]
    assert (error["param"], error["code"]) == ("file", "tenant_files_limit_exceeded")
    assert "SLOTQ_GATEWAY_TENANT_MAX_FILES" in error["message"]
    big = _upload(gateway, BOB, size=700_000)                 # another tenant has its own room
    assert big.status_code == 200, big.text
    over = _upload(gateway, BOB, size=400_000)
    assert over.status_code == 400 and over.json()["error"]["code"] == "tenant_file_bytes_limit_exceeded"
    assert "SLOTQ_GATEWAY_TENANT_MAX_FILES_MB" in over.json()["error"]["message"]
    assert httpx.delete(f"{gateway.url}/v1/files/{first}", headers=ALICE, timeout=10).status_code == 200
    assert _upload(gateway, ALICE).status_code == 200         # the room comes back with a delete
    assert _upload(gateway, BOB, size=300_000).status_code == 200


def test_files_expire_as_openai_says(gateway):
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["carol"], max_retries=0, timeout=30)
    chosen = client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
    assert chosen.expires_at == chosen.created_at + 3600
    assert client.files.retrieve(chosen.id).expires_at == chosen.expires_at
    default = client.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert default.expires_at == default.created_at + 30 * 86_400         # SLOTQ_GATEWAY_FILE_EXPIRY_S
    client.files.delete(default.id)
    for form, param in (({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
                         "expires_after.seconds"),
                        ({"expires_after[anchor]": "last_used", "expires_after[seconds]": "3600"},
                         "expires_after.anchor")):
        refused = _upload(gateway, CAROL, **form)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


async def test_expired_files_are_gone_and_swept_but_a_running_batchs_input_stays(redis_url, tmp_path):
    redis = Redis.from_url(redis_url)
    now = [1_000_000.0]
    store = FileStore(redis, tmp_path, max_bytes=1 << 20, tenant_max_files=10, tenant_max_bytes=1 << 20,
                      default_expiry_s=100, clock=lambda: now[0])
    try:
        short = await store.upload(io.BytesIO(b"a\n"), "a.jsonl", "batch", "t")
        long = await store.upload(io.BytesIO(b"bb\n"), "b.jsonl", "batch", "t", expires_after_s=3600)
        input_ = await store.upload(io.BytesIO(b"ccc\n"), "c.jsonl", "batch", "t")
        assert (short.expires_at, long.expires_at) == (1_000_100, 1_003_600)
        now[0] += 101
        with pytest.raises(ApiError) as caught:
            await store.get(short.id, "t")
        assert caught.value.status == 404                              # gone for its tenant at once
        listed = await store.list(tenant="t", purpose=None, limit=10, after=None, order="asc")
        assert [f.id for f in listed.data] == [long.id]

        async def running_batch_inputs() -> set[str]:
            return {input_.id}

        store.in_use = running_batch_inputs
        assert await store.sweep() == 1
        assert not (tmp_path / short.id).exists() and (tmp_path / input_.id).exists()
        assert await store.records.usage("t") == (2, 3 + 4)
        async def batch_finished() -> set[str]:
            return set()

        store.in_use = batch_finished
        assert await store.sweep() == 1 and await store.records.usage("t") == (1, 3)
        assert sorted(p.name for p in tmp_path.iterdir()) == [long.id]
    finally:
        await redis.aclose()


async def test_a_corrupt_file_record_is_skipped_and_the_sweep_goes_on(redis_url, tmp_path, caplog):
    """A record that cannot be read once stopped the sweeper for good (/ready: 503 file_sweep_stopped):
    now it is skipped, named in the log and left in place, and every other expired file is removed."""
    redis = Redis.from_url(redis_url)
    now = [1_000_000.0]
    store = FileStore(redis, tmp_path, max_bytes=1 << 20, tenant_max_files=10, tenant_max_bytes=1 << 20,
                      default_expiry_s=100, clock=lambda: now[0])
    try:
        corrupt = await store.upload(io.BytesIO(b"a\n"), "a.jsonl", "batch", "t")
        fine = await store.upload(io.BytesIO(b"bb\n"), "b.jsonl", "batch", "t")
        await redis.set(store.records.keys.file(corrupt.id), b"{not json")
        now[0] += 101
        store.start(lambda: asyncio.sleep(0, set()))
        async with asyncio.timeout(10):
            while (tmp_path / fine.id).exists():
                await asyncio.sleep(0.05)
        assert store.running                                        # the sweeper goes on
        assert await store.sweep() == 0                              # the corrupt record stays, skipped again
        assert await redis.get(store.records.keys.file(corrupt.id)) == b"{not json"
        assert f"file record {store.records.keys.file(corrupt.id)} cannot be read" in caplog.text
    finally:
        await store.close()
        await redis.aclose()


async def test_two_uploads_racing_for_a_tenants_last_place_take_it_once(redis_url, tmp_path):
    redis = Redis.from_url(redis_url)
    store = FileStore(redis, tmp_path, max_bytes=1 << 20, tenant_max_files=1, tenant_max_bytes=1 << 20,
                      default_expiry_s=100)
    try:
        results = await asyncio.gather(*(store.upload(io.BytesIO(b"x\n"), "x.jsonl", "batch", "t") for _ in range(2)),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, ApiError)]
        assert len(refused) == 1 and refused[0].code == "tenant_files_limit_exceeded", results
        assert len(list(tmp_path.iterdir())) == 1 and await store.records.usage("t") == (1, 2)   # no orphan
    finally:
        await redis.aclose()


# ---------------------------------------------------------------------- refused at start
@pytest.mark.parametrize(("settings", "said"), [
    ({"api_keys": "alice=sk-twice,bob=sk-twice"}, ("SLOTQ_API_KEYS entry 2 (tenant 'bob') has the same key as "
                                                  "SLOTQ_API_KEYS entry 1 (tenant 'alice')")),
    ({"api_keys": "default=sk-twice"}, "SLOTQ_GATEWAY_ALLOW_DEFAULT_TENANT_KEYS"),
    ({"cors_origins": "*"}, "SLOTQ_CORS_ORIGINS=*: without API keys"),
])
def test_settings_that_would_mislead_refuse_to_start_and_say_why(tmp_path, settings, said):
    done = subprocess.run([str(SLOTQ_BIN), "gateway", "--port", str(free_port())], env=clean_env(**settings),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and said in output, output
    assert "sk-twice" not in output
