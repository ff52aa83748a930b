"""The worker's settings: the client settings, every engine knob, the elastic controller's
thresholds, and how jobs are run. One definition gives each knob's bounds, its ``SLOTQ_<NAME>``
variable and its ``slotq worker --<name>`` flag. It lives in the worker package, so only a worker
process (and the CLI that starts one) loads the engine's configuration."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from slotq.engine import EngineConfig, EngineKnobs, resolve_model_path
from slotq.engine.model_files import ModelNotFound
from slotq.jobs.protocol.schemas import JobKind
from slotq.jobs.settings import ClientSettings
from slotq.jobs.worker.elastic.knobs import ElasticKnobs

_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|[Ff](?:16|32)|BF16|bf16)$")

# Settings renamed because their meaning changed, old name -> new. Unknown SLOTQ_* variables are ignored
# (producers and workers share one environment), so without this a deployment that still sets an old
# name would silently run the new default.
RENAMED_SETTINGS = {"lora_turn_steps": "lora_turn_max_steps"}   # a fixed turn became a cap on a turn (rule 10)


class WorkerSettings(ClientSettings, EngineKnobs, ElasticKnobs):
    """A worker: the client settings, every engine knob, the elastic controller's thresholds, and
    how jobs are run."""

    model: str | None = Field(None, description="path to a GGUF file; unset = the bundled SmolLM2-135M-Instruct")
    models: str | None = Field(
        None, description="several models this worker can serve, one loaded at a time: name=path,name=path; each "
                          "model's jobs wait on the queue <SLOTQ_QUEUE_NAME>:<name> (docs/operations.md, \"Several "
                          "models in one fleet\")")
    models_dir: Path | None = Field(
        None, description="a folder of GGUF files this worker can serve, one loaded at a time: every *.gguf, named "
                          "by its file name without .gguf (with SLOTQ_MODELS: both)")
    models_max: int = Field(
        1, ge=1, le=64,
        description="models a worker of several models keeps loaded: the one it serves and up to this many - 1 "
                    "idle ones, kept in memory so that switching back skips the load, unloaded by least recent use "
                    "(llama-server's --models-max); each holds its weights and KV cache")
    model_idle_s: float = Field(
        3.0, ge=0, le=3600,
        description="a worker of several models switches to another model (one with jobs waiting and no worker) "
                    "only once its own model's queue has had nothing waiting and nothing running here for this "
                    "long: hysteresis, so a bursty load does not make it thrash")
    model_name: str | None = Field(
        None, description="the name clients ask for (the gateway's `model`); unset = the model file's name without "
                          "its quantization suffix, e.g. SmolLM2-135M-Instruct for SmolLM2-135M-Instruct.Q4_1.gguf")
    lane_min_share: float = Field(
        0.125, ge=0, le=0.5,
        description="no lane starves: each lane below the top keeps floor(slots x this) of the worker's slots while "
                    "it has jobs waiting (the claim fills them from that lane first, and a higher lane never "
                    "preempts them); 0.125 = 1 slot in 8, 0 = strict lanes")
    poll_delay_s: float = Field(
        1.0, gt=0, le=60, description="fallback tick: reap expired leases, promote due retries; enqueues wake "
                                      "workers at once")
    job_timeout_s: int = Field(3600, ge=1, description="hard cap on one attempt")
    lock_ttl_s: int = Field(15, ge=3, description="job lease TTL, renewed by the heartbeat; bounds crash recovery")
    max_tries: int = Field(
        5, ge=1, le=100, description="tries of a job: an attempt spends one when it fails (a retryable error) or is "
                                     "lost (worker killed or stalled) before delivering new tokens; beyond this many "
                                     "the job is dead-lettered")
    max_interruptions: int = Field(
        20, ge=0, le=1000, description="attempts of a job that may be lost after delivering new tokens: they spend no "
                                       "try (the next attempt resumes from them), but beyond this many the job is "
                                       "dead-lettered, so nothing runs forever")
    max_worker_deaths: int = Field(
        2, ge=1, le=100, description="attempts of a job in a row that may end with their worker dying (killed, out "
                                     "of memory, crashed) before any progress; the worker that claims it next "
                                     "dead-letters it (killed_its_worker) instead of running it. A job whose last "
                                     "attempt died so starts alone in its worker")
    retry_backoff_s: float = Field(1.0, ge=0, description="first retry delay; doubles each try")
    drain_grace_s: int = Field(
        25, ge=0, description="on SIGTERM, let running jobs finish this long (Heroku allows 30 s)")
    stream_flush_ms: float = Field(
        100.0, gt=0, le=1000, description="generated text waits at most this long before it is written to the job's "
                                          "stream; earlier once a write's entries carry more tokens than they cost "
                                          "(jobs/worker/stream_writer.py, FlushPolicy: about 8 a chunk entry); a "
                                          "job's first entry and final entries go at once")
    embeddings: bool | None = Field(
        None, description="serve embedding jobs (the model pooled into vectors) instead of generating text; unset = "
                          "detected from the GGUF: an encoder such as BERT, or a pooling type in its header. A text "
                          "generator serves embeddings only when asked (--embeddings, mean pooling by default)")
    engine_process: bool = Field(
        False, description="run the llama.cpp engine in a process of its own (slotq.engine.process): the worker's "
                           "event loop and the engine thread stop sharing one GIL. Off until a benchmark shows it "
                           "never loses (docs/architecture.md, 'The engine process')")
    rerank: bool | None = Field(
        None, description="serve rerank jobs (documents scored against a query) on a reranker GGUF; unset = detected "
                          "from the GGUF: rank pooling in its header. A model without it cannot rank (the worker "
                          "refuses to start: model_cannot_rank)")
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus metrics on this port (0 = off)")
    health_max_stall_s: float = Field(
        60.0, gt=0, description="/ready fails (and the worker claims nothing) while a generated stream entry has "
                                "waited this long for Redis to take it, or the worker's claims and reaps have all "
                                "failed for this long (Redis refusing them: a Lua error, OOM, WRONGTYPE)")
    worker_name: str | None = Field(None, description="shown by `slotq status`; default host:pid")

    @field_validator("models")
    @classmethod
    def _valid_models(cls, value: str | None) -> str | None:
        if value is not None:
            _parse_models(value)         # raises ValueError naming the entry
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed_settings(cls, data: Any) -> Any:
        """A renamed setting given under its old name (keyword, ``./.env`` or the environment) is an
        error that names the new one, not a silently ignored variable."""
        given = {str(key).lower() for key in data} if isinstance(data, dict) else set()
        given |= {name[len("SLOTQ_"):].lower() for name in os.environ if name.upper().startswith("SLOTQ_")}
        for old, new in RENAMED_SETTINGS.items():
            if old in given:
                raise ValueError(f"SLOTQ_{old.upper()} was renamed SLOTQ_{new.upper()} (see its entry in README.md's "
                                 f"configuration table): set that instead")
        return data

    @model_validator(mode="after")
    def _one_way_to_name_models(self) -> WorkerSettings:
        if (self.models or self.models_dir) and (self.model or self.model_name):
            raise ValueError("SLOTQ_MODEL / SLOTQ_MODEL_NAME and SLOTQ_MODELS / SLOTQ_MODELS_DIR: give every model "
                             "in SLOTQ_MODELS (name=path) or SLOTQ_MODELS_DIR, not one of them apart")
        return self

    @model_validator(mode="after")
    def _one_kind(self) -> WorkerSettings:
        if self.embeddings and self.rerank:
            raise ValueError("embeddings and rerank (SLOTQ_EMBEDDINGS, SLOTQ_RERANK) are both set: a worker serves one "
                             "kind of job; run a worker for each")
        return self

    @model_validator(mode="after")
    def _top_lane_keeps_half(self) -> WorkerSettings:
        below = len(self.lanes) - 1
        if self.lane_min_share * below > 0.5:
            raise ValueError(f"lane_min_share (SLOTQ_LANE_MIN_SHARE={self.lane_min_share}) x {below} lanes below the "
                             f"top (SLOTQ_LANES) leaves the top lane under half the slots: at most {0.5 / below:.3f}")
        return self

    @property
    def max_attempts(self) -> int:
        """The most attempts a job can make: every try and every interruption. The job function
        dead-letters the attempt after that; arq's own limit must lie beyond it."""
        return self.max_tries + self.max_interruptions

    def served_model_name(self, model_path: Path) -> str:
        """What this worker advertises as its model: ``model_name``, else the file's stem without a
        quantization suffix (``.Q4_1``, ``-Q4_K_M``, ``.f16``), the name people type."""
        if self.model_name:
            return self.model_name
        return _QUANT_SUFFIX.sub("", model_path.stem) or model_path.stem

    @property
    def several_models(self) -> bool:
        """Given SLOTQ_MODELS or SLOTQ_MODELS_DIR: each model on a queue of its own, loaded on demand."""
        return bool(self.models or self.models_dir)

    def model_files(self) -> dict[str, Path]:
        """Every model this worker can serve, name -> GGUF file, in the order given (SLOTQ_MODELS, then
        SLOTQ_MODELS_DIR's files by name); one worker of one model: its model. Raises ModelNotFound
        for a file or folder that is not there, ValueError for a name given twice."""
        if not self.several_models:
            path = resolve_model_path(self.model)
            return {self.served_model_name(path): path}
        listed = _parse_models(self.models) if self.models else {}
        files = {name: resolve_model_path(path) for name, path in listed.items()}
        if self.models_dir is not None:
            if not self.models_dir.is_dir():
                raise ModelNotFound(f"SLOTQ_MODELS_DIR: {self.models_dir} is not a folder")
            for path in sorted(self.models_dir.glob("*.gguf")):
                if path.stem in files and files[path.stem] != path:
                    raise ValueError(f"SLOTQ_MODELS_DIR: model {path.stem!r} ({path}) is also named in SLOTQ_MODELS "
                                     f"({files[path.stem]}); one name, one file")
                files[path.stem] = path
        if not files:
            raise ModelNotFound(f"SLOTQ_MODELS_DIR: no *.gguf file in {self.models_dir}")
        return files

    def queue_of(self, model: str) -> str:
        """The queue of ``model``'s jobs: SLOTQ_QUEUE_NAME for a worker of one model (the zero-config
        default ``slotq:queue``), ``<SLOTQ_QUEUE_NAME>:<model>`` for each of several."""
        return f"{self.queue_name}:{model}" if self.several_models else self.queue_name

    def job_kind(self, model_path: Path) -> JobKind:
        """The kind of job this worker serves: ``rerank`` or ``embeddings`` when set, else what the GGUF says."""
        from slotq.engine.embedding import is_embedding_model  # loads llama.cpp: only a worker asks
        from slotq.engine.rerank import is_rank_model

        if self.rerank or (self.rerank is None and not self.embeddings and is_rank_model(model_path)):
            return JobKind.RERANK
        embeddings = self.embeddings if self.embeddings is not None else is_embedding_model(model_path)
        return JobKind.EMBEDDING if embeddings else JobKind.GENERATION

    def engine_config(self, model_path: Path | None = None) -> EngineConfig:
        """The engine's configuration for ``model_path`` (default: SLOTQ_MODEL, else the bundled model)."""
        knobs = {name: getattr(self, name) for name in EngineKnobs.model_fields}
        return EngineConfig(model_path=model_path or resolve_model_path(self.model), **knobs)


def _parse_models(value: str) -> dict[str, str]:
    """``name=path,name=path`` -> {name: path}; ValueError naming the entry that is not one."""
    models: dict[str, str] = {}
    for entry in (part.strip() for part in value.split(",")):
        if not entry:
            continue
        name, sep, path = (part.strip() for part in entry.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"SLOTQ_MODELS: {entry!r} is not name=path (e.g. chat=/models/chat.gguf)")
        if name in models:
            raise ValueError(f"SLOTQ_MODELS: the name {name!r} is given twice")
        models[name] = path
    if not models:
        raise ValueError("SLOTQ_MODELS: no model given (name=path,name=path)")
    return models
