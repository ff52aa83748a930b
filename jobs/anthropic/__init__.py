"""Anthropic's Messages API wire format: request models, translation to and from slotq jobs, error bodies.

``/v1/messages`` runs the same generation job as ``/v1/chat/completions``: this package only
translates Anthropic's shapes (``system``, content blocks, ``tool_use`` / ``tool_result``,
``tool_choice``, ``stop_sequences``) into that job and the job's result back into a Message. It
reuses the OpenAI translation's error type (:class:`~slotq.jobs.openai.errors.ApiError`, which the
gateway renders in Anthropic's shape on these routes) and imports neither the gateway nor a web
framework; the streaming events are the gateway's (:mod:`slotq.jobs.gateway.message_events`).

Modules: ``wire`` (the request bodies and the Message object as pydantic models), ``translate``
(a body -> ``JobRequest``; a result -> a Message; slotq's finish reasons -> ``stop_reason``),
``errors`` (Anthropic's error body and error types).
"""
