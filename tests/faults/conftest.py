"""Nothing lost: kill -9, SIGSTOP, Redis restarts, TCP cuts and bad input against real processes
(tests/support/faults.py). Each test gets its own Valkey with ``appendfsync always``.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""

from tests.support.faults import fault_backend, fclient, fsync_redis  # noqa: F401  (fixtures of this folder)
from tests.support.proxied_cluster import proxied_cluster  # noqa: F401
