"""A newcomer's first hour (issue: first run on any machine): one source for each setting, a
producer that parses only what it needs, `slotq enqueue TEXT` as a chat message, and command-line
errors as one clear line."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from slotq.engine import EngineKnobs
from slotq.jobs.cli.parser import build_parser
from slotq.jobs.errors import RedisUnavailable
from slotq.jobs.producer.client import JobNotFound, JobRejected, SlotqClient
from slotq.jobs.protocol.keys import job_record_key
from slotq.jobs.protocol.schemas import JobStatus
from slotq.jobs.protocol.serialization import deserialize
from slotq.jobs.settings import ClientSettings, from_command_line
from slotq.jobs.worker.settings import WorkerSettings
from tests.support import REPO_ROOT
from tests.support.jobs import SLOTQ_BIN, clean_env


async def _run_cli(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(str(SLOTQ_BIN), *args, env=env, cwd=cwd,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


def _parsed(argv: list[str], settings_cls: type[ClientSettings]) -> ClientSettings:
    args = build_parser().parse_args(argv)
    return from_command_line(settings_cls, args, args.settings_source)


# ---------------------------------------------------------------------- one source for each setting
def test_every_engine_knob_is_a_worker_setting_with_the_same_bounds(monkeypatch):
    for name, field in EngineKnobs.model_fields.items():
        assert WorkerSettings.model_fields[name].metadata == field.metadata, name
        assert WorkerSettings.model_fields[name].default == field.default, name
    monkeypatch.setenv("SLOTQ_KV_OVERCOMMIT", "2.5")
    monkeypatch.setenv("SLOTQ_SEED", "1234")
    config = WorkerSettings().engine_config()
    assert config.kv_overcommit == 2.5 and config.seed == 1234


def test_batch_below_slots_is_refused_not_silently_raised():
    with pytest.raises(ValueError, match="batch .* must be >= slots"):
        WorkerSettings(slots=16, batch=8)


def test_a_renamed_setting_under_its_old_name_is_an_error_naming_the_new_one(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    renamed = "SLOTQ_LORA_TURN_STEPS was renamed SLOTQ_LORA_TURN_MAX_STEPS"
    monkeypatch.setenv("SLOTQ_LORA_TURN_STEPS", "8")
    with pytest.raises(ValueError, match=renamed):
        WorkerSettings()
    monkeypatch.delenv("SLOTQ_LORA_TURN_STEPS")
    (tmp_path / ".env").write_text("SLOTQ_LORA_TURN_STEPS=8\n")
    with pytest.raises(ValueError, match=renamed):
        _parsed(["worker"], WorkerSettings)
    (tmp_path / ".env").write_text("SLOTQ_LORA_TURN_MAX_STEPS=8\n")
    assert _parsed(["worker"], WorkerSettings).lora_turn_max_steps == 8


def test_flags_override_the_environment_only_when_given(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLOTQ_SLOTS", "3")
    assert _parsed(["demo"], WorkerSettings).slots == 3              # `slotq demo` used to force 8
    assert _parsed(["worker"], WorkerSettings).slots == 3
    assert _parsed(["worker", "--slots", "5"], WorkerSettings).slots == 5
    assert _parsed(["worker", "--kv-overcommit", "2"], WorkerSettings).kv_overcommit == 2.0


def test_a_producer_ignores_worker_settings_and_dotenv(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("SLOTQ_QUEUE_NAME=from-dotenv\n")
    monkeypatch.setenv("SLOTQ_GPU_LAYERS", "lots")          # a worker setting a web app should never parse
    monkeypatch.setenv("SLOTQ_KV_CELLS", "-1")
    settings = ClientSettings()
    assert settings.queue_name == "slotq:queue"             # library code reads no .env
    assert not hasattr(settings, "gpu_layers")
    assert _parsed(["status"], ClientSettings).queue_name == "from-dotenv"   # the slotq commands do


# ---------------------------------------------------------------------- enqueue TEXT is a chat message
async def test_enqueue_text_is_a_user_message_and_raw_is_a_prompt(redis_url, tmp_path):
    env = clean_env(redis_url=redis_url)
    code, out, err = await _run_cli("enqueue", "Write a short poem about the number 4.", env=env, cwd=tmp_path)
    assert code == 0, err
    code2, out2, err2 = await _run_cli("enqueue", "Once upon a time", "--raw", env=env, cwd=tmp_path)
    assert code2 == 0, err2
    client = await SlotqClient.connect(redis_url)
    try:
        chat = deserialize(await client.redis.get(job_record_key(out.strip())))["a"][0]
        raw = deserialize(await client.redis.get(job_record_key(out2.strip())))["a"][0]
        assert chat["messages"] == [{"role": "user", "content": "Write a short poem about the number 4."}]
        assert "prompt" not in chat
        assert raw["prompt"] == "Once upon a time" and "messages" not in raw
        handle = await client.enqueue("Hi there", max_tokens=8)          # the client's string shortcut too
        payload = deserialize(await client.redis.get(job_record_key(handle.id)))["a"][0]
        assert payload["messages"] == [{"role": "user", "content": "Hi there"}]
    finally:
        await client.close()


@pytest.mark.real_model
async def test_enqueue_text_gets_an_answer_from_the_bundled_model(redis_url, start_worker, real_model_path, tmp_path):
    """On today's main 1 of 4 such jobs came back with empty text: the text went in as a raw prompt."""
    await start_worker(model=str(real_model_path), slots=4, ctx=512)
    env = clean_env(redis_url=redis_url)
    runs = [_run_cli("enqueue", "Write a short poem about the number 4.", "--max-tokens", "48", "--json",
                     "--seed", str(seed), env=env, cwd=tmp_path) for seed in range(4)]
    for code, out, err in await asyncio.gather(*runs):
        assert code == 0, err
        result = json.loads(out)
        assert result["status"] == "succeeded"
        assert result["text"].strip(), result
        assert result["usage"]["completion_tokens"] > 3, result


# ---------------------------------------------------------------------- clear errors
async def test_result_of_an_unknown_job_is_one_line_and_exit_1(redis_url, tmp_path):
    code, out, err = await _run_cli("result", "nosuchjob", env=clean_env(redis_url=redis_url), cwd=tmp_path)
    assert code == 1
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    assert "no job 'nosuchjob'" in err
    client = await SlotqClient.connect(redis_url)
    try:
        with pytest.raises(JobNotFound):
            await client.result("nosuchjob", timeout=5)
    finally:
        await client.close()


@pytest.mark.slow
async def test_unreachable_redis_fails_fast_with_the_reason(tmp_path):
    url = "redis://user:hunter2@127.0.0.1:1/0"       # nothing listens on port 1
    started = time.monotonic()
    code, out, err = await _run_cli("enqueue", "hi", env=clean_env(redis_url=url), cwd=tmp_path, timeout=30)
    assert time.monotonic() - started < 15
    assert code == 1 and "Traceback" not in err
    assert "cannot reach Redis at redis://user:***@127.0.0.1:1/0" in err and "hunter2" not in err
    assert "111" in err or "refused" in err.lower(), err

    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match="cannot reach Redis"):
        await SlotqClient.connect(url, ClientSettings(redis_connect_timeout_s=1))
    assert time.monotonic() - started < 5


async def test_max_tokens_beyond_the_advertised_context_is_refused_at_enqueue(client, worker):
    ctx = worker.engine.ctx_per_seq
    async with asyncio.timeout(30):
        while not [w for w in await client.workers() if w.ctx == ctx and w.queue == client.settings.queue_name]:
            await asyncio.sleep(0.05)
    with pytest.raises(JobRejected, match=f"per-sequence context of {ctx} tokens") as info:
        await client.enqueue("hello", max_tokens=100_000)
    assert info.value.field == "max_tokens"
    assert await client.redis.zcard(client.settings.queue_name) == 0
    # a request that fits still goes through, and the other queue (no workers) accepts anything
    ok = await client.enqueue("hello", max_tokens=8)
    assert (await ok.result(timeout=60)).status == JobStatus.SUCCEEDED
    other = client.for_queue("slotq:other-model")
    assert (await other.enqueue("hello", max_tokens=100_000)).created


async def test_a_schema_over_the_structured_output_limits_is_refused_at_enqueue(client):
    """Checked with the worker's own compiler before anything is queued (issue 32): no worker sees it."""
    bomb = {"enum": [f"v{i}" for i in range(100_000)]}
    with pytest.raises(JobRejected, match="SLOTQ_GRAMMAR_INITIAL_FUEL") as info:
        await client.enqueue("hello", max_tokens=3, sampling={"json_schema": bomb})
    assert info.value.field == "sampling.json_schema"
    assert sum(lane.queued for lane in (await client.queue_info()).lanes) == 0
    assert (await client.enqueue("hello", max_tokens=3, sampling={"json_schema": {"type": "object"}})).created


async def test_cli_reports_a_rejected_request_in_one_line(redis_url, worker, tmp_path):
    async with asyncio.timeout(30):
        probe = await SlotqClient.connect(redis_url)
        try:
            while not await probe.workers():
                await asyncio.sleep(0.05)
        finally:
            await probe.close()
    code, out, err = await _run_cli("enqueue", "hi", "--max-tokens", "100000",
                                    env=clean_env(redis_url=redis_url), cwd=tmp_path)
    assert code == 2 and "Traceback" not in err
    assert "max_tokens is 100000" in err



# ---------------------------------------------------------------------- docs match the settings
def test_every_setting_is_documented():
    root = REPO_ROOT
    example = (root / "deploy/slotq.env.example").read_text()
    readme = (root / "README.md").read_text()
    for name in WorkerSettings.model_fields:
        var = f"SLOTQ_{name.upper()}"
        assert f"{var}=" in example, f"{var} missing from deploy/slotq.env.example"
        assert var in readme, f"{var} missing from README.md"


@pytest.mark.parametrize(("file", "served"), [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct"),
    ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct-fp16"),
    ("tiny.gguf", "tiny"),
    ("phi-3-mini.f16.gguf", "phi-3-mini"),
])
def test_served_model_name_defaults_to_the_file_name_without_its_quantization(file, served):
    assert WorkerSettings().served_model_name(Path(file)) == served
    assert WorkerSettings(model_name="custom").served_model_name(Path(file)) == "custom"
