"""The whole path across processes: enqueue -> stream -> result, first run on a fresh machine, the
deploy manifests and alert rules against the code, the suite's own clean-up.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""
