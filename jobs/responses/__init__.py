"""OpenAI's Responses API wire format: request models, translation to and from slotq jobs.

``/v1/responses`` runs the same generation job as ``/v1/chat/completions``: this package only
translates the Responses shapes (``input`` items, ``instructions``, ``function_call`` /
``function_call_output`` items, ``text.format``, function ``tools``) into that job and the job's
result back into a Response object. Errors keep OpenAI's shape, so it reuses the OpenAI
translation's error type (:class:`~slotq.jobs.openai.errors.ApiError`); it imports neither the
gateway nor a web framework (the streaming events are the gateway's).

Modules: ``wire`` (the request body and the Response object as pydantic models), ``translate``
(a body -> ``JobRequest``; a result -> a Response; slotq's names -> the request's for errors).
"""
