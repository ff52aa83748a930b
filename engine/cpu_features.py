"""Whether llama.cpp may repack CPU weights, decided from the CPU's feature flags. No llama.cpp here.

At model load llama.cpp copies quantized weights into "extra buffer types" whose layouts suit
the CPU's matrix kernels: ``CPU_REPACK`` (Q4_0, Q4_K, IQ4_NL as 4x4/8x8 blocks for AVX2,
AVX-512 and Arm) and, on CPUs with AMX, ``AMX`` tiles (Q4_0, Q4_1, Q8_0 and the K-quants).
``llama_model_params.use_extra_bufts`` switches all of them on or off together (llama-server's
``--no-repack``). Repacking makes Q4_0/Q4_K decoding much faster on AVX2/AVX-512, so it stays on
wherever it works; on AMX it crashes (see :func:`decide_repack`).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

from slotq.engine.config import CpuRepack

#: The flag Linux lists for AMX in /proc/cpuinfo (``amx_int8`` and ``amx_bf16`` come with it).
AMX_FLAG = "amx_tile"


@dataclass(frozen=True)
class RepackDecision:
    repack: bool
    reason: str

    def describe(self) -> str:
        """One log line: ``CPU weight repacking off: <reason>``."""
        return f"CPU weight repacking {'on' if self.repack else 'off'}: {self.reason}"


def decide_repack(mode: CpuRepack, cpu_flags: str | None) -> RepackDecision:
    """Repack or not, given the setting and the CPU's flags (None: this platform does not say).

    ``auto`` is the one place to change when upstream fixes AMX. Today llama.cpp's AMX kernels
    segfault at the first ``llama_decode`` (``ggml_backend_amx_mul_mat`` at ``ldtilecfg``, in
    libggml-cpu.so): llama.cpp issue #20824 (closed as stale, unfixed), fix proposed in PR #26954
    (AMX tile permission per thread, open), still so in llama-cpp-python 0.3.36. Once a fixed
    llama-cpp-python is pinned, ``auto`` can return ``repack=True`` for AMX CPUs too.
    """
    if mode is CpuRepack.ON:
        return RepackDecision(True, "cpu_repack=on (SLOTQ_CPU_REPACK)")
    if mode is CpuRepack.OFF:
        return RepackDecision(False, "cpu_repack=off (SLOTQ_CPU_REPACK)")
    if cpu_flags is None:
        return RepackDecision(True, "this platform does not list CPU flags (AMX unknown); kept on. "
                                    "If llama.cpp crashes at the first decode, set SLOTQ_CPU_REPACK=off")
    if AMX_FLAG in cpu_flags.split():
        return RepackDecision(False, f"this CPU has AMX ({AMX_FLAG}), whose repacked kernels crash llama.cpp as "
                                     "pinned here (llama-cpp-python 0.3.36, llama.cpp #20824); "
                                     "set SLOTQ_CPU_REPACK=on to force")
    return RepackDecision(True, "no AMX on this CPU; repacked AVX2/AVX-512/Arm kernels are faster "
                                "for Q4_0/Q4_K weights (SLOTQ_CPU_REPACK=off to disable)")


@functools.cache
def this_cpu_flags() -> str | None:
    """This machine's CPU flags: the first ``flags`` (x86) or ``Features`` (Arm) line of
    /proc/cpuinfo on Linux, ``""`` if it has neither; None elsewhere (macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:          # a sandbox without /proc
        return None


def parse_cpuinfo(text: str) -> str:
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return value.strip()
    return ""
