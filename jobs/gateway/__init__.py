"""slotq's HTTP gateway: an OpenAI-compatible API, background jobs and a dashboard, all on the
producer client (``slotq.jobs.producer.client``). It never touches the engine or llama.cpp.

The OpenAI translation (request models, requests -> JobRequest, results -> responses, ``ApiError``)
is :mod:`slotq.jobs.openai`, which Batch lines share. Modules: ``settings`` (GatewaySettings),
``http_errors`` (``ApiError`` and the web stack's own errors as HTTP responses),
``chunks`` (stream entries -> SSE events), ``sse`` (serving streams, disconnects), ``service``
(per-queue clients, job records), ``records`` (every Redis key and command of the gateway's own
records: job records, models seen, files, batches), ``routing`` (model -> queue from heartbeats), ``auth`` (API keys
and their tenants), ``limits`` (body size, read deadlines, the keyless mode's Host and Origin
checks), ``routes_*`` (the HTTP endpoints), ``app`` and ``server`` (the ASGI app and ``slotq
gateway``), ``static/`` (the dashboard).
"""
