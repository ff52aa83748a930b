"""The gateway as a security boundary, through real processes (Valkey, a ``slotq worker`` on the
tiny model, ``slotq gateway``): tenants see only their own jobs, streams, files and batches;
inputs are bounded before they reach Redis; the keyless mode refuses foreign Hosts and Origins;
Redis out of reach is a 503 in OpenAI's shape; and the smaller OpenAI mismatches are gone.

The cross-tenant matrix has one row per endpoint: tenant B asks for tenant A's thing and must get
exactly the 404 it gets for a thing that never existed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotq.jobs.gateway.settings import key_tenant
from slotq.jobs.producer.sync_client import SyncSlotqClient
from slotq.jobs.protocol.schemas import JobRequest
from tests.support.gateway import GatewayProcess, Stack

pytestmark = pytest.mark.timeout(180)

# A and B: a bare key each (a tenant each, as keys were before tenants); teamC: two named keys.
KEY_A, KEY_B, KEY_C1, KEY_C2, KEY_ADMIN = "sk-a", "sk-b", "sk-team-c-1", "sk-team-c-2", "sk-ops"
A, B, C1, C2, ADMIN = ({"Authorization": f"Bearer {key}"} for key in (KEY_A, KEY_B, KEY_C1, KEY_C2, KEY_ADMIN))
CTX = 512
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BATCH_LINE = {"custom_id": "line-1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("tenants"), tiny_model_path) as s:
        s.start_worker("tenants-worker", "tiny", ctx=CTX)
        s.start_gateway("keyed", api_keys=f"{KEY_A},{KEY_B},teamC={KEY_C1},teamC={KEY_C2}",
                        admin_keys=f"ops={KEY_ADMIN}",
                        gateway_max_body_mb=0.25, gateway_max_metadata_bytes=1024, gateway_header_timeout_s=1,
                        gateway_body_timeout_s=2)
        s.start_gateway("keyless", cors_origins="https://app.example")
        for gateway in s.gateways:
            gateway.wait_ready()
        s.wait_for_models({"tiny"})
        yield s


@pytest.fixture(scope="module")
def keyless(stack: Stack) -> GatewayProcess:
    return stack.gateways[1]


@pytest.fixture(scope="module")
def owned(stack: Stack) -> dict[str, str]:
    """Tenant A's things: a finished job under an idempotency key, a file, and a batch of it."""
    url = stack.url
    created = httpx.post(f"{url}/v1/jobs", headers=A, json=CHAT | {"idempotency_key": "tenantA-job-1"}, timeout=30)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    _wait_finished(url, job_id, A)
    upload = httpx.post(f"{url}/v1/files", headers=A, data={"purpose": "batch"},
                        files={"file": ("in.jsonl", json.dumps(BATCH_LINE).encode() + b"\n")}, timeout=30)
    assert upload.status_code == 200, upload.text
    batch = httpx.post(f"{url}/v1/batches", headers=A, timeout=30, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    return {"job": job_id, "key": "tenantA-job-1", "file": upload.json()["id"], "batch": batch.json()["id"]}


def _wait_finished(url: str, job_id: str, headers: dict[str, str], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
        if body["status"] not in ("queued", "running"):
            return body
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} not finished within {timeout} s")


# One row per endpoint: (method, path, extra request arguments). {job} (its full id), {key} (its
# idempotency key), {file} and {batch} are tenant A's; the same row with ids that never existed
# must get the very same answer.
CROSS_TENANT = [
    ("GET", "/v1/jobs/{key}", {}),
    ("GET", "/v1/jobs/{job}", {}),
    ("GET", "/v1/jobs/{key}/events", {}),
    ("GET", "/v1/jobs/{job}/events", {"headers": {"Last-Event-ID": "0-0"}}),
    ("DELETE", "/v1/jobs/{key}", {}),
    ("DELETE", "/v1/jobs/{job}", {}),
    ("POST", "/v1/chat/completions", {"json": CHAT | {"stream": True, "idempotency_key": "{key}"},
                                      "headers": {"Last-Event-ID": "0-0"}}),
    ("GET", "/v1/files/{file}", {}),
    ("GET", "/v1/files/{file}/content", {}),
    ("POST", "/v1/batches", {"json": {"input_file_id": "{file}", "endpoint": "/v1/chat/completions",
                                      "completion_window": "24h"}}),
    ("GET", "/v1/batches/{batch}", {}),
    ("POST", "/v1/batches/{batch}/cancel", {}),
    ("DELETE", "/v1/files/{file}", {}),        # last: where isolation fails, it takes the file away
]
NEVER = {"key": "never-was", "file": "file-000000000000000000000000", "batch": "batch_000000000000000000000000"}


def _fill(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**ids)
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    return value


def _ask(url: str, method: str, path: str, extra: dict[str, Any], ids: dict[str, str],
         key: dict[str, str]) -> httpx.Response:
    extra = _fill(extra, ids)
    headers = key | extra.pop("headers", {})
    return httpx.request(method, f"{url}{_fill(path, ids)}", headers=headers, timeout=30, **extra)


@pytest.mark.parametrize(("method", "path", "extra"), CROSS_TENANT, ids=[f"{m} {p}" for m, p, _ in CROSS_TENANT])
def test_another_tenants_thing_is_a_404_like_one_that_never_existed(stack, owned, method, path, extra):
    never_ids = NEVER | {"job": owned["job"].replace(owned["key"], NEVER["key"])}     # the same tenant's
    theirs = _ask(stack.url, method, path, extra, owned, B)
    never = _ask(stack.url, method, path, extra, never_ids, B)
    assert theirs.status_code == 404, theirs.text
    assert never.status_code == 404, never.text
    unmasked = theirs.text
    for name, value in owned.items():          # the full job id before the key it contains
        unmasked = unmasked.replace(value, never_ids[name])
    assert json.loads(unmasked) == never.json()
    assert _ask(stack.url, "GET", "/v1/jobs/{key}", {}, owned, A).status_code == 200        # the owner still has it


def test_the_keys_of_one_tenant_share_its_jobs(stack):
    created = httpx.post(f"{stack.url}/v1/jobs", headers=C1, json=CHAT | {"idempotency_key": "team-c-job"}, timeout=30)
    assert created.status_code == 202 and created.json()["id"] == "team-c-job@teamC"
    assert _wait_finished(stack.url, "team-c-job", C2)["status"] == "succeeded"
    assert httpx.get(f"{stack.url}/v1/jobs/team-c-job@teamC", headers=A, timeout=30).status_code == 404


def test_lists_hold_only_the_tenants_own(stack, owned):
    for path, thing in (("/v1/files", "file"), ("/v1/batches", "batch")):
        theirs = httpx.get(f"{stack.url}{path}", headers=B, timeout=30)
        assert theirs.status_code == 200 and owned[thing] not in theirs.text
        mine = httpx.get(f"{stack.url}{path}", headers=A, timeout=30)
        assert owned[thing] in {item["id"] for item in mine.json()["data"]}
        assert "tenant" not in mine.json()["data"][0]


def test_the_fleet_view_is_for_admin_keys(stack, owned):
    for method, path in (("GET", "/api/fleet"), ("GET", "/api/dead-letters"), ("GET", "/api/history"),
                         ("GET", "/api/shards"), ("POST", f"/api/dead-letters/{owned['job']}/requeue")):
        for key in (A, C1):
            refused = httpx.request(method, f"{stack.url}{path}", headers=key, timeout=30)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert httpx.get(f"{stack.url}/api/fleet", headers=ADMIN, timeout=30).json()["workers"]
    assert "tenants_waiting" in httpx.get(f"{stack.url}/api/history", headers=ADMIN, timeout=30).json()
    assert httpx.get(f"{stack.url}/api/shards", headers=ADMIN, timeout=30).json()["clustered"] is False


def test_idempotency_keys_are_per_tenant(stack, owned):
    # B's job under A's key is B's own: a new job, never A's answer
    other = CHAT | {"messages": [{"role": "user", "content": "something else"}], "idempotency_key": "tenantA-job-1"}
    mine = httpx.post(f"{stack.url}/v1/jobs", headers=B, json=other, timeout=30)
    assert mine.status_code == 202 and mine.json()["id"] != owned["job"]
    assert _wait_finished(stack.url, "tenantA-job-1", B)["id"] == mine.json()["id"]
    # A reusing its own key: the same request finds the job, another request is a 409
    again = httpx.post(f"{stack.url}/v1/jobs", headers=A, json=CHAT | {"idempotency_key": "tenantA-job-1"}, timeout=30)
    assert again.status_code == 202 and again.json()["id"] == owned["job"]
    reused = httpx.post(f"{stack.url}/v1/jobs", headers=A, json=other, timeout=30)
    assert reused.status_code == 409, reused.text
    assert reused.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                         "param": "idempotency_key", "code": "idempotency_key_reused"}


def test_a_python_client_job_belongs_to_the_tenant_it_names(stack):
    with SyncSlotqClient(stack.redis.url) as client:
        job_id = client.enqueue(JobRequest(prompt="hi", max_tokens=2, tenant="teamC", idempotency_key="from-python"))
        client.result(job_id, timeout=60)
    assert job_id == "from-python@teamC"
    assert httpx.get(f"{stack.url}/v1/jobs/from-python", headers=C2, timeout=30).json()["id"] == job_id
    assert httpx.get(f"{stack.url}/v1/jobs/{job_id}", headers=B, timeout=30).status_code == 404


def test_batch_lines_run_as_the_batchs_tenant(stack, owned):
    """A batch's lines are jobs of the tenant that created it (its fair share and quotas apply),
    so their ids are scoped to it: A can look a line's job up, B cannot."""
    deadline = time.monotonic() + 60
    while (batch := httpx.get(f"{stack.url}/v1/batches/{owned['batch']}", headers=A, timeout=30).json())[
            "status"] != "completed":
        assert batch["status"] in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, batch
        time.sleep(0.1)
    output = httpx.get(f"{stack.url}/v1/files/{batch['output_file_id']}/content", headers=A, timeout=30)
    [line] = [json.loads(raw) for raw in output.text.splitlines()]
    job_id = line["response"]["request_id"]
    assert job_id.endswith(f"@{key_tenant(KEY_A)}"), job_id
    assert line["id"].startswith("batch_req_") and "@" not in line["id"]
    assert httpx.get(f"{stack.url}/v1/jobs/{job_id}", headers=B, timeout=30).status_code == 404


# ---------------------------------------------------------------------- limits before Redis
def _raw_http(port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes. A close with our last bytes unread (a space sent while the
    server was already answering) arrives as a reset after what it sent: the end, like a FIN."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_a_body_over_the_limit_is_a_413_before_it_is_read(stack):
    gateway = stack.gateways[0]            # SLOTQ_GATEWAY_MAX_BODY_MB=0.25
    # declared: answered with nothing of the body sent
    sock = _raw_http(gateway.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   b"Authorization: Bearer " + KEY_A.encode() + b"\r\n"
                                   b"Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n")
    answer = _read_all(sock).decode()
    assert answer.startswith("HTTP/1.1 413") and '"code":"request_too_large"' in answer and "MAX_BODY_MB" in answer
    # chunked: refused once it passes the limit
    def body() -> Iterator[bytes]:
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(1000):
            yield b"x" * 65536

    response = httpx.post(f"{gateway.url}/v1/chat/completions", headers=A, content=body(), timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_metadata_and_prompt_sizes_are_refused_before_enqueue(stack):
    big = httpx.post(f"{stack.url}/v1/jobs", headers=A, timeout=30, json=CHAT | {"metadata": {"k": "v" * 2000}})
    assert big.status_code == 400
    assert big.json()["error"]["param"] == "metadata" and big.json()["error"]["code"] == "metadata_too_large"
    started = time.monotonic()
    long_prompt = {"model": "tiny", "prompt": "x" * (CTX * 16 + 1), "max_tokens": 4}
    response = httpx.post(f"{stack.url}/v1/completions", headers=A, json=long_prompt, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "prompt_too_long")
    assert "SLOTQ_MAX_PROMPT_CHARS_PER_TOKEN" in error["message"]         # refused by the producer, not a worker
    assert time.monotonic() - started < 2


def test_slow_headers_and_slow_bodies_are_cut_off(stack):
    gateway = stack.gateways[0]            # header timeout 1 s, body timeout 2 s
    sock = _raw_http(gateway.port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    started = time.monotonic()
    closed = False
    while time.monotonic() - started < 8:
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except OSError:
            closed = True
            break
        sock.settimeout(0.5)
        try:
            if sock.recv(1024) == b"":
                closed = True
                break
        except TimeoutError:
            pass
        except OSError:                    # closed with our last header line unread: a reset, not a FIN
            closed = True
            break
    assert closed and time.monotonic() - started < 4
    sock = _raw_http(gateway.port, b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                                   + KEY_A.encode()
                                   + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    started = time.monotonic()
    sock.settimeout(0.5)
    answer = b""
    while time.monotonic() - started < 8 and not answer:
        try:
            sock.sendall(b" ")
            answer = sock.recv(65536)
        except TimeoutError:
            pass
    sock.settimeout(5)
    answer += _read_all(sock)          # the body may come in a segment after the head (it closes then)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
    assert time.monotonic() - started < 4


# ---------------------------------------------------------------------- keyless mode
def test_keyless_serves_loopback_and_allowed_hosts_only(keyless):
    assert httpx.get(f"{keyless.url}/v1/models", timeout=10).status_code == 200
    by_name = httpx.get(f"{keyless.url}/v1/models", headers={"Host": f"localhost:{keyless.port}"}, timeout=10)
    assert by_name.status_code == 200
    rebound = httpx.get(f"{keyless.url}/v1/models", headers={"Host": "attacker.example"}, timeout=10)
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"


def test_keyless_refuses_cross_origin_posts(keyless):
    upload: dict[str, Any] = {"data": {"purpose": "batch"}, "files": {"file": ("x.jsonl", b"{}\n")}, "timeout": 10}
    for headers in ({"Origin": "http://attacker.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
        refused = httpx.post(f"{keyless.url}/v1/files", headers=headers, **upload)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_origin_refused", headers
    assert httpx.delete(f"{keyless.url}/v1/jobs/x", headers={"Origin": "http://attacker.example"}).status_code == 403
    for origin in (keyless.url, "https://app.example"):          # its own pages, SLOTQ_CORS_ORIGINS
        assert httpx.post(f"{keyless.url}/v1/files", headers={"Origin": origin}, **upload).status_code == 200


# ---------------------------------------------------------------------- OpenAI's shape
def test_get_one_model(stack):
    card = httpx.get(f"{stack.url}/v1/models/tiny", headers=B, timeout=10)
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["object"] == "model"
    missing = httpx.get(f"{stack.url}/v1/models/gpt-9", headers=B, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"stop": ["a", "b", "c", "d", "e", "f"]}, "stop"),
    ({"json_schema": {"type": "frob"}}, "json_schema"),           # refused by the worker's grammar converter
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
])
def test_openai_bounds_and_params_named_as_sent(stack, extra, param):
    response = httpx.post(f"{stack.url}/v1/chat/completions", headers=B, json=CHAT | extra, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "sampling" not in error["message"], error


def test_a_wrong_method_is_a_405(stack):
    for method, path in (("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("PUT", "/v1/jobs/x")):
        response = httpx.request(method, f"{stack.url}{path}", headers=B, timeout=10)
        assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed", path


def test_an_unknown_route_is_a_404_naming_it_and_what_is_served(stack):
    response = httpx.post(f"{stack.url}/v1/frobnicate", headers=B, json={}, timeout=10)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["message"].startswith("POST /v1/frobnicate: no such route")
    assert all(path in error["message"] for path in ("/v1/chat/completions", "/v1/embeddings", "/v1/models")), error


def test_gateway_metrics_are_the_gateways_own_and_no_cdn_docs(stack):
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    families = {line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE slotq_")}
    assert families and all(name.startswith("slotq_gateway_") for name in families), families
    docs = httpx.get(f"{stack.url}/docs", timeout=10)
    assert docs.status_code == 404 and "cdn" not in docs.text
    assert httpx.get(f"{stack.url}/openapi.json", timeout=10).json()["paths"]


# ---------------------------------------------------------------------- Redis out of reach
@pytest.mark.slow
def test_redis_unreachable_is_a_503_in_openais_shape(tmp_path, tiny_model_path):
    """...that never names Redis' host or port (the log does), and /ready and /health say 503."""
    with Stack.started(tmp_path, tiny_model_path) as s:
        gateway = s.start_gateway("gateway", redis_connect_timeout_s=1, api_keys=KEY_A)
        gateway.wait_ready()
        redis_port = str(s.redis.port)
        s.redis.kill()
        for method, path in (("GET", "/v1/jobs/some-job"), ("GET", "/v1/files"), ("POST", "/v1/chat/completions")):
            response = httpx.request(method, f"{gateway.url}{path}", headers=A, json=CHAT, timeout=30)
            assert response.status_code == 503, (path, response.text)
            assert response.json()["error"]["code"] == "redis_unavailable" and response.headers["retry-after"]
            assert redis_port not in response.text and "127.0.0.1" not in response.text, response.text
        health, ready = (httpx.get(f"{gateway.url}{path}", timeout=30) for path in ("/health", "/ready"))
        assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
        assert (ready.status_code, ready.json()) == (503, {"ok": False, "state": "redis_unavailable"})
        assert f":{redis_port}" in gateway.log_tail(20_000)          # the operator's log has the cause
