"""``python -m bench.slow_volume ARGS``: ``slotq ARGS`` with the gateway's files on an emulated network volume
(``slotq bench gateway-batch`` runs its gateway this way).

The directory that gateway replicas share (``SLOTQ_GATEWAY_FILES_DIR``) is usually network storage, where a
write lasts as long as its bytes take to cross the network, and flush, fsync and close each wait for a round
trip. A local disk hides that behind the page cache. So while ``CONTROL_FILE`` in that directory holds a rate in
MB/s, each file opened there for writing waits in ``write`` for its bytes at that rate and in ``flush``, ``fsync``
and ``close`` for ``ROUND_TRIP_S``. The wait is ``time.sleep``, which, like a blocking system call, holds the
thread that made the call and lets the others run: a call made on the event loop stalls the loop, one made in a
thread does not. The file is looked at when a file is opened (a batch's run opens its output once).
"""

from __future__ import annotations

import builtins
import os
import sys
import time
from pathlib import Path
from typing import Any

CONTROL_FILE = ".bench-slow-volume"
ROUND_TRIP_S = 0.002

_open = builtins.open
_fsync = os.fsync
_slow_fds: set[int] = set()


class _SlowFile:
    def __init__(self, file: Any, bytes_per_s: float) -> None:
        self._file = file
        self._bytes_per_s = bytes_per_s

    def write(self, data: bytes) -> int:
        time.sleep(ROUND_TRIP_S + len(data) / self._bytes_per_s)
        return int(self._file.write(data))

    def flush(self) -> None:
        time.sleep(ROUND_TRIP_S)
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            _slow_fds.discard(self._file.fileno())
            time.sleep(ROUND_TRIP_S)
        self._file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _SlowFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slow_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    opened = _open(file, mode, *args, **kwargs)
    if isinstance(file, str | os.PathLike) and ("a" in mode or "w" in mode):
        control = Path(os.fsdecode(file)).parent / CONTROL_FILE
        if control.is_file():
            _slow_fds.add(opened.fileno())
            return _SlowFile(opened, float(control.read_text()) * 1e6)
    return opened


def _slow_fsync(fd: Any) -> None:
    if fd in _slow_fds:
        time.sleep(ROUND_TRIP_S)
    _fsync(fd)


def main() -> None:
    builtins.open = _slow_open
    os.fsync = _slow_fsync
    from slotq.jobs.cli.main import main as slotq_main

    sys.argv[0] = "slotq"
    slotq_main()


if __name__ == "__main__":
    main()
