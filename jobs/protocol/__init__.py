"""slotq's Redis protocol, spoken by every process (worker, producer, gateway, bulk, CLI).

Key names (``keys``), the queue's Lua scripts (``scripts``) and their typed API (``redis_queue``),
the stream entry codec, appends and reads (``streams``), the worker registry (``registry``), job
payloads and results (``schemas``, ``payload``, ``serialization``; ``wire`` states their engine-shaped
parts apart from the engine, which protocol never imports), dead letters (``dead_letters``),
connecting (``connection``), awaiting redis-py's commands with checked types (``replies``), the
preemption victim rule (``preemption``), arq's key names and record formats (``arq_formats``) and
the adapter around arq (``arq_adapter``, which only the worker imports). Nothing
outside this package names a Redis key, calls a Redis command on the queue or the streams, or
imports arq; the gateway's own records (files, batches, its job records) are the gateway's, in
:mod:`slotq.jobs.gateway.records`.
"""
