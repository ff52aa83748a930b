"""LoRA adapters through the gateway, Redis and a real worker (``SLOTQ_LORA`` with the suite's tiny
adapter), driven with the official OpenAI SDK: ``/v1/models`` lists the adapters, ``model="base:adapter"``
and llama-server's ``lora`` field run the adapter, scale 0 is the base model, and a name no worker
loaded or a bad scale is refused by field before anything is enqueued. Pure parts at the end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from openai import OpenAI

from slotq.jobs.gateway.adapters import common_adapters, split_model
from slotq.jobs.gateway.routing import ModelRoute
from slotq.jobs.protocol.schemas import WorkerInfo
from tests.support.gateway import Stack
from tests.support.tiny_model import write_lora

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    cwd = tmp_path_factory.mktemp("gateway-lora")
    adapter = write_lora(cwd / "style.gguf", tiny_model_path)
    with Stack.started(cwd, tiny_model_path) as s:
        s.start_worker("w-lora", MODEL, lora=f"style={adapter}")
        s.start_gateway("gw").wait_ready()
        s.wait_for_models({MODEL})
        yield s


@pytest.fixture
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _text(client: OpenAI, model: str = MODEL, **extra: Any) -> str:
    done = client.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})
    assert done.model == model
    return done.choices[0].text


def test_models_lists_each_adapter_as_base_colon_name(client: OpenAI) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert cards[MODEL].model_extra is not None and cards[MODEL].model_extra["adapters"] == ["style"]
    styled = cards[f"{MODEL}:style"]
    assert styled.model_extra is not None and styled.model_extra["parent"] == MODEL
    assert client.models.retrieve(f"{MODEL}:style").id == f"{MODEL}:style"


def test_an_adapter_named_by_model_or_lora_field_changes_the_output_and_scale_zero_does_not(client: OpenAI) -> None:
    base = _text(client)
    styled = _text(client, f"{MODEL}:style")
    assert styled != base
    assert _text(client, lora=[{"id": 0, "scale": 1.0}]) == styled     # llama-server's shape: id = index
    assert _text(client, lora=[{"id": "style"}]) == styled
    assert _text(client, lora=[{"id": "style", "scale": 0}]) == base
    assert _text(client, f"{MODEL}:style", lora=[{"id": "style", "scale": 0}]) == base   # the field's scale holds


@pytest.mark.parametrize("model", [f"{MODEL}:style", MODEL])
def test_every_api_names_the_model_as_asked_streamed_and_not(stack: Stack, client: OpenAI, model: str) -> None:
    """Chat, Responses (a background one too, as retrieved) and Messages, streamed or not, name
    ``base:adapter`` when the request did, though the job's worker reports its base model."""
    say = {"max_tokens": 4, "temperature": 0}
    ask = [{"role": "user", "content": "hello"}]
    assert client.chat.completions.create(model=model, messages=ask, **say).model == model
    chunks = client.chat.completions.create(model=model, messages=ask, stream=True,
                                            stream_options={"include_usage": True}, **say)
    assert {chunk.model for chunk in chunks} == {model}         # the finish and usage chunks too

    assert client.responses.create(model=model, input="hello", max_output_tokens=4).model == model
    with client.responses.stream(model=model, input="hello", max_output_tokens=4) as stream:
        assert {e.response.model for e in stream if hasattr(e, "response")} == {model}
    background = client.responses.create(model=model, input="hello", max_output_tokens=4, background=True)
    for _ in range(600):
        if (retrieved := client.responses.retrieve(background.id)).status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert retrieved.status in ("completed", "incomplete") and retrieved.model == background.model == model

    claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=60)
    assert claude.messages.create(model=model, messages=ask, max_tokens=4).model == model   # type: ignore[arg-type]
    with claude.messages.stream(model=model, messages=ask, max_tokens=4) as streamed:          # type: ignore[arg-type]
        assert streamed.get_final_message().model == model


@pytest.mark.parametrize(("model", "extra", "status", "param"), [
    (MODEL, {"lora": [{"id": "nope"}]}, 400, "lora[0].id"),
    (MODEL, {"lora": [{"id": 1}]}, 400, "lora[0].id"),
    (MODEL, {"lora": [{"id": 0}, {"id": "style"}]}, 400, "lora[1].id"),
    (MODEL, {"lora": [{"id": 0, "scale": 1e6}]}, 400, "lora[0].scale"),
    (MODEL, {"lora": [{"id": 0, "weight": 1}]}, 400, "lora[0].weight"),
    (f"{MODEL}:nope", {}, 404, "model"),
])
def test_unknown_adapters_and_bad_scales_are_refused_by_field(client: OpenAI, model: str, extra: dict[str, Any],
                                                              status: int, param: str) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body=extra)
    assert info.value.status_code == status
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


# ---------------------------------------------------------------------- pure parts
def _worker(adapters: list[str]) -> WorkerInfo:
    return WorkerInfo(id="w", model=MODEL, slots_total=1, slots_busy=0, waiting=0, generated_tokens=0, started_at=0,
                      updated_at=0, adapters=adapters)


def test_only_adapters_every_worker_loaded_at_the_same_index_are_offered() -> None:
    assert common_adapters([_worker(["a", "b", "c"]), _worker(["a", "b"])]) == ["a", "b"]
    assert common_adapters([_worker(["a", "b"]), _worker(["b", "a"])]) == []
    assert common_adapters([]) == []


def test_a_served_name_with_a_colon_is_that_model_not_an_adapter() -> None:
    routes = {"llama3:8b": ModelRoute("llama3:8b", "q"), MODEL: ModelRoute(MODEL, "q")}
    assert split_model("llama3:8b", routes) == ("llama3:8b", None)
    assert split_model(f"{MODEL}:style", routes) == (MODEL, "style")
    assert split_model("other:style", routes) == ("other:style", None)
