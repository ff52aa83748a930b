"""slotq's HTTP gateway: an OpenAI-compatible API, background jobs and a dashboard, all on the
producer client (``slotq.jobs.producer.client``). It never touches the engine or llama.cpp.

Modules: ``settings`` (GatewaySettings), ``openai/`` (the OpenAI translation, shared with Batch
lines: ``wire``, OpenAI's request/response shapes; ``translate``, requests -> JobRequest, results
-> responses), ``errors`` (ApiError, OpenAI's error shape) and ``http_errors`` (as HTTP responses),
``chunks`` (stream entries -> SSE events), ``sse`` (serving streams, disconnects), ``service``
(per-queue clients, job records), ``records`` (every Redis key and command of the gateway's own
records: job records, models seen, files, batches), ``routing`` (model -> queue from heartbeats), ``auth`` (API keys
and their tenants), ``limits`` (body size, read deadlines, the keyless mode's Host and Origin
checks), ``routes_*`` (the HTTP endpoints), ``app`` and ``server`` (the ASGI app and ``slotq
gateway``), ``static/`` (the dashboard).
"""
