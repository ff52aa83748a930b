"""slotq's job layer: Redis and arq around the engine. Installed as ``slotq.jobs``.

Each folder runs in one kind of process; docs/architecture.md ("The package layers") gives the order
in which they may import each other, and tests/e2e/test_seams.py holds the code to it:

- ``public/``: installed as the top-level ``slotq``: the producer's one short import.
- ``protocol/``: the Redis protocol every process speaks: key names, Lua scripts, the wire models,
  the stream entry codec, result and dead-letter records, the worker registry, the arq adapter. The
  only code that sends queue and stream commands to Redis.
- ``producer/``: runs inside your application: :class:`~slotq.jobs.producer.client.SlotqClient`,
  the blocking ``SyncSlotqClient`` and the shared stream reader.
- ``worker/``: the ``slotq worker`` process: claim loop, job runs, stream writer, health endpoint,
  supervision, elastic slots. The only place the engine (llama.cpp) is loaded.
- ``gateway/``: the ``slotq gateway`` process (FastAPI), a producer with an OpenAI-compatible API.
- ``bulk/``: ``slotq bulk`` and the gateway's Batch API: files of requests through a producer.
- ``openai/``: the OpenAI wire format (requests, results, error bodies), shared by gateway and bulk.
- ``cli/``: the ``slotq`` command (its parser and one module per command), the demo, status views.

``settings``, ``errors`` and ``aio`` are shared by all of them; so are ``redis_server`` (the embedded
Redis server that ``slotq worker`` starts when no ``SLOTQ_REDIS_URL`` is set, and that the gateway and
the other commands wait for) and ``child_processes`` (starting a child that dies with its parent, as
that server does, and reporting how one ended).
"""
