"""OpenAI's chat and completions API as slotq jobs: the one translation that the gateway's routes and
OpenAI Batch lines (:mod:`slotq.jobs.bulk.openai_batch`, in ``slotq bulk`` and the gateway's Batch
API) share, so a body gets the same validation, the same errors and the same response objects
whichever way it arrives.

Runs in the gateway and in the bulk runner's process. It imports no web framework, so ``slotq bulk``
does not load the web stack.

Modules: ``wire`` (the request bodies and response objects as pydantic models), ``translate``
(a body -> slotq's ``JobRequest``; a result or stream entry -> OpenAI's objects and finish reasons).
"""
