"""The ``anthropic`` SDK against the gateway on the bundled model (issue 45): a two-turn tool loop,
the call streamed and not (:mod:`bench.client_checks`, which ``slotq bench clients`` also runs against
llama-server). The first turn is forced (``tool_choice: any``), as agent loops do while a tool has not
run yet; after the ``tool_result`` the model is free (``auto``) and answers. Then stop sequences."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from bench import client_checks as checks
from tests.support.gateway import Stack

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

MODEL = "smol"

@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("anthropic-model"), real_model_path) as s:
        s.start_worker("anthropic-model-worker", MODEL, ctx=2048)
        s.start_gateway("anthropic-model-gateway").wait_ready()
        s.wait_for_models({MODEL})
        yield s


def test_the_anthropic_sdk_runs_a_tool_loop_streamed_and_not(stack: Stack) -> None:
    server = checks.Server(stack.url, MODEL, MODEL)
    first = checks.anthropic_tool_use(server, stream=False)
    streamed = checks.anthropic_tool_use(server, stream=True)
    assert [b.input for b in streamed.content if b.type == "tool_use"] == \
        [b.input for b in first.content if b.type == "tool_use"]
    checks.anthropic_tool_loop(server)


def test_a_stop_sequence_ends_a_real_reply_and_is_named(stack: Stack) -> None:
    """The model counts; ``stop_sequences`` cut it at the first of them it writes, and the SDK reads
    which (streamed: ``message_delta``, after a ``message_start`` that already counts the prompt)."""
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120)
    ask = {"model": MODEL, "max_tokens": 64, "extra_body": checks.GREEDY, "stop_sequences": ["7", "seven"],
           "messages": [{"role": "user", "content": "Count from 1 to 10, as digits separated by commas."}]}
    plain = client.messages.create(**(ask | {"stop_sequences": []}))
    assert "7" in plain.content[0].text, plain                     # what it writes when nothing stops it
    message = client.messages.create(**ask)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "7"), message
    assert message.content[0].text == plain.content[0].text[:plain.content[0].text.index("7")]
    with client.messages.stream(**ask) as stream:
        [start] = [event for event in stream if event.type == "message_start"]
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "7")
    assert start.message.usage.input_tokens + (start.message.usage.cache_read_input_tokens or 0) == \
        final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0
