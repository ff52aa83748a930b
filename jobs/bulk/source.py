"""Reading a bulk input: JSONL, one request per line, from a file (gzip or not) or from stdin.

The input is read twice, line by line, never held in memory. The first pass (:meth:`InputFile.scan`)
hashes the text (the run's identity, :mod:`slotq.jobs.bulk.identity`), counts the lines (the progress
bar's total) and finds ids used on more than one line; the second (:meth:`InputFile.lines`) feeds
the run. Stdin cannot be read twice, so it is first copied to a temporary file beside the output
and then treated as a file: piping the same content again is the same run, and resumes it.

Line numbers are the file's own (1-based, blank lines counted but skipped), as an editor shows them.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import gzip
import hashlib
import io
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from slotq.jobs.bulk.disk import FileThread
from slotq.jobs.bulk.identity import identity_of, new_hasher
from slotq.jobs.errors import SlotqError

GZIP_MAGIC = b"\x1f\x8b"
STDIN = "-"
READ_LINES = 1000                 # lines a run's read hands over at a time ...
READ_BYTES = 1 << 20              # ... or bytes of text, whichever comes first


class InputError(SlotqError, ValueError):
    """The input cannot be read as a whole (missing file, bad gzip data)."""


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class InputScan:
    identity: str
    lines: int                       # physical lines: the highest line number
    requests: int                    # non-blank lines: the run's total
    repeated: dict[int, int] = field(default_factory=dict)    # hash of an id on several lines -> its first line

    def first_line_with(self, key: str) -> int | None:
        """The first line carrying ``key`` when ``key`` is on more than one line, else None. (Ids are
        compared by a 64-bit hash: two different ids would have to collide to be called repeated.)"""
        return self.repeated.get(key_hash(key)) if self.repeated else None


class LineSource(Protocol):
    """What a bulk run reads (an :class:`InputFile`, for ``slotq bulk`` and the gateway's Batch API alike)."""

    async def scan(self, key_of: Callable[[bytes], str | None]) -> InputScan: ...

    def lines(self) -> AsyncIterator[tuple[int, bytes]]: ...

    def close(self) -> None: ...


class InputFile:
    """A JSONL file, gzip-compressed or not (told by its first bytes, not its name), or stdin (``-``)."""

    def __init__(self, path: str | Path, queue_name: str, *, spool_dir: Path | None = None) -> None:
        self.queue_name = queue_name
        self._spooled: Path | None = None
        if str(path) == STDIN:
            self._spooled = self._spool_stdin(spool_dir or Path.cwd())
            self.path = self._spooled
            self.name = "<stdin>"
        else:
            self.path = Path(path)
            self.name = str(path)
            if not self.path.is_file():
                raise InputError(f"input {self.name}: no such file")

    @staticmethod
    def _spool_stdin(directory: Path) -> Path:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".slotq-bulk-stdin-", suffix=".jsonl",
                                         delete=False) as spool:
            shutil.copyfileobj(sys.stdin.buffer, spool, 1 << 20)
        return Path(spool.name)

    def _open(self) -> gzip.GzipFile | io.BufferedReader:
        with open(self.path, "rb") as probe:
            compressed = probe.read(2) == GZIP_MAGIC
        return gzip.open(self.path, "rb") if compressed else open(self.path, "rb")

    def _numbered(self) -> Generator[tuple[int, bytes], None, None]:
        """(line number, line without its end-of-line), blank lines included."""
        try:
            with self._open() as f:
                for number, raw in enumerate(f, 1):
                    yield number, raw.rstrip(b"\r\n")
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise InputError(f"input {self.name}: cannot be read ({type(exc).__name__}: {exc})") from None

    async def scan(self, key_of: Callable[[bytes], str | None]) -> InputScan:
        return await asyncio.to_thread(self._scan, key_of)

    def _scan(self, key_of: Callable[[bytes], str | None]) -> InputScan:
        hasher = new_hasher(self.queue_name)
        keys = array.array("Q")           # 8 bytes per line that carries an id, for this pass only
        lines = requests = 0
        for number, raw in self._numbered():
            lines = number
            hasher.update(raw + b"\n")
            if raw.strip():
                requests += 1
                key = key_of(raw)
                if key is not None:
                    keys.append(key_hash(key))
        repeated = _repeated(keys)
        del keys
        if repeated:                      # rare: read again for the first line of each repeated id
            first: dict[int, int] = {}
            for number, raw in self._numbered():
                key = key_of(raw) if raw.strip() else None
                h = key_hash(key) if key is not None else None
                if h in repeated and h not in first:
                    first[h] = number
            return InputScan(identity_of(hasher), lines, requests, first)
        return InputScan(identity_of(hasher), lines, requests)

    async def lines(self) -> AsyncIterator[tuple[int, bytes]]:
        """Non-blank lines with their numbers, read (and gunzipped) a batch at a time in a thread of
        the file's own (:mod:`slotq.jobs.bulk.disk`), so the event loop never waits on the disk, and
        only one batch is held. Each batch is an await, so a long stretch of lines the output already
        holds (skipped without an await) cannot hold the loop either."""
        numbered = self._numbered()
        disk = FileThread("slotq-bulk-input")
        try:
            while batch := await disk.call(_take, numbered):
                for number, raw in batch:
                    if raw.strip():
                        yield number, raw
        finally:
            disk.close(last=numbered.close)

    def close(self) -> None:
        if self._spooled is not None:
            with contextlib.suppress(OSError):
                self._spooled.unlink()


def _take(lines: Iterator[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The next lines, up to READ_LINES of them or READ_BYTES of text (at least one line, however long)."""
    batch: list[tuple[int, bytes]] = []
    size = 0
    for item in lines:
        batch.append(item)
        size += len(item[1])
        if len(batch) >= READ_LINES or size >= READ_BYTES:
            break
    return batch


def _repeated(keys: array.array[int]) -> set[int]:
    """Hashes that occur more than once (sorted in place: no copy of the array)."""
    if len(keys) < 2:
        return set()
    hashes = np.frombuffer(keys, dtype=np.uint64)
    hashes.sort()
    return {int(h) for h in np.unique(hashes[1:][hashes[1:] == hashes[:-1]])}
