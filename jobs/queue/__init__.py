"""slotq's queue: Redis structures and scripts (``keys``, ``scripts``), their typed API
(``redis_queue``) and the arq runtime they feed (``runtime``)."""
