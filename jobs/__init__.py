"""slotq's job layer: Redis and arq around the engine. Installed as ``slotq.jobs``.

Each folder runs in one kind of process:

- ``protocol/``: the Redis protocol every process speaks: key names, Lua scripts, the stream entry
  codec, result and dead-letter records, the worker registry, the arq adapter. The only code that
  sends queue and stream commands to Redis.
- ``producer/``: runs inside your application: :class:`~slotq.jobs.producer.client.SlotqClient`,
  the blocking ``SyncSlotqClient`` and the shared stream reader.
- ``worker/``: the ``slotq worker`` process: claim loop, job runs, stream writer, health endpoint,
  supervision, elastic slots. The only place the engine (llama.cpp) is loaded.
- ``gateway/``: the ``slotq gateway`` process (FastAPI), a producer with an OpenAI-compatible API.
- ``bulk/``: ``slotq bulk`` and the gateway's Batch API: files of requests through a producer.
- ``cli/``: the ``slotq`` command (its parser and one module per command), the demo, status views.

``settings``, ``errors`` and ``aio`` are shared by all of them; so are ``redis_server`` (the embedded
Redis server that ``slotq worker`` starts when no ``SLOTQ_REDIS_URL`` is set, and that the gateway and
the other commands wait for) and ``child_processes`` (starting a child that dies with its parent, as
that server does, and reporting how one ended).
"""
