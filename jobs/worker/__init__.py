"""The ``slotq worker`` process: one engine (one model, N slots) fed from the queue.

:mod:`~slotq.jobs.worker.worker` (the process: heartbeat, drain), :mod:`~slotq.jobs.worker.runtime` (the
claim loop: claims, token waits, maintenance, how a job leaves; it runs each attempt through arq's adapter)
with :mod:`~slotq.jobs.worker.slot_ledger` (which job holds which slot) and
:mod:`~slotq.jobs.worker.preemption_policy` (what a full worker does with a busy token),
:mod:`~slotq.jobs.worker.job_run` (one attempt of one job) with :mod:`~slotq.jobs.worker.resume`,
:mod:`~slotq.jobs.worker.attempts` and :mod:`~slotq.jobs.worker.results`, :mod:`~slotq.jobs.worker.stream_writer`
(its output, batched per flush), :mod:`~slotq.jobs.worker.health` and :mod:`~slotq.jobs.worker.metrics` (the HTTP
endpoint), :mod:`~slotq.jobs.worker.supervisor` (background loops that never die quietly),
:mod:`~slotq.jobs.worker.elastic` (slots that follow memory), :mod:`~slotq.jobs.worker.engine_api` (the
engine surface it uses) and :mod:`~slotq.jobs.worker.fault_injection` (test hooks, off unless set).
"""
