"""Models on demand: a worker given several models (SLOTQ_MODELS, SLOTQ_MODELS_DIR) offers them all
in the fleet's catalog, each on a queue of its own, and the gateway routes a request for a model no
worker has loaded to that queue (listed ``unloaded``) instead of refusing it. Real Valkey, real
workers on tiny models."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

from slotq.engine.model_files import ModelNotFound
from slotq.jobs.cli.status_view import render
from slotq.jobs.gateway.routes_openai import model_card
from slotq.jobs.gateway.routing import ModelRouter, routes_from
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import catalog, dead_letters
from slotq.jobs.protocol.catalog import CatalogEntry, CatalogModel
from slotq.jobs.protocol.schemas import JobKind, JobStatus, WorkerInfo
from slotq.jobs.worker.served_model import gguf_fingerprint
from slotq.jobs.worker.settings import WorkerSettings
from tests.support.jobs import job_request
from tests.support.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model: same recipe, other weights (another fingerprint, other tokens)."""
    return write_tiny_llama(tmp_path_factory.mktemp("second") / "second.gguf", seed=7)


# ---------------------------------------------------------------------- settings
def test_several_models_from_a_list_and_a_folder(tmp_path: Path, tiny_model_path: Path, second_model: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_llama(folder / "zeta.gguf", seed=3)
    write_tiny_llama(folder / "alpha.gguf", seed=4)
    settings = WorkerSettings(models=f"chat={tiny_model_path}, other={second_model}", models_dir=folder)
    assert list(settings.model_files()) == ["chat", "other", "alpha", "zeta"]      # as given, then the folder by name
    assert settings.queue_of("alpha") == "slotq:queue:alpha"
    single = WorkerSettings(model=str(tiny_model_path), model_name="chat")
    assert list(single.model_files()) == ["chat"] and single.queue_of("chat") == "slotq:queue"   # zero-config default


@pytest.mark.parametrize(("fields", "message"), [
    ({"models": "chat"}, "SLOTQ_MODELS: 'chat' is not name=path"),
    ({"models": "a=x.gguf,a=y.gguf"}, "the name 'a' is given twice"),
    ({"models": " , "}, "SLOTQ_MODELS: no model given"),
    ({"models": "a=x.gguf", "model_name": "b"}, "give every model in SLOTQ_MODELS"),
])
def test_bad_model_lists_are_refused_by_name(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        WorkerSettings(**fields)


def test_missing_files_are_named(tmp_path: Path, tiny_model_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="nope.gguf"):
        WorkerSettings(models=f"a={tiny_model_path},b={tmp_path / 'nope.gguf'}").model_files()
    with pytest.raises(ModelNotFound, match="no \\*.gguf file"):
        WorkerSettings(models_dir=tmp_path).model_files()


# ---------------------------------------------------------------------- routing (pure)
def offer(model: str, kind: JobKind = JobKind.GENERATION, load_s: float | None = None) -> CatalogModel:
    return CatalogModel(model=model, queue=f"slotq:queue:{model}", kind=kind, fingerprint="f", workers=("w1",),
                        load_s=load_s)


def test_a_model_only_the_catalog_offers_routes_to_its_queue() -> None:
    loaded = WorkerInfo(id="w1", model="a", queue="slotq:queue:a", slots_total=4, slots_busy=1, waiting=0,
                        generated_tokens=0, started_at=5, updated_at=6, load_s=0.4)
    offers = {"a": offer("a"), "b": offer("b", load_s=0.7), "e": offer("e", JobKind.EMBEDDING)}
    routes = routes_from([loaded], offers=offers)
    assert {m: (r.queue, r.status) for m, r in routes.items()} == {
        "a": ("slotq:queue:a", "loaded"), "b": ("slotq:queue:b", "unloaded"), "e": ("slotq:queue:e", "unloaded")}
    card = model_card(routes["b"])
    assert (card.status, card.workers, card.slots_total, card.created, card.load_s) == ("unloaded", 0, 0, 0, 0.7)
    assert model_card(routes["a"]).load_s == 0.4
    assert routes["e"].kind == JobKind.EMBEDDING
    assert set(routes_from([loaded], JobKind.EMBEDDING, offers)) == {"e"}       # by kind, as for live workers
    warming = loaded.model_copy(update={"ready": False})
    assert routes_from([warming], offers=offers)["a"].status == "loading"


# ---------------------------------------------------------------------- through Redis
async def test_a_worker_of_two_models_offers_both_and_the_unloaded_one_is_routed(
        start_worker, client: SlotqClient, tiny_model_path: Path, second_model: Path) -> None:
    worker = await start_worker(model=None, models=f"first={tiny_model_path},second={second_model}",
                                worker_name="two-models")
    async with asyncio.timeout(30):           # the beat after the warm-up carries what the load cost
        while (first := (offered := await catalog.read(client.redis, now=time.time())).get("first")) is None \
                or first.load_s is None:
            await asyncio.sleep(0.05)
    assert {m: (o.queue, o.kind, o.fingerprint, o.workers) for m, o in offered.items()} == {
        "first": ("slotq:queue:first", JobKind.GENERATION, gguf_fingerprint(tiny_model_path), ("two-models",)),
        "second": ("slotq:queue:second", JobKind.GENERATION, gguf_fingerprint(second_model), ("two-models",))}
    assert offered["first"].load_s is not None and offered["first"].load_s > 0 and offered["second"].load_s is None
    [info] = await client.workers()
    assert (info.model, info.queue, info.models) == ("first", "slotq:queue:first", 2) and info.load_s > 0

    router = ModelRouter(client, ttl_s=0, memory_s=60)
    route = await router.route("second", JobKind.GENERATION)
    assert (route.queue, route.status, route.workers) == ("slotq:queue:second", "unloaded", [])
    assert (await router.route("first")).status == "loaded"
    # The job for the unloaded model waits in its queue, durably: nothing refuses it.
    waiting = await client.for_queue(route.queue).enqueue(job_request(max_tokens=2, model="second"))
    assert await client.redis.hexists(client.for_queue(route.queue).queue.keys.jobs, waiting.id)

    # A worker that stops withdraws its offers at once: the models are then remembered (503), not routed.
    worker.request_stop("test", grace_s=0)
    deadline = time.monotonic() + 30
    while await catalog.read(client.redis, now=time.time()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert await catalog.read(client.redis, now=time.time()) == {}
    with pytest.raises(ApiError) as gone:
        await router.route("second")
    assert gone.value.status == 503 and "serves or can load model 'second'" in gone.value.message


async def test_catalog_entries_expire_and_disagreements_resolve_alike(client: SlotqClient) -> None:
    now = time.time()
    entry = CatalogEntry(model="m", queue="q:one", kind=JobKind.GENERATION, fingerprint="f1")
    w1, w2, w3 = (catalog.CatalogPublisher(name) for name in ("w1", "w2", "w3"))
    await w1.beat(client.redis, [entry], ttl_s=10, now=now)
    await w2.beat(client.redis, [entry], ttl_s=10, now=now)
    await w3.beat(client.redis, [CatalogEntry("m", "q:two", JobKind.GENERATION, "f2", 1.5)], ttl_s=10, now=now)
    [model] = (await catalog.read(client.redis, now=now)).values()
    assert (model.queue, model.fingerprint, model.workers, model.load_s) == ("q:one", "f1", ("w1", "w2"), None)
    await w2.beat(client.redis, [], ttl_s=10, now=now)                          # w2 no longer offers it
    assert (await catalog.read(client.redis, now=now))["m"].workers == ("w1",)
    assert await catalog.read(client.redis, now=now + 11) == {}                   # past their time: gone
    forgotten = now + catalog.FORGET_AFTER_S + 11
    await w1.beat(client.redis, [entry], ttl_s=10, now=forgotten - 1)            # w1 swept at its first beat:
    assert await client.redis.hlen("slotq:catalog") == 2                          # w3's stays until its next sweep
    await w1.beat(client.redis, [entry], ttl_s=10, now=forgotten + catalog.SWEEP_EVERY_S - 2)
    assert await client.redis.hlen("slotq:catalog") == 2                          # not yet: one sweep per SWEEP_EVERY_S
    await w1.beat(client.redis, [], ttl_s=10, now=forgotten + catalog.SWEEP_EVERY_S)
    assert await client.redis.hlen("slotq:catalog") == 0                          # w3's forgotten by w1's sweep
    assert await catalog.claim_load(client.redis, "m", "w1") and not await catalog.claim_load(client.redis, "m", "w2")
    await catalog.release_load(client.redis, "m")
    assert await catalog.claim_load(client.redis, "m", "w2")


async def test_status_lists_every_model_the_fleet_can_load_with_its_waiting_jobs(
        start_worker, client: SlotqClient, tiny_model_path: Path, second_model: Path) -> None:
    """`slotq status` lists the catalog: the loaded model with its worker, and the one no worker has loaded
    with the jobs waiting for it (this worker's hysteresis keeps it on the first while those wait)."""
    await start_worker(model=None, models=f"first={tiny_model_path},second={second_model}", model_idle_s=600,
                       worker_name="lister")
    second = client.for_queue("slotq:queue:second")
    for i in range(3):
        await second.enqueue(job_request(f"job {i}", max_tokens=2, model="second"))
    async with asyncio.timeout(30):           # the beat after the warm-up carries what the load cost
        while (models := {m.model: m for m in await client.models()}).keys() != {"first", "second"} \
                or models["first"].load_s is None:
            await asyncio.sleep(0.05)
    first, waiting = models["first"], models["second"]
    assert (first.status, first.loaded_on, first.can_load, first.queue, first.queued) == (
        "loaded", ["lister"], ["lister"], "slotq:queue:first", 0)
    assert (waiting.status, waiting.loaded_on, waiting.can_load, waiting.queue, waiting.queued, waiting.load_s) == (
        "unloaded", [], ["lister"], "slotq:queue:second", 3, None)
    assert waiting.fingerprint == gguf_fingerprint(second_model) and waiting.oldest_queued_age_s is not None
    console = Console(record=True, width=220)
    console.print(render(await client.for_queue("slotq:queue:first").queue_info(), models=list(models.values())))
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in console.export_text().splitlines()]
    rows = {row[0]: row[1:7] for row in cells if len(row) == 10}          # the models table's rows
    assert rows == {"first": ["generation", "slotq:queue:first", "loaded", "lister", "lister", "0"],
                    "second": ["generation", "slotq:queue:second", "unloaded", "-", "lister", "3"]}


# ---------------------------------------------------------------------- switching, through Redis
@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
async def test_one_worker_serves_two_models_by_switching(start_worker, client: SlotqClient, tiny_model_path: Path,
                                                         second_model: Path, engine_process: bool) -> None:
    """One worker, two models, jobs for both queued together and then more for the first: every job
    completes, on its own model (the result's name and fingerprint), none lost, none dead-lettered; the
    worker switched to the second model once the first's queue was quiet, and back. The same with each
    engine in a process of its own (SLOTQ_ENGINE_PROCESS): a switch stops one and starts another."""
    worker = await start_worker(model=None, models=f"first={tiny_model_path},second={second_model}",
                                model_idle_s=0.2, slots=2, worker_name="switcher", engine_process=engine_process)
    queues = {name: client.for_queue(f"slotq:queue:{name}") for name in ("first", "second")}
    fingerprints = {"first": gguf_fingerprint(tiny_model_path), "second": gguf_fingerprint(second_model)}
    wanted: dict[str, str] = {}
    for i in range(8):
        model = ("first", "second")[i % 2]
        handle = await queues[model].enqueue(job_request(f"job {i}", max_tokens=4, model=model))
        wanted[handle.id] = model
    results = {job_id: await queues[model].result(job_id, timeout=60) for job_id, model in wanted.items()}
    later = await queues["first"].enqueue(job_request("after the switch", max_tokens=4, model="first"))
    results[later.id] = await queues["first"].result(later.id, timeout=60)
    wanted[later.id] = "first"
    for job_id, result in results.items():
        assert result.status == JobStatus.SUCCEEDED, (job_id, result.error)
        assert (result.model, result.model_fingerprint, result.worker) == (
            wanted[job_id], fingerprints[wanted[job_id]], "switcher")
    assert await dead_letters.by_reason(client.redis) == {}
    for queue in queues.values():
        assert await client.redis.hlen(queue.queue.keys.jobs) == 0               # nothing left behind
    assert worker.served is not None and worker.served.name == "first" and worker.last_switch is not None


async def test_models_max_keeps_idle_models_loaded_and_unloads_the_least_recently_used(
        start_worker, client: SlotqClient, tiny_model_path: Path, second_model: Path, tmp_path: Path) -> None:
    """SLOTQ_MODELS_MAX=2, three models: switching back to the model just left reuses its engine (no load,
    the catalog's load time stays the real load's); a third model unloads the least recently used."""
    third = write_tiny_llama(tmp_path / "third.gguf", seed=11)
    worker = await start_worker(model=None, models=f"a={tiny_model_path},b={second_model},c={third}",
                                models_max=2, model_idle_s=0.1, slots=2, worker_name="keeper")
    engines = {}

    async def serve(model: str) -> None:
        queue = client.for_queue(f"slotq:queue:{model}")
        result = await (await queue.enqueue(job_request(max_tokens=2, model=model))).result(timeout=60)
        assert result.status == JobStatus.SUCCEEDED and result.model == model
        assert worker.served is not None and worker.served.name == model
        engines.setdefault(model, []).append(worker.engine)

    await serve("a")
    await serve("b")                  # a is kept
    await serve("a")
    assert engines["a"][1] is engines["a"][0] and worker.last_switch.kept        # the same engine: no load
    await serve("c")                  # a is kept; b, the least recently used, is closed to make room
    await serve("b")                  # c is kept, a closed
    assert engines["b"][1] is not engines["b"][0] and not worker.last_switch.kept
    await serve("a")
    assert engines["a"][2] is not engines["a"][0] and not worker.last_switch.kept


async def test_a_worker_starts_with_the_model_whose_jobs_wait(start_worker, client: SlotqClient,
                                                              tiny_model_path: Path, second_model: Path) -> None:
    """A worker started for a model's demand (a scaler bringing one up from zero) loads that model first,
    not the first one given."""
    queue = client.for_queue("slotq:queue:second")
    waiting = await queue.enqueue(job_request(max_tokens=2, model="second"))
    worker = await start_worker(model=None, models=f"first={tiny_model_path},second={second_model}")
    assert worker.served is not None and worker.served.name == "second" and worker.last_switch is None
    assert (await queue.result(waiting.id, timeout=60)).model == "second"


async def test_a_model_that_fails_to_load_is_dropped_and_the_worker_goes_back(
        start_worker, client: SlotqClient, tiny_model_path: Path, tmp_path: Path) -> None:
    """A GGUF whose header reads but whose tensors are cut short: the switch to it fails, the worker stops
    offering it (the gateway then answers 503 for it) and serves its first model again; the job that asked
    for the broken model stays queued, not lost."""
    broken = write_tiny_llama(tmp_path / "broken.gguf", seed=5)
    with broken.open("r+b") as file:
        file.truncate(broken.stat().st_size * 2 // 3)
    worker = await start_worker(model=None, models=f"first={tiny_model_path},broken={broken}", model_idle_s=0.1)
    stranded = await client.for_queue("slotq:queue:broken").enqueue(job_request(max_tokens=2, model="broken"))
    async with asyncio.timeout(60):
        while "broken" in worker.offers:
            await asyncio.sleep(0.05)
    first = client.for_queue("slotq:queue:first")
    result = await (await first.enqueue(job_request(max_tokens=2, model="first"))).result(timeout=60)
    assert result.status == JobStatus.SUCCEEDED and result.model == "first"
    async with asyncio.timeout(30):           # withdrawn at once; a beat that raced the withdrawal, at the next
        while set(await catalog.read(client.redis, now=time.time())) != {"first"}:
            await asyncio.sleep(0.05)
    assert await client.redis.hexists(client.for_queue("slotq:queue:broken").queue.keys.jobs, stranded.id)


async def test_of_two_idle_workers_one_answers_a_models_demand(start_worker, client: SlotqClient,
                                                               tiny_model_path: Path, second_model: Path) -> None:
    """Two workers of the same two models, both idle on the first: jobs for the second bring exactly one of
    them to it (the loading mark, then its heartbeat, tell the other it is served); the first keeps a worker."""
    models = f"first={tiny_model_path},second={second_model}"
    workers = [await start_worker(model=None, models=models, model_idle_s=0.1, worker_name=f"fleet-{i}")
               for i in range(2)]
    queue = client.for_queue("slotq:queue:second")
    handles = [await queue.enqueue(job_request(f"job {i}", max_tokens=4, model="second")) for i in range(6)]
    for handle in handles:
        assert (await queue.result(handle.id, timeout=60)).model == "second"
    await asyncio.sleep(1)                    # time enough for a second switch, were there one
    assert sorted(w.served.name for w in workers if w.served is not None) == ["first", "second"]
    assert sum(w.last_switch is not None for w in workers) == 1
