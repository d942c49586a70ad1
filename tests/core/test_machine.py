"""The machine record every figure names: the CPU class from /proc/cpuinfo's flags, and the AVX2 emulation."""

from specdraft.core.machine import AVX2_EMULATION, avx2_emulated, cpu_class, cpu_flags, describe, machine

CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nflags\t: other\n"


def test_the_class_is_the_widest_unit_listed():
    assert cpu_flags(CPUINFO) == {"fpu", "sse", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_class({"avx2", "avx512f", "avx512_bf16", "amx_tile"}) == "amx"
    assert cpu_class({"avx2", "avx512f", "avx512_bf16"}) == "avx512-bf16"
    assert cpu_class({"avx2", "avx512f"}) == "avx512"
    assert cpu_class({"avx2"}) == "avx2"
    assert cpu_class(set()) == "other"


def test_the_emulation_is_on_only_with_every_variable(monkeypatch):
    for key, value in AVX2_EMULATION.items():
        monkeypatch.setenv(key, value)
    assert avx2_emulated() and machine()["cpu_class"] == "avx2"
    assert "AVX2 emulated on" in describe(machine())
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    assert not avx2_emulated() and machine()["cpu_class"] == machine()["cpu_class_native"]
