"""slotq settings: ``SLOTQ_*`` environment variables, and ``slotq`` command-line flags.

:class:`ClientSettings` is all a producer needs (a web app that only enqueues, the gateway, the
``slotq enqueue/result/status`` commands): where Redis is, which queue, limits and retention. Each
process kind extends it in its own package, so a producer never loads (or parses) what it does not
run: the worker's :class:`slotq.jobs.worker.settings.WorkerSettings` (every engine tunable, GPU and
KV included: a bad ``SLOTQ_GPU_LAYERS`` cannot break a web app), the gateway's
:class:`slotq.jobs.gateway.settings.GatewaySettings`.

Library code reads the process environment only. The ``slotq`` commands also read ``./.env``
(:func:`from_command_line`), the usual place for a development setup. ``SENTRY_DSN`` is read by
sentry-sdk itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, CliSettingsSource, NoDecode, SettingsConfigDict

from slotq.engine.grammar_knobs import GrammarKnobs
from slotq.jobs.protocol.keys import MAX_QUEUE_PARTITIONS, QueueKeys

DOTENV = ".env"


class ClientSettings(BaseSettings, GrammarKnobs):
    """What every slotq process needs to reach the queue. The bounds on structured output
    (``SLOTQ_GRAMMAR_*``, the engine's :class:`GrammarKnobs`) are here too: a producer refuses a
    schema the workers would refuse before it is queued, so both must be given the same values."""

    model_config = SettingsConfigDict(env_prefix="SLOTQ_", env_file=None, extra="ignore")

    redis_url: str | None = Field(
        None, description="redis://, rediss:// (TLS), redis+sentinel://[:password@]host:port[,host:port...]/"
                          "service/db or redis+cluster://[:password@]host:port[,host:port...] URL (password in the "
                          "URL); unset = the embedded Valkey server")
    redis_ca_file: Path | None = Field(
        None, description="CA certificate(s) (PEM) that sign the server's certificate, for rediss://, "
                          "rediss+sentinel:// and rediss+cluster://; unset = the system's CAs")
    redis_wait_replicas: int = Field(
        0, ge=0, le=16, description="after each enqueue, wait until this many replicas have the job (Redis WAIT), so "
                                    "a failover right after cannot lose it; 0 = do not wait")
    redis_connect_timeout_s: float = Field(
        5.0, gt=0, le=300, description="a producer gives up reaching Redis after this long, with a clear error")
    queue_name: str = Field("slotq:queue", min_length=1, max_length=200,
                            description="the queue of one model; workers of another model use another name")
    queue_partitions: int = Field(
        1, ge=1, le=MAX_QUEUE_PARTITIONS,
        description="split each queue into this many sub-queues (partitions), whose hash slots spread one per "
                    "primary over a Redis Cluster of as many primaries, so one queue's claim path is not bound by "
                    "one primary; a job's partition follows from its id. Producers, gateway and workers of a queue "
                    "must agree (a worker or producer whose count differs from the serving workers' refuses). "
                    "Given up across partitions: strict order, fair share and tenant quotas (each partition "
                    "counts its own), preemption (per partition). 1 = one queue, the layout of every release")
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

    @field_validator("lanes", mode="before")
    @classmethod
    def _split_lanes(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [lane.strip() for lane in value.split(",") if lane.strip()]
        return value

    @field_validator("lanes")
    @classmethod
    def _valid_lanes(cls, lanes: list[str]) -> list[str]:
        QueueKeys("check", tuple(lanes))      # raises ValueError naming a bad lane
        return lanes


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
        return settings_cls(_env_file=DOTENV)
    return settings_cls(_env_file=DOTENV, _cli_settings_source=source(parsed_args=args))
