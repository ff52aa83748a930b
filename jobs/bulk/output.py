"""Where a bulk run writes: the output file (finished lines) and the errors file (failed lines).

The output file is also the run's memory. Lines are written in the order they finish, each with its
job id (:mod:`slotq.jobs.bulk.identity`), so a rerun reads it back to learn which lines are done -- one
bit per input line, whatever the output's size -- and skips them. Nothing else has to agree with it:
there is no side file that a crash could leave out of step. A crash in the middle of a write leaves
at most a partial last line, which the rerun cuts off (that line runs again, or its kept result is
picked up). Records are flushed to the OS as they are written and fsynced (:meth:`commit`) before
the run removes their results from Redis, so a power cut cannot lose a line that Redis no longer
holds either. Every call on the files runs in a thread of their own, in order
(:mod:`slotq.jobs.bulk.disk`): the gateway's event loop never waits on them.

The errors file lists the lines that failed in this run; a rerun tries them again and rewrites it.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import IO, Any, Protocol

from slotq.jobs.bulk.disk import FileThread
from slotq.jobs.bulk.formats import job_id_in
from slotq.jobs.bulk.identity import parse_job_id
from slotq.jobs.bulk.source import InputScan
from slotq.jobs.errors import SlotqError

RECENT_IDS = 4096          # job ids at the end of the output whose results a crash may have left in Redis


class OutputError(SlotqError, ValueError):
    """The output file cannot be resumed (it belongs to another input, or is damaged)."""


def default_errors_path(output: Path) -> Path:
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(f"{stem}.errors.jsonl")


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class ResultSink(Protocol):
    """What a bulk run writes to (:class:`OutputFiles`, for ``slotq bulk`` and the gateway's Batch API alike)."""

    recent_job_ids: list[str]     # set by open(): jobs whose output an earlier run wrote last

    async def open(self, scan: InputScan) -> int:
        """Prepare to write; return how many lines earlier runs finished."""
        ...

    def is_done(self, line: int) -> bool: ...

    async def write(self, outputs: list[tuple[int, dict[str, Any]]], errors: list[dict[str, Any]]) -> None: ...

    async def commit(self) -> None:
        """Make everything written so far durable."""
        ...

    async def close(self) -> None: ...


class OutputFiles:
    def __init__(self, output: Path, errors: Path | None = None) -> None:
        self.output = Path(output)
        self.errors = Path(errors) if errors is not None else default_errors_path(self.output)
        if str(output) == "-":
            raise OutputError("the output must be a file: running the command again reads it back to resume")
        if self.errors.resolve() == self.output.resolve():
            raise OutputError(f"the errors file must differ from the output file ({self.output})")
        for path in (self.output, self.errors):
            if not path.resolve().parent.is_dir():
                raise OutputError(f"{path}: no such directory {path.resolve().parent}")
        self.recent_job_ids: list[str] = []
        self._done = bytearray()
        self._out: IO[bytes] | None = None
        self._err: IO[bytes] | None = None
        self._disk: FileThread | None = None       # every call on the two files runs there, off the event loop

    async def open(self, scan: InputScan) -> int:
        self._done = bytearray(scan.lines // 8 + 1)
        self._disk = FileThread("slotq-bulk-output")
        try:
            return await self._disk.call(self._open_files, scan)
        except OSError as exc:
            raise OutputError(f"cannot write {exc.filename}: {exc.strerror}") from None
        finally:
            if self._err is None:               # not opened: close() will not be called
                self._disk.close(last=self._close_files)

    def _open_files(self, scan: InputScan) -> int:
        """In the file thread: read the output back, then open both files for the run."""
        done = self._read_back(scan)
        self._out = open(self.output, "ab")  # noqa: SIM115 - held for the run, closed in close()
        self._err = open(self.errors, "wb")  # noqa: SIM115
        return done

    def _read_back(self, scan: InputScan) -> int:
        """Mark the lines the output already holds; cut a partial last line off."""
        if not self.output.exists():
            return 0
        recent: deque[str] = deque(maxlen=RECENT_IDS)
        done = 0
        with open(self.output, "r+b") as f:
            end = 0
            for number, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    f.truncate(end)           # a write cut short by a crash: that line is not done
                    break
                end += len(raw)
                job_id = _job_id(raw)
                parsed = parse_job_id(job_id)
                if parsed is None:
                    raise OutputError(f"{self.output}, line {number}: not a slotq bulk output record; "
                                      "give another output file")
                identity, line = parsed
                if identity != scan.identity or line > scan.lines:
                    raise OutputError(f"{self.output} holds results of another input or queue (line {number}: job "
                                      f"{job_id}, this run's jobs are bulk:{scan.identity}:*); give another output "
                                      "file, or remove it to start over")
                if not self.is_done(line):
                    self._done[line >> 3] |= 1 << (line & 7)
                    done += 1
                    recent.append(job_id)     # type: ignore[arg-type]
        self.recent_job_ids = list(recent)
        return done

    def is_done(self, line: int) -> bool:
        return bool(self._done[line >> 3] & (1 << (line & 7)))

    async def write(self, outputs: list[tuple[int, dict[str, Any]]], errors: list[dict[str, Any]]) -> None:
        """Encode here and write in the file thread: encoding holds the GIL, and a thread that holds
        it makes the event loop wait up to a switch interval (5 ms) every time it wants it back,
        several times per request it serves; a write releases it."""
        assert self._disk is not None
        if outputs or errors:
            await self._disk.call(self._append, b"".join(encode(record) for _, record in outputs),
                                  b"".join(encode(record) for record in errors))
        for line, _ in outputs:
            self._done[line >> 3] |= 1 << (line & 7)

    def _append(self, outputs: bytes, errors: bytes) -> None:
        """In the file thread: write one batch of records to each file, and flush them to the OS."""
        assert self._out is not None and self._err is not None
        for f, data in ((self._out, outputs), (self._err, errors)):
            if data:
                f.write(data)
                f.flush()

    async def commit(self) -> None:
        assert self._disk is not None and self._out is not None and self._err is not None
        await self._disk.call(_fsync, self._out, self._err)

    async def close(self) -> None:
        if self._disk is None:
            return
        try:
            await self._disk.call(self._close_files)
        finally:
            self._disk.close()

    def _close_files(self) -> None:
        for f in (self._out, self._err):
            if f is not None:
                f.close()


def _job_id(raw: bytes) -> str | None:
    try:
        return job_id_in(json.loads(raw))
    except ValueError:
        return None


def _fsync(*files: IO[bytes]) -> None:
    for f in files:
        os.fsync(f.fileno())
