"""Job payload and result encoding for arq: msgpack, never code-executing formats.

arq's default would let anyone who can write to Redis run code inside every worker. msgpack
carries only data. A payload that does not decode (written straight into Redis, or corrupted) is
turned into a *poison* job for ``generate``, which dead-letters it with the reason instead of
letting arq fail it silently.
"""

from __future__ import annotations

import time
from typing import Any, cast

import msgpack

from slotq.jobs.protocol.arq_formats import exception_data
from slotq.jobs.protocol.keys import JOB_FUNCTION

POISON_MARKER = "__slotq_poison__"


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, BaseException):     # arq stores exceptions as job results on failure
        return exception_data(obj)
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def serialize(data: dict[str, Any]) -> bytes:
    return cast(bytes, msgpack.packb(data, default=_to_plain, use_bin_type=True))   # msgpack is untyped


def deserialize(raw: bytes) -> dict[str, Any]:
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if isinstance(data, dict) and {"f", "a", "k"} <= data.keys():
            return data
        problem = "payload is not an arq job record"
    except Exception as exc:  # msgpack raises several unrelated exception types
        problem = f"payload is not msgpack ({type(exc).__name__})"
    return {
        "t": 1,
        "f": JOB_FUNCTION,
        "a": [{POISON_MARKER: problem, "size": len(raw)}],
        "k": {},
        "et": int(time.time() * 1000),
    }
