"""The OpenAI wire format: request models, translation to and from slotq jobs, error bodies.

The one translation that the gateway's routes and OpenAI Batch lines (:mod:`slotq.jobs.bulk.openai_batch`,
in ``slotq bulk`` and the gateway's Batch API) share, so a body gets the same validation, the same
errors and the same response objects whichever way it arrives. It is a folder of its own, not part of
the gateway, so that bulk does not import the gateway: it imports neither the gateway nor bulk, and no
web framework, so ``slotq bulk`` does not load the web stack.

Modules: ``wire`` (the request bodies and response objects as pydantic models), ``translate``
(a body -> slotq's ``JobRequest``; a result or stream entry -> OpenAI's objects and finish reasons),
``errors`` (``ApiError``: OpenAI's error body and the HTTP status it goes with).
"""
