"""``slotq bench api-shapes`` (or ``python -m bench.api_shapes``): slotq's API shapes beside llama-server's.

Both servers run the bundled model (slotq: embedded Redis, one ``slotq worker``, ``slotq gateway``;
llama-server built from the llama.cpp that llama-cpp-python vendors, :mod:`bench.llama_server`) and get
the same requests on every route both serve: ``/v1/chat/completions`` (plain, streamed, a forced tool
call streamed and not, ``response_format``, ``logprobs``), ``/v1/completions`` (plain, streamed),
``/v1/responses`` (plain, streamed, a forced function call streamed and not, ``text.format``),
``/v1/messages`` (plain, streamed, a forced ``tool_use`` streamed and not),
``/v1/messages/count_tokens`` and ``/v1/responses/input_tokens``.

What is compared is the SHAPE, never the text: the set of JSON key paths with their value types
(``choices[].message.content: str``; a list's items share the path ``[]``), and for a stream the
sequence of its event types, a run of one type written once with ``+`` (a chat chunk's type is what
it carries: ``role``, ``content``, ``tool_calls``, ``finish``, ``usage``; ``[DONE]`` last). A stream's
key paths are its events' data, each path under its event type (``response.created: response.id: str``).

The official SDKs' types are the truth (the installed ``openai`` and ``anthropic`` packages'
pydantic models: what the SDKs parse into), llama-server the peer. Each answer and each streamed
event is validated against the SDK's type for it; the second table lists, per server, what the SDK
would miss (a required field absent, a value of the wrong type or literal) and the keys the SDK
does not declare (kept as extras by the SDK: harmless, but no client reads them by name).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import sys
import tempfile
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pydantic

from bench import llama_server
from bench.peers_bench import _wait_http, gateway_process
from bench.report import markdown_table, progress, write_results
from slotq.engine import bundled_model_path
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.redis_server import EmbeddedRedis, free_port

MODEL = "shapes"
CTX = 2048                  # per slot, both servers
SLOTS = 2
THREADS = len(os.sched_getaffinity(0)) or 1
MAX_TOKENS = 24
SERVERS = ("slotq", "llama-server")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 24}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "country"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}}}
ASK = "What is the weather in Paris?"
HELLO = "Say hello in five words."
STORY = "Once upon a time, in a small village by the sea,"      # a raw prompt the model goes on with
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": WEATHER}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                    "parameters": WEATHER}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]


@dataclass(frozen=True)
class Case:
    """One request sent to both servers; ``sdk`` names the SDK type of its answer (of each event when
    it streams)."""

    route: str
    case: str
    body: dict[str, Any]
    sdk: str

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def cases() -> list[Case]:
    chat = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
    usage = {"stream_options": {"include_usage": True}}
    responses = {"model": MODEL, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    messages = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
    chunk, completion = "openai.types.chat.ChatCompletionChunk", "openai.types.chat.ChatCompletion"
    response, event = "openai.types.responses.Response", "openai.types.responses.ResponseStreamEvent"
    message, raw = "anthropic.types.Message", "anthropic.types.RawMessageStreamEvent"
    hello = [{"role": "user", "content": HELLO}]
    ask = [{"role": "user", "content": ASK}]
    return [
        Case("/v1/chat/completions", "plain", chat | {"messages": hello}, completion),
        Case("/v1/chat/completions", "stream", chat | usage | {"messages": hello, "stream": True}, chunk),
        Case("/v1/chat/completions", "tools", chat | {"messages": ask, "tools": CHAT_TOOLS,
                                                      "tool_choice": "required"}, completion),
        Case("/v1/chat/completions", "tools stream", chat | usage | {"messages": ask, "tools": CHAT_TOOLS,
                                                                     "tool_choice": "required", "stream": True}, chunk),
        Case("/v1/chat/completions", "response_format", chat | {
            "messages": [{"role": "user", "content": "Name a city and its country."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                       "strict": True}}}, completion),
        Case("/v1/chat/completions", "logprobs", chat | {"messages": hello, "logprobs": True, "top_logprobs": 2},
             completion),
        Case("/v1/completions", "plain", chat | {"prompt": STORY}, "openai.types.Completion"),
        Case("/v1/completions", "stream", chat | usage | {"prompt": STORY, "stream": True}, "openai.types.Completion"),
        Case("/v1/responses", "plain", responses | {"input": HELLO}, response),
        Case("/v1/responses", "stream", responses | {"input": HELLO, "stream": True}, event),
        Case("/v1/responses", "function tools", responses | {"input": ASK, "tools": RESPONSES_TOOLS,
                                                             "tool_choice": "required"}, response),
        Case("/v1/responses", "function tools stream", responses | {
            "input": ASK, "tools": RESPONSES_TOOLS, "tool_choice": "required", "stream": True}, event),
        Case("/v1/responses", "text.format", responses | {
            "input": "Name a city and its country.",
            "text": {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}}, response),
        Case("/v1/messages", "plain", messages | {"messages": hello}, message),
        Case("/v1/messages", "stream", messages | {"messages": hello, "stream": True}, raw),
        Case("/v1/messages", "tool_use", messages | {"messages": ask, "tools": MESSAGES_TOOLS,
                                                     "tool_choice": {"type": "any"}}, message),
        Case("/v1/messages", "tool_use stream", messages | {"messages": ask, "tools": MESSAGES_TOOLS,
                                                            "tool_choice": {"type": "any"}, "stream": True}, raw),
        Case("/v1/messages/count_tokens", "plain", {"model": MODEL, "messages": ask, "tools": MESSAGES_TOOLS},
             "anthropic.types.MessageTokensCount"),
        Case("/v1/responses/input_tokens", "plain", {"model": MODEL, "input": ASK, "tools": RESPONSES_TOOLS},
             "openai.types.responses.InputTokenCountResponse"),
    ]


# ----------------------------------------------------------------------------- shapes
def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "str"
    return "array" if isinstance(value, list) else "object"


def key_paths(value: Any, prefix: str = "") -> dict[str, set[str]]:
    """Every key path under ``value`` with the types seen there; a list's items share ``path[]``."""
    paths: dict[str, set[str]] = {}

    def walk(node: Any, path: str) -> None:
        if path:
            paths.setdefault(path, set()).add(json_type(node))
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for child in node:
                walk(child, f"{path}[]")

    walk(value, prefix)
    return paths


def typed(paths: dict[str, set[str]]) -> set[str]:
    """``path: type/type`` lines, the form the tables compare."""
    return {f"{path}: {'/'.join(sorted(types))}" for path, types in paths.items()}


Shape = set[tuple[str, str]]        # (event type, or "" for a JSON answer; a typed key path)


def only_in(ours: Shape, theirs: Shape) -> Shape:
    """The typed paths of ``ours`` that ``theirs`` lacks, but none under a path that is itself only in
    ``ours`` (a key one server leaves out is listed once, not with everything under it)."""
    only = ours - theirs
    heads = {(event, line.rpartition(": ")[0]) for event, line in only}
    return {(event, line) for event, line in only if not any((event, up) in heads for up in _ancestors(
        line.rpartition(": ")[0]))}


def _ancestors(path: str) -> Iterator[str]:
    while True:
        cut = max(path.rfind("."), path.rfind("[]"))
        if cut <= 0:
            return
        path = path[:cut]
        yield path


def grouped(shape: Shape) -> list[str]:
    """``path: type`` once, followed by the events that carry it (``response.`` left off their names)."""
    events: dict[str, list[str]] = {}
    for event, line in sorted(shape):
        events.setdefault(line, []).append(event.removeprefix("response."))
    return [line + (f" ({', '.join(kinds)})" if any(kinds) else "") for line, kinds in sorted(events.items())]


@dataclass
class Event:
    type: str           # the SSE ``event:`` name, else the data's ``type``, else (chat) what the chunk carries
    data: Any           # the parsed JSON (None for ``[DONE]``)


def sse_events(text: str) -> list[Event]:
    """The events of an SSE body, comments (``: ping``) and ids left out."""
    events: list[Event] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if not data:
            continue
        payload = "\n".join(data)
        if payload == "[DONE]":
            events.append(Event("[DONE]", None))
            continue
        parsed = json.loads(payload)
        kind = name or (parsed.get("type") if isinstance(parsed, dict) else None) or chat_chunk_kind(parsed)
        events.append(Event(str(kind), parsed))
    return events


def chat_chunk_kind(chunk: dict[str, Any]) -> str:
    """What a chat (or completions) chunk carries, the first of: ``role``, ``tool_calls``, ``content`` (a
    completion's ``text`` too), ``finish``, ``usage`` (``empty`` when it carries none)."""
    choices = chunk.get("choices") or []
    delta = (choices[0].get("delta") or {}) if choices else {}
    if delta.get("role"):
        return "role"
    if delta.get("tool_calls"):
        return "tool_calls"
    if delta.get("content") or delta.get("reasoning_content") or (choices and choices[0].get("text")):
        return "content"
    if choices and choices[0].get("finish_reason"):
        return "finish"
    return "usage" if chunk.get("usage") else "empty"


def collapsed(kinds: Iterable[str]) -> list[str]:
    """A run of one event type written once, with ``+`` when it repeats."""
    out: list[str] = []
    for kind in kinds:
        if out and out[-1].rstrip("+") == kind:
            out[-1] = kind + "+"
        else:
            out.append(kind)
    return out


def sequence_diff(ours: list[str], peer: list[str]) -> list[str]:
    """``-x`` for an event only slotq sends there, ``+x`` for one only llama-server sends."""
    out: list[str] = []
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(a=ours, b=peer, autojunk=False).get_opcodes():
        if op != "equal":
            out += [f"-{kind}" for kind in ours[a0:a1]] + [f"+{kind}" for kind in peer[b0:b1]]
    return out


# ----------------------------------------------------------------------------- the SDKs' types
def sdk_type(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    return getattr(__import__(module, fromlist=[attribute]), attribute)


def sdk_variant(declared: Any, data: Any) -> Any:
    """The type to check ``data`` against: for a union of events tagged by ``type`` (the SDKs tag them
    with markers of their own, which pydantic does not read), the member whose ``type`` is ``data``'s."""
    union = typing.get_args(declared)[0] if typing.get_origin(declared) is typing.Annotated else declared
    for member in typing.get_args(union) if typing.get_origin(union) in (typing.Union, types.UnionType) else ():
        field_type = getattr(member, "model_fields", {}).get("type")
        if field_type is not None and typing.get_args(field_type.annotation) == (data.get("type"),):
            return member
    return declared


def _path(loc: tuple[Any, ...], data: Any) -> str:
    """``loc`` as a key path of ``data``: list indices as ``[]``, the names pydantic gives a union's
    branches left out (they are no keys of the data)."""
    out, node = "", data
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out, node = out + "[]", node[part] if isinstance(node, list) and part < len(node) else None
        elif isinstance(node, dict) and part in node or i == len(loc) - 1:
            out, node = f"{out}.{part}" if out else str(part), node.get(part) if isinstance(node, dict) else None
    return out


def _wrong_branches(errors: list[Any]) -> list[tuple[Any, ...]]:
    """The locations of a union's branches whose ``type`` tag is not the data's: their errors say
    nothing about the branch that fits."""
    return [tuple(e["loc"][:-1]) for e in errors
            if e["type"] == "literal_error" and len(e["loc"]) > 1 and e["loc"][-1] == "type"
            and isinstance(e["loc"][-2], str) and e["loc"][-2][:1].isupper()]


def undeclared(value: Any, path: str = "") -> Iterator[str]:
    """The key paths of a validated SDK object that its types do not declare (pydantic's extras)."""
    if isinstance(value, pydantic.BaseModel):
        for key in value.__pydantic_extra__ or {}:
            yield f"{path}.{key}" if path else key
        for key in type(value).model_fields:
            yield from undeclared(getattr(value, key), f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for item in value:
            yield from undeclared(item, f"{path}[]")


def sdk_issues(declared: Any, data: Any, event: str = "") -> Shape:
    """What the SDK type makes of ``data``: ``missing x``, ``x: <pydantic's error> (value)`` when validated
    (of a union's branches only the one whose ``type`` tag fits reports its errors), and ``undeclared x``
    for the keys the object the SDK builds (``construct``, as it builds every answer) keeps as extras."""
    variant = sdk_variant(declared, data)
    issues: Shape = set()
    try:
        pydantic.TypeAdapter(variant).validate_python(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        wrong = _wrong_branches(errors)
        kept = [e for e in errors if not any(tuple(e["loc"][:len(w)]) == w for w in wrong)]
        issues |= {(event, f"missing {_path(tuple(e['loc']), data)}" if e["type"] == "missing" else
                    f"{_path(tuple(e['loc']), data)}: {e['type']} ({json.dumps(e.get('input'))[:30]})") for e in kept}
        if not kept:
            issues.add((event, f"type {data.get('type')!r} is none the SDK declares"))
    if isinstance(variant, type) and issubclass(variant, pydantic.BaseModel):
        issues |= {(event, f"undeclared {path}") for path in undeclared(variant.construct(**data))}
    return issues


# ----------------------------------------------------------------------------- one exchange
@dataclass
class Answer:
    status: int
    paths: Shape = field(default_factory=set)
    sequence: list[str] = field(default_factory=list)
    sdk: Shape = field(default_factory=set)
    error: str = ""


async def exchange(http: httpx.AsyncClient, case: Case, declared: Any) -> Answer:
    headers = {"anthropic-version": "2023-06-01"} if case.route.startswith("/v1/messages") else {}
    response = await http.post(case.route, json=case.body, headers=headers)
    if response.status_code != 200:
        return Answer(response.status_code, error=response.text[:200])
    if not case.stream:
        data = response.json()
        return Answer(200, {("", line) for line in typed(key_paths(data))}, sdk=sdk_issues(declared, data))
    events = sse_events(response.text)
    answer = Answer(200, sequence=collapsed(event.type for event in events))
    for event in events:
        if event.data is None:
            continue
        answer.paths |= {(event.type, line) for line in typed(key_paths(event.data))}
        if event.type != "ping" or case.sdk.startswith("openai"):       # the SDK skips Anthropic's pings
            answer.sdk |= sdk_issues(declared, event.data, event.type)
    return answer


# ----------------------------------------------------------------------------- the run
def _children(tmp: Path, redis_url: str, model: Path, binary: Path | None,
              peer_args: tuple[str, ...] = ()) -> tuple[list[ChildProcess], dict[str, str]]:
    """slotq's worker and gateway, and llama-server (with ``peer_args``) when ``binary`` is given; their URLs."""
    env = {**os.environ, "SLOTQ_REDIS_URL": redis_url, "SLOTQ_MODEL": str(model), "SLOTQ_MODEL_NAME": MODEL,
           "SLOTQ_SLOTS": str(SLOTS), "SLOTQ_CTX": str(CTX), "SLOTQ_THREADS": str(THREADS),
           "SLOTQ_LOG_LEVEL": "WARNING"}
    worker = ChildProcess("slotq worker", [sys.executable, "-m", "slotq.jobs.cli", "worker"], env=env,
                          log_path=tmp / "worker.log")
    gateway, port = gateway_process(tmp, redis_url)
    children, urls = [worker, gateway], {"slotq": f"http://127.0.0.1:{port}"}
    if binary is not None:
        peer_port = free_port()
        children.append(ChildProcess("llama-server", [
            str(binary), "-m", str(model), "--parallel", str(SLOTS), "-c", str(CTX * SLOTS), "-t", str(THREADS),
            "--jinja", "--no-webui", "--host", "127.0.0.1", "--port", str(peer_port), *peer_args],
            log_path=tmp / "llama-server.log"))
        urls["llama-server"] = f"http://127.0.0.1:{peer_port}"
    return children, urls


async def _compare(urls: dict[str, str]) -> list[dict[str, Any]]:
    https = {name: httpx.AsyncClient(base_url=url, timeout=300) for name, url in urls.items()}
    try:
        await _wait_http(https["slotq"], "/health",
                         lambda r: r.status_code == 200 and MODEL in r.json().get("models", {}))
        if "llama-server" in https:
            await _wait_http(https["llama-server"], "/health", lambda r: r.status_code == 200)
        rows = []
        for case in cases():
            progress(f"{case.route} {case.case}")
            declared = sdk_type(case.sdk)
            answers = {name: await exchange(http, case, declared) for name, http in https.items()}
            rows.append(_row(case, answers))
        return rows
    finally:
        for http in https.values():
            await http.aclose()


def _row(case: Case, answers: dict[str, Answer]) -> dict[str, Any]:
    ours, peer = answers["slotq"], answers.get("llama-server")
    row: dict[str, Any] = {"route": case.route, "case": case.case, "sdk_type": case.sdk,
                           "status": {name: a.status for name, a in answers.items()},
                           "errors": {name: a.error for name, a in answers.items() if a.error},
                           "sdk": {name: grouped(a.sdk) for name, a in answers.items()}}
    if peer is not None and ours.status == peer.status == 200:
        row |= {"only_slotq": grouped(only_in(ours.paths, peer.paths)),
                "only_peer": grouped(only_in(peer.paths, ours.paths)),
                "sequence": {"slotq": ours.sequence, "llama-server": peer.sequence},
                "sequence_diff": sequence_diff(ours.sequence, peer.sequence)}
    return row


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    """Both servers, every case once (``quick`` changes nothing but that the results are not written)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = bundled_model_path()
    skipped: dict[str, str] = {}
    try:
        binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        binary, skipped["llama-server"] = None, str(exc)
        progress(f"skipping llama-server: {exc}")
    with tempfile.TemporaryDirectory(prefix="slotq-bench-api-shapes-") as tmp_name:
        tmp = Path(tmp_name)
        redis = EmbeddedRedis(tmp / "redis")
        url = redis.start()
        children, urls = _children(tmp, url, model, binary)
        try:
            rows = await run_watched(_compare(urls), *children)
        finally:
            for child in children:
                child.stop()
            redis.stop()
    data = {"model": model.name, "max_tokens": MAX_TOKENS, "rows": rows, "skipped": skipped}
    text = tables(rows, skipped)
    if not quick:
        write_results("api_shapes", data, text, "slotq bench api-shapes")
    return data, text


# ----------------------------------------------------------------------------- the tables
def _cell(items: list[str]) -> str:
    return "<br>".join(f"`{item}`" for item in items) if items else "-"


def tables(rows: list[dict[str, Any]], skipped: dict[str, str]) -> str:
    shapes = [[row["route"], row["case"], *(_cell(row[key]) if key in row else _status(row)
                                            for key in ("only_slotq", "only_peer")),
               " ".join(f"`{kind}`" for kind in row.get("sequence_diff", [])) or
               ("same" if row.get("sequence", {}).get("slotq") else "-")] for row in rows]
    sdk = [[row["route"], row["case"], f"`{row['sdk_type']}`", *(_sdk_cell(row, name) for name in SERVERS)]
           for row in rows]
    sequences = [[row["route"], row["case"], *(" ".join(f"`{kind}`" for kind in row["sequence"][name])
                                               for name in SERVERS)]
                 for row in rows if row.get("sequence", {}).get("slotq")]
    out = [("Key paths (`path: type`, a list's items as `[]`; a stream's under each event type) that one server "
            "sends and the other does not, for the same request on the same model; event sequences: `-x` only "
            "slotq sends, `+x` only llama-server (`x+`: one or more)."), "",
           markdown_table(["route", "case", "keys only in slotq", "keys only in llama-server", "event sequence"],
                          shapes), "",
           "Event sequences as sent:", "",
           markdown_table(["route", "case", "slotq", "llama-server"], sequences), "",
           ("Against the official SDKs' types (what `openai` / `anthropic` parse each answer and event into): "
            "`missing x` a required field absent, `x: <error>` a wrong type or literal, `undeclared x` a key "
            "the SDK does not declare (kept as an extra)."), "",
           markdown_table(["route", "case", "SDK type", "slotq", "llama-server"], sdk)]
    out += [f"\nSkipped {name}: {why}" for name, why in skipped.items()]
    return "\n".join(out)


def _status(row: dict[str, Any]) -> str:
    """Why a row compares no keys: a server's error (each status, and the errors' first words), or
    llama-server skipped (``-``)."""
    if all(status == 200 for status in row["status"].values()):
        return "-"
    return " / ".join(f"{name} HTTP {status}" for name, status in row["status"].items()) + \
        "".join(f"<br>{name}: {error[:120]}" for name, error in row["errors"].items())


def _sdk_cell(row: dict[str, Any], server: str) -> str:
    if server not in row["status"]:
        return "-"
    if row["status"][server] != 200:
        return f"HTTP {row['status'][server]}: {row['errors'].get(server, '')[:120]}"
    return _cell(row["sdk"][server])


if __name__ == "__main__":
    from bench import run_benchmark

    run_benchmark("api-shapes", quick="--quick" in sys.argv[1:])
