"""llama.cpp's own ``llama-server``, built once from the llama.cpp that llama-cpp-python vendors.

Comparing slotq with llama-server is only fair on the same llama.cpp: the same kernels, the same
model loader. llama-cpp-python's sdist carries its llama.cpp source (``vendor/llama.cpp``), so
the benchmark downloads that sdist for the installed version, builds the ``llama-server`` target
with CMake (about 15 minutes on 2 cores, once) and keeps it in ``~/.cache/slotq`` (or
``$SLOTQ_CACHE_DIR``), outside the repository. ``CMAKE_ARGS`` (as pip's build of llama-cpp-python
reads it, e.g. ``-DGGML_CUDA=on``) goes to CMake too, into a build of its own.
``SLOTQ_LLAMA_SERVER=/path/to/llama-server`` uses
a binary you already have instead. When neither works, :func:`find_or_build` says why and the
benchmark skips llama-server rather than fail.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from bench.report import progress

PACKAGE = "llama-cpp-python"


class Unavailable(Exception):
    """llama-server cannot be found or built here; the message says why and what to do."""


def cache_dir() -> Path:
    root = Path(os.environ.get("SLOTQ_CACHE_DIR") or Path.home() / ".cache" / "slotq")
    return root / f"llama-server-{metadata.version(PACKAGE)}"


def _cmake_args() -> list[str]:
    return shlex.split(os.environ.get("CMAKE_ARGS", ""))


def _build_dir(home: Path) -> Path:
    """``build``, or ``build-<hash of CMAKE_ARGS>`` so a GPU build never replaces the CPU one."""
    args = _cmake_args()
    return home / ("build-" + hashlib.sha1(" ".join(args).encode()).hexdigest()[:8] if args else "build")


def find_or_build() -> Path:
    """The llama-server binary: ``$SLOTQ_LLAMA_SERVER``, the cached build, or a new build."""
    given = os.environ.get("SLOTQ_LLAMA_SERVER")
    if given:
        if not os.access(given, os.X_OK):
            raise Unavailable(f"SLOTQ_LLAMA_SERVER={given} is not an executable file")
        return Path(given)
    home = cache_dir()
    build = _build_dir(home)
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    source = _vendored_source(home)
    progress(f"building llama-server from {source} (once; about 15 minutes on 2 cores; log in {home})")
    _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
          "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", *_cmake_args()],
         home / "configure.log")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
         home / "build.log")
    if not binary.exists():
        raise Unavailable(f"the build finished without {binary}; see {home / 'build.log'}")
    return binary


def _vendored_source(home: Path) -> Path:
    """llama-cpp-python's sdist for the installed version, unpacked: its ``vendor/llama.cpp``."""
    version = metadata.version(PACKAGE)
    unpacked = home / "src"
    source = unpacked / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    progress(f"downloading the {PACKAGE}=={version} sdist (for the llama.cpp source it vendors)")
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          f"{PACKAGE}=={version}", "-d", str(home)], home / "download.log")
    archives = sorted(home.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise Unavailable(f"pip downloaded no sdist of {PACKAGE}=={version}; see {home / 'download.log'}")
    with tarfile.open(archives[-1]) as archive:
        top = archive.getnames()[0].split("/")[0]
        archive.extractall(home, filter="data")
    (home / top).rename(unpacked)
    if not (source / "CMakeLists.txt").exists():
        raise Unavailable(f"the {PACKAGE} sdist has no vendor/llama.cpp/CMakeLists.txt")
    return source


def _run(argv: list[str], log: Path) -> None:
    with open(log, "wb") as out:
        try:
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
        except FileNotFoundError as exc:
            raise Unavailable(f"{argv[0]} is not installed ({exc.strerror}); llama-server needs cmake and a C++ "
                              "compiler (apt-get install cmake g++)") from exc
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise Unavailable(f"`{' '.join(argv[:3])} ...` failed with exit code {code}; last lines of {log}:\n"
                          + "\n".join(tail))
