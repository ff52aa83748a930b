"""The producer side: runs inside your application (a web app, a script, the gateway, ``slotq bulk``).

:class:`~slotq.jobs.producer.client.SlotqClient` enqueues, follows streams (one shared XREAD per
client: :mod:`~slotq.jobs.producer.stream_reader`), awaits results and cancels;
:class:`~slotq.jobs.producer.sync_client.SyncSlotqClient` wraps it for blocking code. Nothing here
loads the engine.
"""
