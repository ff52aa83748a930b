"""The scripts' KEYS and ARGV come from one typed table (jobs/protocol/scripts/layout.py): the Lua
preamble and the Python lists are laid out from the same fields, so every value reaches the body
under its name, whatever the lengths of the lists before it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis

from slotq.jobs.protocol.keys import LaneKeys
from slotq.jobs.protocol.scripts import admission, attempts, claims, stream_flush
from slotq.jobs.protocol.scripts.layout import Arg, ArgList, Key, KeyList, LuaScript, ScriptRunner, lua_source


@dataclass(frozen=True, kw_only=True)
class _Echo(LuaScript[list[bytes]]):
    """Answers every value it was given, as the body sees it."""

    first: Key
    names: KeyList[str]
    lanes: KeyList[LaneKeys]
    last: Key
    text: Arg[str]
    number: Arg[int]
    maybe: Arg[int | None]
    flag: Arg[bool]
    numbers: ArgList[int]
    words: ArgList[str]

    BODY = """
local out = {first, last, text, tostring(number + 1), tostring(maybe), tostring(flag)}
for _, name in ipairs(names) do out[#out + 1] = name end
for _, lane in ipairs(lanes) do
  out[#out + 1] = lane.waiting .. '/' .. lane.deferred .. '/' .. lane.running .. '/' .. lane.preempt
end
for _, n in ipairs(numbers) do out[#out + 1] = tostring(n * 2) end
for _, word in ipairs(words) do out[#out + 1] = word end
return out
"""


def _lanes(*names: str) -> list[LaneKeys]:
    return [LaneKeys(f"{n}:w", f"{n}:d", f"{n}:r", f"{n}:p") for n in names]


@pytest.mark.parametrize(("names", "lanes", "numbers"), [([], [], []), (["a"], _lanes("x", "y"), [1, 2, 3]),
                                                         (["a", "b", "c"], _lanes("x"), [])])
async def test_every_value_reaches_the_body_under_its_name(redis: Redis, names: list[str], lanes: list[LaneKeys],
                                                           numbers: list[int]) -> None:
    echoed = await ScriptRunner(redis).run(_Echo(first="f", names=names, lanes=lanes, last="l", text="t", number=41,
                                                 maybe=None, flag=True, numbers=numbers, words=["w1", "w2"]))
    assert [v.decode() for v in echoed] == [
        "f", "l", "t", "42", "nil", "true", *names,
        *(f"{k.waiting}/{k.deferred}/{k.running}/{k.preempt}" for k in lanes),
        *(str(2 * n) for n in numbers), "w1", "w2"]


async def test_false_and_numbers_cross_as_lua_values(redis: Redis) -> None:
    echoed = await ScriptRunner(redis).run(_Echo(first="f", names=[], lanes=[], last="l", text="", number=-1,
                                                 maybe=7, flag=False, numbers=[], words=[]))
    assert [v.decode() for v in echoed] == ["f", "l", "", "0", "7", "false"]


def test_a_value_left_out_is_refused() -> None:
    values: dict[str, Any] = dict(first="f", names=[], lanes=[], last="l", text="", number=1, maybe=None, numbers=[],
                                  words=[])
    with pytest.raises(TypeError, match="flag"):
        _Echo(**values)


def test_a_body_that_hides_a_value_is_refused() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Hiding(LuaScript[int]):
        jobs: Key
        count: Arg[int]
        BODY = "local jobs = 1\nreturn count"

    with pytest.raises(TypeError, match="jobs"):
        lua_source(Hiding)


def test_every_script_of_the_queue_builds() -> None:
    scripts = [cls for module in (admission, attempts, claims, stream_flush) for _, cls in inspect.getmembers(module)
               if isinstance(cls, type) and issubclass(cls, LuaScript) and cls.__module__ == module.__name__]
    assert len(scripts) == 17
    for script in scripts:
        source = lua_source(script)
        if script.FLAGS:                 # a shebang line first: Redis reads flags from there only
            shebang, source = source.split("\n", 1)
            assert shebang == f"#!lua flags={','.join(script.FLAGS)}"
        assert source.startswith("-- KEYS and ARGV as ")
