"""Each script's KEYS and ARGV, laid out from ONE typed table that both sides read.

A script is a frozen, keyword-only dataclass deriving from :class:`LuaScript`: its fields are the
table. Each field is one of the script's keys (:data:`Key`), a list of keys (:data:`KeyList`, of
strings or of a dataclass of keys per element, such as :class:`~slotq.jobs.protocol.keys.LaneKeys`),
one argument (:data:`Arg`) or a list of arguments (:data:`ArgList`). An instance is one call,
built by keyword, so a value cannot be left out (mypy, and the dataclass at run time, refuse it)
nor put in the wrong place. The same fields give

* the Python side: :meth:`LuaScript.keys` and :meth:`LuaScript.args`, the lists sent with EVALSHA;
* the Lua side: :func:`lua_source`, the script's body behind a preamble that names every value
  (``local lease_ms = tonumber(ARGV[4])``, ``local lanes = {...}``), so a body never indexes KEYS
  or ARGV itself.

The layout both follow: KEYS holds the single keys in field order, then every key list in field
order (a list of dataclasses element by element, its keys in field order). ARGV holds the length
of every list (keys and arguments, in field order), then the single arguments in field order,
then every argument list. How a value crosses: ``int`` as its digits (a Lua number in the body),
``int | None`` as digits or ``''`` (a number or nil), ``bool`` as ``'1'`` or ``''`` (a Lua
boolean), ``str`` and ``bytes`` as they are (a Lua string).

A script whose class sets ``FLAGS`` starts with Redis' shebang line (``#!lua flags=...``): a
script that sets ``allow-cross-slot-keys`` declares the keys of one slot (which route the call)
and may touch keys of other slots of the same node, passed as arguments
(:class:`~slotq.jobs.protocol.scripts.stream_flush.NodeStreamFlush`).

The layout is this release's alone: every client sends the body it was built with (EVALSHA of its
own text), so a rolling upgrade never runs one release's arguments through another's script.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, ClassVar, Generic, TypeVar, Union, get_args, get_origin, get_type_hints

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError
from redis.typing import EncodableT

T = TypeVar("T")
Reply = TypeVar("Reply", covariant=True)


class _Role(Enum):
    KEY = "key"
    KEY_LIST = "key list"
    ARG = "arg"
    ARG_LIST = "arg list"


Key = Annotated[str, _Role.KEY]
KeyList = Annotated[Sequence[T], _Role.KEY_LIST]     # T: str, or a dataclass whose fields are keys (str)
Arg = Annotated[T, _Role.ARG]                        # T: str, bytes, int, int | None or bool
ArgList = Annotated[Sequence[T], _Role.ARG_LIST]     # T: str, bytes or int (or a union of them)


class LuaScript(Generic[Reply]):
    """One call of a Lua script, ``Reply`` being what Redis answers (as redis-py returns it).
    Subclasses are frozen, keyword-only dataclasses (see the module) with the Lua that follows the
    preamble: ``HELPERS``, the shared functions it calls (:mod:`slotq.jobs.protocol.scripts.lua`),
    then its own ``BODY``; ``FLAGS``, if any, go before all of it as its shebang line."""

    HELPERS: ClassVar[str] = ""
    BODY: ClassVar[str]
    FLAGS: ClassVar[tuple[str, ...]] = ()      # Redis script flags, as a shebang line; none: no shebang

    def keys(self) -> list[str]:
        """KEYS, laid out as the module says."""
        table = _table(type(self))
        out = [getattr(self, f.name) for f in table.keys]
        for f in table.key_lists:
            for element in getattr(self, f.name):
                out += [element] if f.group is None else [getattr(element, name) for name in f.group]
        return out

    def args(self) -> list[EncodableT]:
        """ARGV, laid out as the module says."""
        table = _table(type(self))
        out: list[EncodableT] = [len(getattr(self, f.name)) for f in (*table.key_lists, *table.arg_lists)]
        out += [_encode(getattr(self, f.name)) for f in table.args]
        for f in table.arg_lists:
            out += [_encode(value) for value in getattr(self, f.name)]
        return out


def _encode(value: Any) -> EncodableT:
    if value is None or value is False:
        return ""
    if value is True:
        return "1"
    if isinstance(value, (str, bytes, int)):
        return value
    raise TypeError(f"a script argument is a str, bytes, int, None or bool, not {type(value).__name__}")


# ------------------------------------------------------------------ the table, read once per script
@dataclass(frozen=True)
class _Field:
    name: str
    lua_value: str                       # Lua that converts the text ``{}`` to the body's value
    group: tuple[str, ...] | None = None  # a key list of dataclasses: their field names


@dataclass(frozen=True)
class _Table:
    keys: tuple[_Field, ...]
    key_lists: tuple[_Field, ...]
    args: tuple[_Field, ...]
    arg_lists: tuple[_Field, ...]


_LUA_KEYWORDS = frozenset("and break do else elseif end false for function if in local nil not or repeat return then "
                          "true until while".split())


def _lua_value(base: Any, where: str) -> str:
    """The Lua that turns an argument's text ``{}`` into the value its Python type promises."""
    if base is int or _members(base) == {int, type(None)}:
        return "tonumber({})"
    if base is bool:
        return "{} == '1'"
    if base in (str, bytes) or _members(base) <= {str, bytes, int}:
        return "{}"
    raise TypeError(f"{where}: an argument is str, bytes, int, int | None or bool, not {base}")


def _members(base: Any) -> set[Any]:
    return set(get_args(base)) if get_origin(base) in (Union, types.UnionType) else {base}


_tables: dict[type[LuaScript[Any]], _Table] = {}


def _table(script: type[LuaScript[Any]]) -> _Table:
    """The table of ``script`` (read from its fields once)."""
    if script not in _tables:
        _tables[script] = _read_table(script)
    return _tables[script]


def _read_table(script: type[LuaScript[Any]]) -> _Table:
    hints = get_type_hints(script, include_extras=True)
    parts: dict[_Role, list[_Field]] = {role: [] for role in _Role}
    for f in dataclasses.fields(script):     # type: ignore[arg-type]  # every LuaScript subclass is a dataclass
        where = f"{script.__name__}.{f.name}"
        hint = hints[f.name]
        if get_origin(hint) is not Annotated or not isinstance(hint.__metadata__[0], _Role):
            raise TypeError(f"{where}: annotate it as Key, KeyList[...], Arg[...] or ArgList[...]")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", f.name) or f.name in _LUA_KEYWORDS:
            raise TypeError(f"{where}: not usable as a Lua local")
        role, base = hint.__metadata__[0], get_args(hint)[0]
        element = get_args(base)[0] if role in (_Role.KEY_LIST, _Role.ARG_LIST) else base
        group = None
        if role is _Role.KEY_LIST and dataclasses.is_dataclass(element):
            group = tuple(g.name for g in dataclasses.fields(element))
        elif role in (_Role.KEY, _Role.KEY_LIST) and element is not str:
            raise TypeError(f"{where}: a key is a str (or, in a key list, a dataclass of str)")
        lua = "{}" if role in (_Role.KEY, _Role.KEY_LIST) else _lua_value(element, where)
        parts[role].append(_Field(f.name, lua, group))
    return _Table(*(tuple(parts[role]) for role in (_Role.KEY, _Role.KEY_LIST, _Role.ARG, _Role.ARG_LIST)))


def _preamble(script: type[LuaScript[Any]]) -> str:
    """The Lua that names every value of KEYS and ARGV as a local, by the table of ``script``."""
    table = _table(script)
    lines = [f"-- KEYS and ARGV as {script.__module__}.{script.__qualname__} lays them out (layout.py)"]
    lines += [f"local {f.name} = KEYS[{i}]" for i, f in enumerate(table.keys, 1)]
    lengths = {f.name: f"tonumber(ARGV[{i}])" for i, f in enumerate((*table.key_lists, *table.arg_lists), 1)}
    lines += [f"local {f.name} = {f.lua_value.format(f'ARGV[{i}]')}"
              for i, f in enumerate(table.args, len(lengths) + 1)]
    for source, start, lists in (("KEYS", len(table.keys), table.key_lists),
                                 ("ARGV", len(lengths) + len(table.args), table.arg_lists)):
        offset = str(start)
        for f in lists:
            width = len(f.group) if f.group else 1
            lines.append(f"local {f.name} = {{}}")
            if f.group is None:
                lines.append(f"for i = 1, {lengths[f.name]} do "
                             f"{f.name}[i] = {f.lua_value.format(f'{source}[{offset} + i]')} end")
            else:
                fields = ", ".join(f"{name} = {source}[at + {n}]" for n, name in enumerate(f.group, 1))
                lines.append(f"for i = 1, {lengths[f.name]} do local at = {offset} + {width} * (i - 1); "
                             f"{f.name}[i] = {{{fields}}} end")
            offset += f" + {width} * #{f.name}" if width > 1 else f" + #{f.name}"
    return "\n".join(lines) + "\n"


_LOCALS = re.compile(r"\blocal\s+([A-Za-z_][\w\s,]*?)\s*(?:=|\n)")
_FUNCTIONS = re.compile(r"\blocal\s+function\s+(\w+)")


def lua_source(script: type[LuaScript[Any]]) -> str:
    """The script's Lua: its shebang line (only with ``FLAGS``), the generated preamble, its ``HELPERS``,
    its ``BODY``. Raises when the body declares a local, or a helper a function, named like one of the
    script's values (it would hide it)."""
    table = _table(script)
    names = {f.name for f in (*table.keys, *table.key_lists, *table.args, *table.arg_lists)}
    declared = {name.strip() for match in _LOCALS.finditer(script.BODY) for name in match.group(1).split(",")}
    declared |= set(_FUNCTIONS.findall(script.HELPERS + script.BODY))
    if clash := sorted(names & declared):
        raise TypeError(f"{script.__name__}: its Lua declares {', '.join(clash)}, already a key or argument")
    shebang = f"#!lua flags={','.join(script.FLAGS)}\n" if script.FLAGS else ""
    return shebang + _preamble(script) + script.HELPERS + script.BODY


class ScriptRunner:
    """Runs scripts on one client: each is loaded once by its SHA (EVALSHA, EVAL's text as a fallback)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._loaded: dict[type[LuaScript[Any]], AsyncScript] = {}

    def _script(self, call: LuaScript[Any]) -> AsyncScript:
        script = type(call)
        if script not in self._loaded:
            self._loaded[script] = self._redis.register_script(lua_source(script))
        return self._loaded[script]

    async def run(self, call: LuaScript[Reply]) -> Reply:
        """Run ``call``; its reply as redis-py decodes it (the type the script declares)."""
        reply: Reply = await self._script(call)(keys=call.keys(), args=call.args())
        return reply

    async def run_and_wait(self, call: LuaScript[Reply], replicas: int, timeout_ms: int) -> tuple[Reply, int]:
        """Run ``call``, then WAIT for ``replicas`` replicas (at most ``timeout_ms``): its reply, and how many
        replicas acknowledged it. One round trip on one connection, as WAIT counts the writes of the
        connection it is sent on: a pipeline (on a cluster, a cluster pipeline whose WAIT goes to the node of
        the script's first key, so both travel on that node's connection). A NOSCRIPT answer (nothing ran)
        loads the script and sends both again."""
        try:
            return await self._evalsha_and_wait(call, replicas, timeout_ms)
        except NoScriptError:
            await self._load(call)
            return await self._evalsha_and_wait(call, replicas, timeout_ms)

    async def _evalsha_and_wait(self, call: LuaScript[Reply], replicas: int, timeout_ms: int) -> tuple[Reply, int]:
        keys = call.keys()
        pipe = self._pipeline()
        self._send(pipe, call)
        if isinstance(self._redis, RedisCluster):
            pipe.wait(replicas, timeout_ms, target_nodes=self._redis.get_node_from_key(keys[0]))
        else:
            pipe.wait(replicas, timeout_ms)
        reply, acknowledged = await pipe.execute()
        return reply, int(acknowledged)

    async def run_all(self, calls: Sequence[LuaScript[Any]], *, return_refusals: bool = False) -> list[Any]:
        """Run ``calls`` in one round trip, in order, each atomic but not together; their replies.
        With ``return_refusals``, a call Redis answered with an error (a ``ResponseError``: a script error,
        a key this node does not serve) has that error in its place instead of raising it.
        They go out as one pipeline (on a cluster one cluster pipeline, which sends each node its calls in
        one batch, the nodes at once, so a node reads them with one system call, not one per call).

        Each call goes as EVALSHA by name, not through redis-py's registered script, whose pipeline asks
        SCRIPT EXISTS first: a hidden round trip per pipeline (and a cluster pipeline refuses its evalsha()
        method). A call answered NOSCRIPT (a server that never ran the script: restarted, or a replica just
        promoted) runs again on its own, which loads it; nothing else is sent twice."""
        if len(calls) == 1:
            replies: list[Any] = [await self._run_alone(calls[0], return_refusals)]
        else:
            pipe = self._pipeline()
            for call in calls:
                self._send(pipe, call)
            replies = await pipe.execute(raise_on_error=False)
        out = []
        for call, reply in zip(calls, replies):
            if isinstance(reply, NoScriptError):
                reply = await self._run_alone(call, return_refusals)
            elif isinstance(reply, Exception) and not (return_refusals and isinstance(reply, ResponseError)):
                raise reply
            out.append(reply)
        return out

    async def _run_alone(self, call: LuaScript[Any], return_refusals: bool) -> Any:
        """:meth:`run`, its ``ResponseError`` returned rather than raised with ``return_refusals``."""
        try:
            return await self.run(call)
        except ResponseError as exc:
            if not return_refusals:
                raise
            return exc

    def _pipeline(self) -> Pipeline | ClusterPipeline:
        """A pipeline without a transaction (a cluster's has none)."""
        if isinstance(self._redis, RedisCluster):
            pipe: ClusterPipeline = self._redis.pipeline()
            return pipe
        return self._redis.pipeline(transaction=False)

    def _send(self, pipe: Pipeline | ClusterPipeline, call: LuaScript[Any]) -> None:
        """Queue ``call`` on ``pipe`` as EVALSHA by name (see :meth:`run_all`)."""
        keys = call.keys()
        pipe.execute_command("EVALSHA", self._script(call).sha, len(keys), *keys, *call.args())

    async def _load(self, call: LuaScript[Any]) -> None:
        """Load ``call``'s script (on a cluster, on every primary)."""
        await self._redis.script_load(self._script(call).script)
