"""The Kubernetes manifests in deploy/kubernetes agree with the code: every SLOTQ_* variable they
set is a real setting, every probe path is served, KEDA reads the key the queue keeps its demand
in, the worker's grace period outlasts its exit bound, and the gateway's files volume is where its
setting points. (No cluster here: this checks what a typo would break on the first apply.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from slotq.jobs.gateway.app import create_app
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.protocol.keys import QueueKeys
from slotq.jobs.settings import ClientSettings
from slotq.jobs.worker.health import Health, app
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.worker import EXIT_MARGIN_S
from tests.support import REPO_ROOT

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"


def _documents() -> dict[tuple[str, str], dict[str, Any]]:
    docs = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    [container] = doc["spec"]["template"]["spec"]["containers"]
    return container


def test_every_slotq_variable_in_the_manifests_is_a_setting() -> None:
    known = {f"SLOTQ_{name.upper()}" for name in set(WorkerSettings.model_fields) | set(GatewaySettings.model_fields)}
    used = {var for path in KUBERNETES.glob("*.yaml") for var in re.findall(r"\bSLOTQ_[A-Z0-9_]+", path.read_text())}
    assert used, "no SLOTQ_ variable found"
    assert used <= known, sorted(used - known)


def _config() -> dict[str, str]:
    return _documents()[("ConfigMap", "slotq-config")]["data"]


def test_keda_scales_on_the_queues_demand_key() -> None:
    """listName is the key QueueKeys.jobs computes for the ConfigMap's queue, which is the default
    queue, and listLength is the slots per pod."""
    config = _config()
    [trigger] = _documents()[("ScaledObject", "slotq-worker")]["spec"]["triggers"]
    assert trigger["type"] == "redis"
    queue = config["SLOTQ_QUEUE_NAME"]
    assert queue == ClientSettings.model_fields["queue_name"].default
    lanes = tuple(ClientSettings.model_fields["lanes"].get_default(call_default_factory=True))
    assert trigger["metadata"]["listName"] == QueueKeys(queue, lanes).jobs
    assert trigger["metadata"]["listLength"] == config["SLOTQ_SLOTS"]


def test_the_worker_grace_period_outlasts_its_exit_bound() -> None:
    """Kubernetes' SIGKILL must not cut the hand-back short: the pod's grace period exceeds the
    worker's exit bound, SLOTQ_DRAIN_GRACE_S + EXIT_MARGIN_S (jobs/worker/worker.py)."""
    spec = _documents()[("Deployment", "slotq-worker")]["spec"]["template"]["spec"]
    bound = int(_config()["SLOTQ_DRAIN_GRACE_S"]) + EXIT_MARGIN_S
    assert spec["terminationGracePeriodSeconds"] > bound, (spec["terminationGracePeriodSeconds"], bound)


def test_the_worker_probes_are_served() -> None:
    worker = _container(_documents()[("Deployment", "slotq-worker")])
    serve = app(Health(ready_check=lambda: (True, {})))
    for probe in ("readinessProbe", "livenessProbe"):
        statuses: list[str] = []
        body = b"".join(serve({"PATH_INFO": worker[probe]["httpGet"]["path"], "REQUEST_METHOD": "GET"},
                              lambda status, _headers, statuses=statuses: statuses.append(status)))
        assert statuses == ["200 OK"] and b'"ok": true' in body, (probe, statuses, body[:200])


def test_the_gateway_manifest_matches_the_gateway(tmp_path: Path) -> None:
    docs = _documents()
    deployment = docs[("Deployment", "slotq-gateway")]
    gateway = _container(deployment)
    env = {e["name"]: e for e in gateway["env"]}
    # it binds beyond loopback, so it must get API keys (the gateway refuses to start without them)
    assert env["SLOTQ_GATEWAY_HOST"]["value"] == "0.0.0.0" and "secretKeyRef" in env["SLOTQ_API_KEYS"]["valueFrom"]
    settings = GatewaySettings(_env_file=None, gateway_host="0.0.0.0", api_keys="k",
                               gateway_port=int(env["SLOTQ_GATEWAY_PORT"]["value"]),
                               gateway_metrics_port=int(env["SLOTQ_GATEWAY_METRICS_PORT"]["value"]))
    assert settings.bind_error(settings.gateway_host) is None
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"http": settings.gateway_port, "metrics": settings.gateway_metrics_port}
    # probes and the Prometheus scrape hit routes the app serves; Prometheus scrapes the private port
    routes = set(create_app(settings, "redis://127.0.0.1:1/0").openapi()["paths"])
    assert gateway["readinessProbe"]["httpGet"]["path"] in routes
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes
    assert int(annotations["prometheus.io/port"]) == settings.gateway_metrics_port
    # the Batch API's files live on the shared volume
    [mount] = gateway["volumeMounts"]
    assert mount["mountPath"] == env["SLOTQ_GATEWAY_FILES_DIR"]["value"]
    [volume] = deployment["spec"]["template"]["spec"]["volumes"]
    claim = docs[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]            # every replica mounts it
    service = docs[("Service", "slotq-gateway")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # the Service publishes the API only: the metrics port shows every tenant and stays private
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # the secret example offers every key the manifests read
    secret = docs[("Secret", "slotq")]["stringData"]
    refs = {e["valueFrom"]["secretKeyRef"]["key"] for doc in docs.values() if doc["kind"] == "Deployment"
            for e in _container(doc).get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs <= set(secret), sorted(refs - set(secret))
