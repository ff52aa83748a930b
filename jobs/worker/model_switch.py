"""When a worker of several models switches to another one: the policy, pure (no Redis, no llama.cpp).

A worker given several models (``SLOTQ_MODELS``, ``SLOTQ_MODELS_DIR``) has one loaded at a time. Its
switch loop (:meth:`slotq.jobs.worker.worker.SlotqWorker._model_switch_loop`) observes its model's
queue and the queues of the other models it can load, asks this policy, and does what it says:
leave the queue, close the engine, load the other model, warm it up, join its queue. Tests drive
the policy with plain values.

Policy, in order of precedence:

1. Never drop a running job: the worker stays while it runs any. (It also claims nothing once it
   has decided to switch; a claim that raced the decision makes it stay after all.)
2. Never leave a model with demand: it stays while its model's queue has a job waiting, or one
   deferred (a retry waiting out its backoff, which only a worker of that queue promotes).
3. Hysteresis: it stays until its model's queue has been quiet -- nothing waiting or deferred,
   nothing running here -- for ``idle_s`` (``SLOTQ_MODEL_IDLE_S``), so the gaps of a bursty load
   do not make it unload a model it is about to need again.
4. Go only where no one else will: to a model whose queue has jobs waiting (or deferred) and no
   worker for them -- no worker's heartbeat advertises it (loaded, or loading) and no other worker
   is switching to it. A model that has a worker takes nothing from this one; of several idle
   workers, the one that marks the model as loading first
   (:func:`slotq.jobs.protocol.catalog.claim_load`) goes, and the mark stays until its heartbeat
   advertises the model.
5. Of those models, the one whose next job has waited longest (a model with only deferred jobs
   after any with a job waiting; ties by name, so every worker picks the same one and rule 4's
   mark sends one of them).

What follows: one worker serves every model it can load, one at a time, each burst paying one
load (about ``load_s`` + one poll, see docs/operations.md); a model with steady demand keeps its
worker, so with one worker a second model waits until the first's queue is quiet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

POLL_S = 0.25    # how often a worker of several models looks at its queue (and, once quiet, the others')


@dataclass(frozen=True)
class Demand:
    """What another model's queue holds: jobs ``waiting`` (claimable now), ``deferred`` (retries
    waiting out a backoff), how long the next waiting one has waited (``oldest_wait_s``, None with
    none waiting), and whether it is ``served``: a ready worker has the model loaded, or a worker
    is loading it."""

    model: str
    waiting: int
    deferred: int
    oldest_wait_s: float | None
    served: bool


def may_leave(*, running_here: int, pending: int, quiet_s: float, idle_s: float) -> bool:
    """Rules 1-3: whether the worker may leave its loaded model now. ``running_here``: jobs it
    holds; ``pending``: jobs waiting or deferred in its model's queue; ``quiet_s``: how long both
    have been zero."""
    return running_here == 0 and pending == 0 and quiet_s >= idle_s


def neediest(others: Iterable[Demand]) -> str | None:
    """Rules 4-5: the model to switch to, of ``others``, or None (no model needs this worker)."""
    wanted = [d for d in others if not d.served and (d.waiting or d.deferred)]
    if not wanted:
        return None
    # waiting jobs first, the longest wait first, then by name
    return min(wanted, key=lambda d: (d.waiting == 0, -(d.oldest_wait_s or 0.0), d.model)).model


def choose(*, running_here: int, pending: int, quiet_s: float, idle_s: float, others: Iterable[Demand]) -> str | None:
    """The model to switch to now, or None to stay (rules 1-5)."""
    if not may_leave(running_here=running_here, pending=pending, quiet_s=quiet_s, idle_s=idle_s):
        return None
    return neediest(others)
