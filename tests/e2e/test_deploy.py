"""The Kubernetes manifests in deploy/kubernetes agree with the code: every SLOTQ_* variable they
set is a real setting, every probe path is served, KEDA reads the key the queue keeps its demand
in (on a single Redis, and in deploy/kubernetes/cluster on a Redis Cluster, where the key carries the
queue's hash tag; in cluster/partitioned, the keys of every partition, summed), the worker's grace
period outlasts its exit bound, and the gateway's files volume is where its setting points. (No
cluster here: this checks what a typo would break on the first apply.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from slotq.jobs.gateway.app import create_app
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.protocol.connection import parse_cluster_url
from slotq.jobs.protocol.keys import QueueKeys, partition_names
from slotq.jobs.settings import ClientSettings
from slotq.jobs.worker.health import Health, app
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.worker import EXIT_MARGIN_S
from tests.support import REPO_ROOT

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
ON_A_CLUSTER = KUBERNETES / "cluster"       # what replaces the single Redis' Secret and ScaledObject
PARTITIONED = ON_A_CLUSTER / "partitioned"  # what replaces the cluster's ScaledObject for SLOTQ_QUEUE_PARTITIONS=3


def _documents(directory: Path = KUBERNETES) -> dict[tuple[str, str], dict[str, Any]]:
    docs = {}
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _without(mapping: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if k not in keys}


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    [container] = doc["spec"]["template"]["spec"]["containers"]
    return container


def test_every_slotq_variable_in_the_manifests_is_a_setting() -> None:
    known = {f"SLOTQ_{name.upper()}" for name in set(WorkerSettings.model_fields) | set(GatewaySettings.model_fields)}
    used = {var for path in KUBERNETES.rglob("*.yaml") for var in re.findall(r"\bSLOTQ_[A-Z0-9_]+", path.read_text())}
    assert used, "no SLOTQ_ variable found"
    assert used <= known, sorted(used - known)


def test_a_systemd_instance_may_serve_a_model_of_its_own() -> None:
    """The worker unit reads an optional per-instance file after the shared one (systemd: a later file's
    value wins), so ``slotq-worker@2`` can serve a second model on its own queue (deploy/README.md);
    what deploy/README.md puts in that file are real settings."""
    unit = (REPO_ROOT / "deploy" / "systemd" / "slotq-worker@.service").read_text()
    files = re.findall(r"^EnvironmentFile=(.*)$", unit, re.MULTILINE)
    assert files == ["/etc/slotq/slotq.env", "-/etc/slotq/slotq-worker%i.env"]
    example = re.search(r"printf '(.*?)'", (REPO_ROOT / "deploy" / "README.md").read_text())
    assert example is not None
    names = {line.split("=")[0] for line in example.group(1).split("\\n") if line}
    assert names == {"SLOTQ_MODEL", "SLOTQ_MODEL_NAME", "SLOTQ_QUEUE_NAME"}
    assert {name.removeprefix("SLOTQ_").lower() for name in names} <= set(WorkerSettings.model_fields)


def _config() -> dict[str, str]:
    return _documents()[("ConfigMap", "slotq-config")]["data"]


def _demand_keys(*, clustered: bool, partitions: int = 1) -> list[str]:
    """QueueKeys.jobs of each partition of the ConfigMap's queue, which is the default queue."""
    queue = _config()["SLOTQ_QUEUE_NAME"]
    assert queue == ClientSettings.model_fields["queue_name"].default
    lanes = tuple(ClientSettings.model_fields["lanes"].get_default(call_default_factory=True))
    return [QueueKeys(name, lanes, clustered=clustered).jobs for name in partition_names(queue, partitions)]


def _demand_key(*, clustered: bool) -> str:
    [key] = _demand_keys(clustered=clustered)
    return key


def test_keda_scales_on_the_queues_demand_key() -> None:
    """listName is the key QueueKeys.jobs computes for the ConfigMap's queue, and listLength is the
    slots per pod."""
    [trigger] = _documents()[("ScaledObject", "slotq-worker")]["spec"]["triggers"]
    assert trigger["type"] == "redis"
    assert trigger["metadata"]["listName"] == _demand_key(clustered=False)
    assert trigger["metadata"]["listLength"] == _config()["SLOTQ_SLOTS"]


def test_keda_on_a_cluster_scales_on_the_queues_demand_key_in_its_slot() -> None:
    """The cluster variant: KEDA's `redis-cluster` trigger reads the same demand under its cluster
    name (`{slotq:queue}:jobs`), from the nodes SLOTQ_REDIS_URL names, with TLS as the URL says; the
    rest of the ScaledObject is the single Redis' one, and its Secret offers the same keys."""
    single, cluster = _documents(), _documents(ON_A_CLUSTER)
    scaled = cluster[("ScaledObject", "slotq-worker")]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis-cluster"
    assert trigger["metadata"]["listName"] == _demand_key(clustered=True) == "{slotq:queue}:jobs"
    assert trigger["metadata"]["listLength"] == _config()["SLOTQ_SLOTS"]
    assert "databaseIndex" not in trigger["metadata"]              # a cluster has database 0 only
    assert {k: v for k, v in scaled["spec"].items() if k != "triggers"} == \
        {k: v for k, v in single[("ScaledObject", "slotq-worker")]["spec"].items() if k != "triggers"}
    assert ("TriggerAuthentication", trigger["authenticationRef"]["name"]) in cluster

    secret = cluster[("Secret", "slotq")]["stringData"]
    assert set(secret) == set(single[("Secret", "slotq")]["stringData"])
    url = parse_cluster_url(secret["SLOTQ_REDIS_URL"])
    assert url is not None, "SLOTQ_REDIS_URL is no redis+cluster:// URL"
    assert [f"{host}:{port}" for host, port in url.nodes] == trigger["metadata"]["addresses"].split(",")
    assert trigger["metadata"]["enableTLS"] == str(url.tls).lower()


def test_keda_on_a_partitioned_queue_scales_on_the_sum_of_its_partitions_demand() -> None:
    """The partitioned variant (SLOTQ_QUEUE_PARTITIONS=3): one `redis-cluster` trigger per partition on the
    key QueueKeys(..., clustered=True).jobs of the name keys.partition_names gives it, each otherwise the
    cluster trigger; a scalingModifiers formula sums them (the HPA alone would take the largest), scaled
    on SLOTQ_SLOTS per pod. Two-digit trigger names: KEDA pairs metrics with triggers by name prefix. The
    rest of the ScaledObject, and its TriggerAuthentication, are the cluster variant's."""
    cluster, partitioned = _documents(ON_A_CLUSTER), _documents(PARTITIONED)
    scaled, plain = partitioned[("ScaledObject", "slotq-worker")], cluster[("ScaledObject", "slotq-worker")]
    triggers = scaled["spec"]["triggers"]
    assert [t["metadata"]["listName"] for t in triggers] == _demand_keys(clustered=True, partitions=3) == [
        "{slotq:queue}:jobs", "{slotq:queue#2784}:jobs", "{slotq:queue#42530}:jobs"]
    names = [t["name"] for t in triggers]
    assert names == [f"partition_{i:02d}" for i in range(3)]
    [one] = plain["spec"]["triggers"]
    for trigger in triggers:
        assert _without(trigger, "name", "metadata") == _without(one, "metadata")
        assert _without(trigger["metadata"], "listName") == _without(one["metadata"], "listName")
    advanced = scaled["spec"]["advanced"]
    assert advanced["scalingModifiers"] == {"formula": " + ".join(names), "target": _config()["SLOTQ_SLOTS"],
                                            "metricType": "AverageValue", "activationTarget": "0"}
    assert _without(advanced, "scalingModifiers") == plain["spec"]["advanced"]
    assert _without(scaled["spec"], "triggers", "advanced") == _without(plain["spec"], "triggers", "advanced")
    assert partitioned[("TriggerAuthentication", "slotq-redis")] == cluster[("TriggerAuthentication", "slotq-redis")]


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
