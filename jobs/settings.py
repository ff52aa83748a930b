"""slotq settings: ``SLOTQ_*`` environment variables, and ``slotq`` command-line flags.

Two classes, split by who needs what:

* :class:`ClientSettings` is all a producer needs (a web app that only enqueues, the gateway, the
  ``slotq enqueue/result/status`` commands): where Redis is, which queue, limits and retention.
  It never parses a worker's GPU or KV settings, so a bad ``SLOTQ_GPU_LAYERS`` cannot break a web app.
* :class:`WorkerSettings` adds the worker's own knobs and inherits every engine tunable from
  :class:`engine.EngineKnobs`: one definition gives the bounds, the ``SLOTQ_<NAME>`` variable and the
  ``--<name>`` flag of ``slotq worker``.

Library code reads the process environment only. The ``slotq`` commands also read ``./.env``
(:func:`from_command_line`), the usual place for a development setup. ``SENTRY_DSN`` is read by
sentry-sdk itself.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, NoDecode, SettingsConfigDict

from slotq.engine import EngineConfig, EngineKnobs, resolve_model_path
from slotq.engine.constraints import GrammarKnobs
from slotq.jobs.worker.elastic.knobs import ElasticKnobs

if TYPE_CHECKING:
    from slotq.jobs.protocol.redis_queue import TenantQuotas
    from slotq.jobs.protocol.schemas import JobKind

DOTENV = ".env"
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|[Ff](?:16|32)|BF16|bf16)$")


class ClientSettings(BaseSettings, GrammarKnobs):
    """What every slotq process needs to reach the queue. The bounds on structured output
    (``SLOTQ_GRAMMAR_*``, the engine's :class:`GrammarKnobs`) are here too: a producer refuses a
    schema the workers would refuse before it is queued, so both must be given the same values."""

    model_config = SettingsConfigDict(env_prefix="SLOTQ_", env_file=None, extra="ignore")

    redis_url: str | None = Field(
        None, description="redis://, rediss:// (TLS) or redis+sentinel://[:password@]host:port[,host:port...]/"
                          "service/db URL (password in the URL); unset = the embedded Valkey server")
    redis_ca_file: Path | None = Field(
        None, description="CA certificate(s) (PEM) that sign the server's certificate, for rediss:// and "
                          "rediss+sentinel://; unset = the system's CAs")
    redis_wait_replicas: int = Field(
        0, ge=0, le=16, description="after each enqueue, wait until this many replicas have the job (Redis WAIT), so "
                                    "a failover right after cannot lose it; 0 = do not wait")
    redis_connect_timeout_s: float = Field(
        5.0, gt=0, le=300, description="a producer gives up reaching Redis after this long, with a clear error")
    queue_name: str = Field("slotq:queue", min_length=1, max_length=200,
                            description="the queue of one model; workers of another model use another name")
    data_dir: Path = Field(Path.home() / ".local/share/slotq",
                           description="data of the embedded Redis (append-only file)")
    embedded_redis_port: int = Field(6399, ge=0, le=65535,
                                     description="port of the embedded Redis (0 = any free port)")
    lanes: Annotated[list[str], NoDecode] = Field(
        ["interactive", "bulk"], min_length=1,
        description="priority lanes of the queue, highest first, comma-separated; a worker claims from a lower "
                    "lane only when the higher ones are empty (producers and workers must agree)")
    max_queue_length: int = Field(10_000, ge=1, description="enqueue raises QueueFull beyond this many waiting jobs")
    tenant_max_waiting: int | None = Field(
        None, ge=1, description="quota of each tenant: its jobs waiting to start (queued or deferred); enqueue raises "
                                "QuotaExceeded (the gateway: 429) beyond it; unset = no limit")
    tenant_max_in_flight: int | None = Field(
        None, ge=1, description="quota of each tenant: its jobs waiting or running (a job counts from enqueue to its "
                                "end, so no more than this many run at once); unset = no limit")
    tenant_tokens_per_min: int | None = Field(
        None, ge=1, description="quota of each tenant: tokens its jobs reserve per minute of the clock (prompt "
                                "characters / 4 + max_tokens x n, at enqueue); unset = no limit")
    max_prompt_chars_per_token: float = Field(
        16.0, ge=1, le=1000, description="enqueue refuses a prompt longer than the largest advertised context times "
                                         "this many characters (no tokenizer packs more into one token in practice)")
    keep_result_s: int = Field(86_400, ge=1, description="how long a finished job's result is kept")
    stream_ttl_s: int = Field(3600, ge=1, description="how long a job's output stream lives after its final event")
    stream_maxlen: int = Field(100_000, ge=100, description="cap on entries per output stream")
    log_level: str = Field("INFO", description="log level of slotq commands (DEBUG, INFO, WARNING, ...)")
    clock_offset_s: float = Field(
        0.0, ge=-86_400, le=86_400,
        description="for tests: shift this process's wall clock by this many seconds where it stamps records (a host "
                    "whose clock runs off); leases, reaping, ready times and quota minutes use Redis' clock")

    def tenant_quotas(self) -> TenantQuotas:
        """The quotas every producer with these settings applies to each tenant's enqueues."""
        from slotq.jobs.protocol.redis_queue import TenantQuotas

        return TenantQuotas(max_waiting=self.tenant_max_waiting, max_in_flight=self.tenant_max_in_flight,
                            tokens_per_min=self.tenant_tokens_per_min)

    @field_validator("lanes", mode="before")
    @classmethod
    def _split_lanes(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [lane.strip() for lane in value.split(",") if lane.strip()]
        return value

    @field_validator("lanes")
    @classmethod
    def _valid_lanes(cls, lanes: list[str]) -> list[str]:
        from slotq.jobs.protocol.keys import QueueKeys

        QueueKeys("check", tuple(lanes))      # raises ValueError naming a bad lane
        return lanes


class WorkerSettings(ClientSettings, EngineKnobs, ElasticKnobs):
    """A worker: the client settings, every engine knob, the elastic controller's thresholds, and
    how jobs are run."""

    model: str | None = Field(None, description="path to a GGUF file; unset = the bundled SmolLM2-135M-Instruct")
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
                                          "stream; earlier once a write carries more tokens than it costs Redis "
                                          "commands (a job's first entry and final entries go at once)")
    embeddings: bool | None = Field(
        None, description="serve embedding jobs (the model pooled into vectors) instead of generating text; unset = "
                          "detected from the GGUF: an encoder such as BERT, or a pooling type in its header. A text "
                          "generator serves embeddings only when asked (--embeddings, mean pooling by default)")
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus metrics on this port (0 = off)")
    worker_name: str | None = Field(None, description="shown by `slotq status`; default host:pid")

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

    def job_kind(self, model_path: Path) -> JobKind:
        """The kind of job this worker serves: ``embeddings`` when set, else what the GGUF says."""
        from slotq.engine.embedding import is_embedding_model
        from slotq.jobs.protocol.schemas import JobKind

        embeddings = self.embeddings if self.embeddings is not None else is_embedding_model(model_path)
        return JobKind.EMBEDDING if embeddings else JobKind.GENERATION

    def engine_config(self) -> EngineConfig:
        knobs = {name: getattr(self, name) for name in EngineKnobs.model_fields}
        return EngineConfig(model_path=resolve_model_path(self.model), **knobs)


SettingsT = TypeVar("SettingsT", bound=ClientSettings)


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[ClientSettings]) -> CliSettingsSource[Any]:
    """Add one ``--flag`` per settings field to ``parser`` (help text, default and bounds come from
    the field); returns the source that :func:`from_command_line` reads them back with."""
    source: CliSettingsSource[Any] = CliSettingsSource(
        settings_cls, root_parser=parser, cli_kebab_case=True, cli_hide_none_type=True, cli_implicit_flags=True,
        cli_show_env_vars=True)
    parser.epilog = ((parser.epilog + "\n") if parser.epilog else "") + (
        "Each option can also be set with the environment variable shown, or in ./.env; "
        "flags win over the environment, which wins over .env.")
    return source


def from_command_line(settings_cls: type[SettingsT], args: argparse.Namespace,
                      source: CliSettingsSource[Any] | None) -> SettingsT:
    """Settings for a ``slotq`` command: flags given on the command line, then the environment,
    then ``./.env``, then defaults. Flags that were not given do not override anything."""
    if source is None:
        return settings_cls(_env_file=DOTENV)  # type: ignore[call-arg]
    return settings_cls(_env_file=DOTENV, _cli_settings_source=source(parsed_args=args))  # type: ignore[call-arg]
