"""slotq's job layer: Redis and arq around the engine (settings, client, worker, streams, CLI)."""
