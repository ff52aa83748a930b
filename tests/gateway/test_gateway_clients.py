"""The real clients apps use, against the gateway on the bundled model (issues 33 and 45): the official
``openai`` SDK (streaming and not), the OpenAI Agents SDK running a two-turn tool loop on chat completions
and on its default model provider (the Responses API), and the libraries apps put on top of the SDK:
instructor (tools, JSON schema and Responses modes), pydantic-ai (a tool, then a structured output),
langchain-openai (``bind_tools``, ``with_structured_output`` both ways, ``OpenAIEmbeddings``) and litellm
(a completion with tools, an embedding); and the SDK's own probes of issue 45 (a nested pydantic tool,
parameters without ``additionalProperties``, a call cut by ``max_tokens``). The calls live in
:mod:`bench.client_checks`, which ``slotq bench clients`` also runs against llama-server.

The bundled SmolLM2's template knows no tools, so the gateway's worker uses the generic format: a forced
call (``tool_choice: required`` or a named function, which these libraries send for structured output)
is grammar-constrained to the function's schema; a free turn may be text. One stack (a generation and an
embedding worker, one gateway) serves the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import client_checks as checks
from tests.support.gateway import Stack

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

MODEL = "smol"
EMBED = "smol-embed"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("clients"), real_model_path) as s:
        s.start_worker("clients-worker", MODEL, ctx=2048)
        s.start_worker("clients-embedder", EMBED, queue="slotq:embed", embeddings="true", ctx=512, batch=512)
        s.start_gateway("clients-gateway").wait_ready()
        s.wait_for_models({MODEL, EMBED})
        yield s


@pytest.fixture
def server(stack: Stack) -> checks.Server:
    return checks.Server(stack.url, MODEL, EMBED)


def test_the_openai_sdk_gets_a_tool_call_streamed_and_not(server: checks.Server) -> None:
    arguments = checks.chat_tool_call(server, stream=False)
    assert checks.chat_tool_call(server, stream=True) == arguments
    checks.chat_text(server)


def test_the_probes_of_issue_45_come_out_clean_through_the_sdk(server: checks.Server) -> None:
    """A nested pydantic tool (``$ref`` into ``$defs``), parameters without ``additionalProperties`` and a
    forced call cut by ``max_tokens``: what an attacker's and a client's probe found broken."""
    checks.chat_nested_pydantic_tool(server)
    checks.chat_no_invented_keys(server)
    checks.chat_call_cut_by_max_tokens(server)


async def test_an_agent_runs_a_two_turn_tool_loop_on_chat_completions(server: checks.Server) -> None:
    await checks.agent_on_chat_completions(server)


async def test_an_agent_on_the_default_model_provider_runs_a_tool_loop_over_responses(server: checks.Server) -> None:
    await checks.agent_on_default_provider(server)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_instructor_extracts_a_model(server: checks.Server, mode: str) -> None:
    checks.instructor_extracts(server, mode)


def test_pydantic_ai_calls_a_tool_then_gives_a_structured_output(server: checks.Server) -> None:
    checks.pydantic_ai_tool_then_output(server)


def test_langchain_binds_a_tool(server: checks.Server) -> None:
    checks.langchain_binds_a_tool(server)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_gives_a_structured_output(server: checks.Server, method: str) -> None:
    checks.langchain_structured_output(server, method)


def test_langchain_embeds_with_openai_embeddings(server: checks.Server) -> None:
    checks.langchain_embeds(server)


def test_litellm_completes_with_tools_and_embeds(server: checks.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # else its import fetches a price list online
    checks.litellm_completes_with_tools(server)
    checks.litellm_embeds(server)
