"""The worker's HTTP endpoint (``SLOTQ_METRICS_PORT``): Prometheus metrics, readiness and liveness.

* ``/metrics`` -- prometheus-client's exposition of the default registry.
* ``/ready`` -- 200 once the worker has loaded its model, run its warm-up decode and may claim jobs
  (heartbeat current, engine alive, not draining); 503 otherwise. Kubernetes' readinessProbe: a
  rolling update waits for the new pod to be warm before it stops an old one.
* ``/live`` -- 200 while the worker's event loop answers (it stamps a time every second); 503 when
  it has been stuck for ``stuck_after_s``. Kubernetes' livenessProbe: a hung loop is restarted. It
  does not depend on Redis, so a Redis outage never restarts workers.

Each answers with a small JSON body saying why. The server runs in a daemon thread (as
prometheus-client's own ``start_http_server`` does), so it answers even while the loop is stuck.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


@dataclass
class Health:
    """What the endpoints report; the worker updates it, the HTTP thread reads it."""

    stuck_after_s: float = 30.0
    ready_check: Callable[[], tuple[bool, dict[str, Any]]] = lambda: (False, {"state": "starting"})
    _loop_alive_at: float = field(default_factory=time.monotonic)

    def tick(self) -> None:
        """Called from the event loop: it is alive."""
        self._loop_alive_at = time.monotonic()

    def live(self) -> tuple[bool, dict[str, Any]]:
        idle = time.monotonic() - self._loop_alive_at
        return idle < self.stuck_after_s, {"event_loop_idle_s": round(idle, 1)}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return self.ready_check()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:      # probes every few seconds: no access log
        pass


def app(health: Health) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    metrics = make_wsgi_app()
    checks = {"/ready": health.ready, "/live": health.live}

    def serve(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            page: Iterable[bytes] = metrics(environ, start_response)     # prometheus_client's app is untyped
            return page
        ok, detail = check()
        body = json.dumps({"ok": ok, **detail}).encode()
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return serve


def serve(port: int, health: Health, addr: str = "0.0.0.0") -> WSGIServer:
    server = make_server(addr, port, app(health), server_class=_ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="slotq-http", daemon=True).start()
    return server
