"""CPU weight repacking (SLOTQ_CPU_REPACK): the auto decision from CPU flags, and the engine with
repacking on and off. No AMX hardware is needed for the decision; the engine tests run here."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from pydantic import ValidationError

from slotq.engine import ChatMessage, CpuRepack, EngineConfig, GenerationRequest, SamplingParams, llama_model
from slotq.engine.cpu_features import AMX_FLAG, decide_repack, parse_cpuinfo, this_cpu_flags
from slotq.engine.llama_model import LlamaModel
from tests.support.engine import greedy, run_one, running_engine
from tests.support.tiny_model import TINY_SCALE, TINY_SEED, write_tiny_llama

# /proc/cpuinfo flags of three real CPUs (trimmed of flags that play no part here).
SAPPHIRE_RAPIDS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 "
                   "ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid "
                   "tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx "
                   "f16c rdrand hypervisor lahf_lm abm 3dnowprefetch fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid rtm "
                   "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl "
                   "xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke "
                   "waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid "
                   "cldemote movdiri movdir64b serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 "
                   "arch_capabilities")
ICE_LAKE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht "
            "syscall nx pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes "
            "xsave avx f16c rdrand hypervisor avx2 bmi1 bmi2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl "
            "avx512vbmi avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq")
HASWELL = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht "
           "syscall nx pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes "
           "xsave avx f16c rdrand hypervisor lahf_lm abm avx2 bmi1 bmi2 erms invpcid")

HAS_AMX = AMX_FLAG in (this_cpu_flags() or "").split()
not_on_amx = pytest.mark.skipif(HAS_AMX, reason="repacking on crashes llama.cpp on AMX CPUs (llama.cpp #20824)")


# ----------------------------------------------------------------------------- the decision
@pytest.mark.parametrize(("flags", "repack", "reason_has"), [
    (SAPPHIRE_RAPIDS, False, "AMX (amx_tile)"),
    (ICE_LAKE, True, "no AMX"),
    (HASWELL, True, "no AMX"),
    ("", True, "no AMX"),
    (None, True, "does not list CPU flags"),
])
def test_auto_turns_repacking_off_only_with_amx(flags: str | None, repack: bool, reason_has: str) -> None:
    decision = decide_repack(CpuRepack.AUTO, flags)
    assert decision.repack is repack
    assert reason_has in decision.reason
    assert decision.describe().startswith(f"CPU weight repacking {'on' if repack else 'off'}: ")


def test_amx_decision_names_the_issue_and_the_override() -> None:
    reason = decide_repack(CpuRepack.AUTO, SAPPHIRE_RAPIDS).reason
    assert "#20824" in reason and "SLOTQ_CPU_REPACK=on" in reason


def test_amx_tile_must_be_a_whole_flag() -> None:
    assert decide_repack(CpuRepack.AUTO, "avx2 not_amx_tile_really").repack


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, ICE_LAKE, HASWELL, "", None])
def test_explicit_on_and_off_ignore_the_flags(flags: str | None) -> None:
    assert decide_repack(CpuRepack.ON, flags).repack is True
    assert decide_repack(CpuRepack.OFF, flags).repack is False


def test_cpuinfo_parsing() -> None:
    x86 = f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {SAPPHIRE_RAPIDS}\n\nprocessor\t: 1\nflags\t\t: x\n"
    assert parse_cpuinfo(x86) == SAPPHIRE_RAPIDS
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics i8mm\n"
    assert parse_cpuinfo(arm).endswith("i8mm")
    assert parse_cpuinfo("processor\t: 0\n") == ""


def test_config_refuses_an_unknown_mode_naming_the_field(tiny_model_path: Path) -> None:
    with pytest.raises(ValidationError, match="cpu_repack"):
        EngineConfig(model_path=tiny_model_path, cpu_repack="maybe")
    assert EngineConfig(model_path=tiny_model_path).cpu_repack is CpuRepack.AUTO


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="session")
def tiny_q4_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Q4_0 matrices: a type llama.cpp repacks on AVX2/AVX-512 (F32 it never does)."""
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-q4_0.gguf", seed=TINY_SEED, scale=TINY_SCALE,
                            quant=gguf.GGMLQuantizationType.Q4_0)


@pytest.fixture
def llama_cpp_log(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """llama.cpp's own log (what SLOTQ_LLAMA_VERBOSE=1 shows), captured from stderr."""
    llama_model._init_backend()          # it sets the log level once; set ours after it
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield capsys
    finally:
        logger.setLevel(level)


@not_on_amx
@pytest.mark.skipif("avx2" not in (this_cpu_flags() or "").split(), reason="llama.cpp repacks Q4_0 for AVX2 and up")
def test_the_setting_reaches_llama_cpp(tiny_q4_model_path: Path, llama_cpp_log: pytest.CaptureFixture[str]) -> None:
    loaded = {}
    for mode in (CpuRepack.ON, CpuRepack.OFF):
        llama_cpp_log.readouterr()
        LlamaModel(EngineConfig(model_path=tiny_q4_model_path, slots=1, ctx=128, threads=1, cpu_repack=mode)).close()
        loaded[mode] = llama_cpp_log.readouterr().err
    assert "CPU_REPACK model buffer" in loaded[CpuRepack.ON]
    assert "CPU_REPACK" not in loaded[CpuRepack.OFF] and "model buffer" in loaded[CpuRepack.OFF]


@not_on_amx
async def test_greedy_output_is_the_same_with_repacking_on_and_off(tiny_q4_model_path: Path) -> None:
    prompts = [("hello world", 24), ("the quick brown fox", 16), ("abc", 32)]
    outputs = {}
    for mode in (CpuRepack.ON, CpuRepack.OFF):
        async with running_engine(tiny_q4_model_path, slots=4, cpu_repack=mode) as engine:
            outputs[mode] = [await run_one(engine, greedy(p, n)) for p, n in prompts]
    for (prompt, n), (on_text, on_tokens, _), (off_text, off_tokens, off_fin) in zip(
            prompts, outputs[CpuRepack.ON], outputs[CpuRepack.OFF]):
        assert len(off_tokens) == n and off_fin[0].usage.completion_tokens == n
        assert off_tokens == on_tokens, f"{prompt!r}: repacked and plain kernels disagree"
        assert off_text == on_text
    assert len({tuple(t) for _, t, _ in outputs[CpuRepack.OFF]}) == len(prompts)    # not degenerate


async def test_engine_with_repacking_off_on_the_f32_tiny_model(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2, cpu_repack=CpuRepack.OFF) as engine:
        text, tokens, fin = await run_one(engine, greedy("hello world", 20))
    assert len(tokens) == 20 and text and fin[0].usage.completion_tokens == 20


def test_the_decision_is_logged_once_with_its_reason(tiny_model_path: Path, caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_model, "_repack_logged", set())
    with caplog.at_level(logging.INFO, logger="slotq.engine.llama_model"):
        for _ in range(2):
            LlamaModel(EngineConfig(model_path=tiny_model_path, slots=1, ctx=128, threads=1)).close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU weight repacking")]
    assert lines == [decide_repack(CpuRepack.AUTO, this_cpu_flags()).describe()]


@pytest.mark.real_model
async def test_real_model_answers_with_repacking_off(real_model_path: Path) -> None:
    async with running_engine(real_model_path, slots=2, cpu_repack=CpuRepack.OFF) as engine:
        request = GenerationRequest(
            messages=[ChatMessage(role="user", content="What is the capital of France? Answer in one word.")],
            max_tokens=24, sampling=SamplingParams(temperature=0.0))
        text, _, _ = await run_one(engine, request)
    assert "Paris" in text, text
