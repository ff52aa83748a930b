"""Awaiting redis-py's asyncio commands with a type mypy can check.

redis-py 5 annotates each command once for its sync and its asyncio client: ``hgetall`` returns
``Awaitable[dict] | dict``, ``hmget`` ``Awaitable[list] | list``, and so on. On ``redis.asyncio.Redis``
a command always returns the awaitable, but mypy cannot tell which client it is, and refuses to
``await`` the union. Where redis-py's reply type is itself wrong (``hget`` says ``str`` where a client
without ``decode_responses`` gets ``bytes``; ``blpop`` says ``list`` where it gets a tuple, or None at
its timeout), the call site casts to the real type instead.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar, cast

T = TypeVar("T")


async def reply(call: Awaitable[T] | T) -> T:
    """The reply of a command called on ``redis.asyncio.Redis``, typed as redis-py types it: awaits
    ``call`` as it is (a cast, no check), so nothing changes at run time."""
    return await cast("Awaitable[T]", call)
