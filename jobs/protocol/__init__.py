"""slotq's Redis protocol, spoken by every process (worker, producer, gateway, bulk, CLI).

Key names (``keys``), the queue's Lua scripts (``scripts``) and their typed API (``redis_queue``),
the stream entry codec (``streams``), job payloads and results (``schemas``, ``payload``,
``serialization``), dead letters (``dead_letters``), connecting (``connection``), the preemption
victim rule (``preemption``) and the adapter around arq (``arq_adapter``). Nothing outside this
package names a Redis key or imports arq.
"""
