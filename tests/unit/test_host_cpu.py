"""The llvm target's CPU fields (targets/__init__.py: host_cpu): LLVM's name for the CPU, corrected by the CPU's own
flags where the two disagree (docs/toolchain.md, "Apache TVM 0.27"). The machines are stand-ins: LLVM's CPU name and the
/proc/cpuinfo flags are replaced; what LLVM says each name promises is LLVM's own answer."""

from __future__ import annotations

import pytest

tvm = pytest.importorskip("tvm")

import k3compile.targets as targets  # noqa: E402
from k3compile.targets import Target, host_cpu  # noqa: E402
from k3compile.targets.llvm import BF16_GEMM_FEATURE, PANEL, schedule_func  # noqa: E402

AVX512 = "fpu sse sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"


def _machine(monkeypatch, cpu: str, flags: str | None) -> Target:
    """The llvm target as k3compile makes it on a CPU LLVM names `cpu` whose /proc/cpuinfo lists `flags` (None: no
    /proc/cpuinfo)."""
    from tvm.target import codegen

    monkeypatch.setattr(codegen, "llvm_get_system_cpu", lambda: cpu)
    monkeypatch.setattr(targets, "_cpuinfo", lambda: None if flags is None else {"flags": flags})
    return Target("llvm", "llvm", "tiles", schedule_func, PANEL, host_cpu())


def _promises(cpu: str, feature: str) -> bool:
    from tvm.target import codegen

    return feature in {str(f) for f in codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm",
                                                                                          "mcpu": cpu}))}


def test_a_cpu_reported_as_another_model_gets_the_bf16_its_flags_list(monkeypatch):
    """An AVX512_BF16 Xeon that a virtual machine reports as family 6 model 167 (LLVM: rocketlake, no AVX512_BF16):
    its flags turn the feature on, so `--matmul-precision bf16` is not refused there."""
    assert not _promises("rocketlake", BF16_GEMM_FEATURE)
    target = _machine(monkeypatch, "rocketlake", AVX512 + " avx512_bf16 amx_bf16 amx_tile")
    assert ("mattr", (f"+{BF16_GEMM_FEATURE}",)) in host_cpu()
    assert target.has_feature(BF16_GEMM_FEATURE)
    assert target.with_matmul_precision("bf16").matmul_precision == "bf16"
    # without the flag the model's answer stands, and bf16 is refused with one line
    target = _machine(monkeypatch, "rocketlake", AVX512)
    assert host_cpu() == (("mcpu", "rocketlake"),)
    assert not target.has_feature(BF16_GEMM_FEATURE)
    with pytest.raises(targets.ExportError, match="AVX512_BF16"):
        target.with_matmul_precision("bf16")


def test_a_feature_the_model_promises_and_the_flags_lack_is_turned_off(monkeypatch):
    """A Sapphire Rapids whose hypervisor hides AVX512_BF16: code built with it would stop with "illegal
    instruction", so it is off; with AVX-512 hidden altogether every AVX-512 feature is, and none is turned on."""
    assert _promises("sapphirerapids", BF16_GEMM_FEATURE)
    target = _machine(monkeypatch, "sapphirerapids", AVX512)
    assert ("mattr", (f"-{BF16_GEMM_FEATURE}",)) in host_cpu()
    assert not target.has_feature(BF16_GEMM_FEATURE) and target.has_feature("avx512bw")
    target = _machine(monkeypatch, "sapphirerapids", "fpu sse sse2 avx avx2 fma avx512_bf16")
    assert not any(target.has_feature(f) for f in ("avx512f", "avx512bw", BF16_GEMM_FEATURE))
    assert not any(f.startswith("+") for f in dict(host_cpu()).get("mattr", ()))


def test_a_model_and_flags_that_agree_leave_the_name_alone(monkeypatch):
    assert _machine(monkeypatch, "znver4", AVX512 + " avx512_bf16").has_feature(BF16_GEMM_FEATURE)
    assert host_cpu() == (("mcpu", "znver4"),)
    assert _machine(monkeypatch, "haswell", "fpu sse sse2 avx avx2 fma") and host_cpu() == (("mcpu", "haswell"),)
    _machine(monkeypatch, "znver4", None)  # no /proc/cpuinfo: LLVM's name is all there is
    assert host_cpu() == (("mcpu", "znver4"),)
