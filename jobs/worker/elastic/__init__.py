"""Elastic workers: active slots that follow memory, KV use, decode speed and waiting work, and
degradation steps under sustained pressure. ``controller`` is the pure policy; ``loop`` runs it
inside a worker."""
