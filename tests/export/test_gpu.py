"""The GPU targets (docs/architecture.md, "GPU targets"): every target builds or refuses with one line; the three k3
kernels' OpenCL C runs on PoCL and their WGSL on lavapipe (validated by wgpu), matching the llvm build and eager;
WGSL limits are refused at compile time; the whole k3-tiny model runs on OpenCL kernel by kernel.

A test that needs a driver skips only where the driver cannot be opened (the reason is the skip message); .ci/run
installs both.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from k3compile.targets import TARGETS, resolve

from k3compile import device_check, devices
from k3compile.interface import ExportError
from tests.hardening import one_line_error, run

DRIVERS = ("opencl", "webgpu")


def _driver(name: str):
    try:
        return devices.driver(name)
    except devices.DeviceError as e:
        pytest.skip(str(e))


# ---- the word layout ------------------------------------------------------------------------------------------------

def test_gpu_words_follow_the_layout_definition_and_the_compile_path_packs_the_same():
    """docs/mx.md: code k of row r is nibble k % 8 of word [k / 8, r]; the scale of (block b, row r) is byte r % 4 of
    word [b, r / 4]. The test's packing, and passes/lower_k3_calls.py's Relax expressions compiled for llvm."""
    import tvm
    from tvm import relax

    from passes.lower_k3_calls import scale_words, words

    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (3, 12, 48), dtype=np.uint8)  # E=3, R=12 rows, C=96 elements
    scales = rng.integers(0, 256, (3, 12, 3), dtype=np.uint8)
    w, s = device_check.gpu_words(codes), device_check.gpu_scale_words(scales)
    for e, r, k in [(0, 0, 0), (1, 5, 17), (2, 11, 95), (1, 3, 64)]:
        byte = codes[e, r, k // 2]
        assert (int(w[e, k // 8, r]) >> (4 * (k % 8))) & 15 == (byte >> 4 if k % 2 else byte & 15)
    for e, r, b in [(0, 0, 0), (2, 7, 2), (1, 11, 1)]:
        assert (int(s[e, b, r // 4]) >> (8 * (r % 4))) & 255 == scales[e, r, b]

    bb = relax.BlockBuilder()
    c = relax.Var("c", relax.TensorType(codes.shape, "uint8"))
    sc = relax.Var("s", relax.TensorType(scales.shape, "uint8"))
    with bb.function("main", [c, sc]):
        out = bb.emit(relax.Tuple([bb.emit(words(c)), bb.emit(scale_words(sc))]))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(codes), tvm.runtime.tensor(scales))
    np.testing.assert_array_equal(got[0].numpy(), w)
    np.testing.assert_array_equal(got[1].numpy(), s)


# ---- the three kernels on the drivers -------------------------------------------------------------------------------
# Sizes that do not divide the 64-thread workgroups (24 state columns, 96 and 72 output columns), an expert slice at
# offset 3 with ids routed outside it, decode (one token) and prefill sizes, MXFP8 activations and float experts.

@pytest.mark.parametrize("device", DRIVERS)
def test_kda_kernel_on_the_device_matches_llvm_and_eager(device):
    dev = _driver(device)
    for batch, tokens in ((2, 11), (1, 1)):
        row = device_check.check_kda(resolve(device), 2, 16, 24, batch=batch, tokens=tokens, dev=dev)
        assert row.ok and row.launches == 1, row


@pytest.mark.parametrize("device", DRIVERS)
@pytest.mark.parametrize("case", [
    dict(mx=True, act_quant="none", tokens=5),
    dict(mx=True, act_quant="none", tokens=1),
    dict(mx=True, act_quant="e4m3", tokens=7),
    dict(mx=False, act_quant="none", tokens=5, activation="silu"),
])
def test_moe_kernels_on_the_device_match_llvm_and_eager(device, case):
    dev = _driver(device)
    row = device_check.check_moe(resolve(device), experts=4, inter=96, width=96, offset=3, dev=dev, **case)
    assert row.ok, row
    assert row.launches == (4 if case["act_quant"] != "none" else 2)


@pytest.mark.parametrize("device", DRIVERS)
@pytest.mark.parametrize("act_quant", ["none", "e5m2"])
def test_mxfp4_matmul_kernel_on_the_device_matches_llvm_and_eager(device, act_quant):
    dev = _driver(device)
    for rows in (5, 1):
        row = device_check.check_matmul(resolve(device), 96, 72, act_quant, rows=rows, dev=dev)
        assert row.ok, row


def test_a_wrong_kernel_is_caught():
    """The comparison can fail: a kernel given a different expert offset than its reference disagrees."""
    dev = _driver("opencl")
    from k3compile.kernels import gpu

    target = resolve("opencl")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    codes = rng.integers(0, 256, (1, 8, 32), dtype=np.uint8)
    scales = rng.integers(120, 130, (1, 8, 2), dtype=np.uint8)
    y, = devices.run(gpu.mxfp4_matmul_gpu_kernel(64, 8), target, [x, device_check.gpu_words(codes),
                                                                  device_check.gpu_scale_words(scales)],
                     [((3, 8), "float32")], dev)
    flipped = codes.copy()
    flipped[0, 0, 0] ^= 0x08  # one sign
    y2, = devices.run(gpu.mxfp4_matmul_gpu_kernel(64, 8), target, [x, device_check.gpu_words(flipped),
                                                                   device_check.gpu_scale_words(scales)],
                      [((3, 8), "float32")], dev)
    assert device_check.scaled_error([y2], [y]) > device_check.RTOL


def test_wgsl_validator_refuses_what_it_should():
    """The WGSL check is wgpu's own validator: an `array<u8>` shader is refused, naming the kernel."""
    dev = _driver("webgpu")
    import k3compile.targets.gpu as gpu_mod

    from k3compile.kernels.gpu import mxfp8_quant_gpu_kernel

    class Bad:  # a kernel whose source is TVM's uint8 WGSL (what the limits refuse before code generation)
        name = "bad"
        params = ()
        func = mxfp8_quant_gpu_kernel(32, "e4m3")  # (only its hash is read: the source is replaced)

    source = ("@group(0) @binding(0) var<storage, read_write> x : array<u8>;\n"
              "@compute @workgroup_size(1) fn bad() { x[0] = u8(1); }\n")
    original = gpu_mod.kernel_source
    gpu_mod.kernel_source = lambda kernel, target: source
    try:
        with pytest.raises(devices.DeviceError, match="WebGPU refused kernel bad"):
            dev.pipeline(Bad, resolve("webgpu"))
    finally:
        gpu_mod.kernel_source = original


# ---- limits refused at compile time ---------------------------------------------------------------------------------

def _module(func):
    import tvm

    return tvm.IRModule({"kernel": func.with_attr("global_symbol", "kernel")})


def test_webgpu_refuses_kernels_over_its_limits_at_compile_time():
    from k3compile.targets.gpu import check
    from tvm.script import tirx as T

    from k3compile.kernels import gpu

    webgpu = resolve("webgpu")
    with pytest.raises(ExportError, match="kernel 'kernel' uses workgroups of 512 threads; WGSL allows 256"):
        check(_module(gpu.kda_gpu_kernel(2, 16, 600, threads=512)), webgpu)
    # k3's expert slice in one binding: 896 experts x 3584 / 8 words x 2 x 1024 columns
    with pytest.raises(ExportError, match="binds W13 of .* MiB; WGSL devices guarantee 128 MiB"):
        check(_module(gpu.moe_up_gpu_kernel(896, 1024, 3584, 0, True, 4.0, 25.0)), webgpu)

    @T.prim_func(private=True)
    def bytes_in(x: T.Buffer((64,), "uint8"), y: T.Buffer((64,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in T.thread_binding(64, thread="threadIdx.x"):
            y[i] = T.Cast("float32", x[i])

    with pytest.raises(ExportError, match="uses uint8 .WGSL has no 8-, 16- or 64-bit integers"):
        check(_module(bytes_in), webgpu)
    check(_module(bytes_in), resolve("opencl"))  # OpenCL C has uchar

    @T.prim_func(private=True)
    def deep(x: T.Buffer((4, 4, 4), "float32"), y: T.Buffer((4, 4, 4), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for a in T.thread_binding(4, thread="blockIdx.z"):
            for b in T.thread_binding(4, thread="blockIdx.x"):
                for c in T.thread_binding(4, thread="threadIdx.x"):
                    y[a, b, c] = x[a, b, c]

    with pytest.raises(ExportError, match="uses blockIdx.z, which WGSL lacks"):
        check(_module(deep), webgpu)

    @T.prim_func(private=True)
    def unbound(x: T.Buffer((64,), "float32"), y: T.Buffer((64,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in range(64):
            y[i] = x[i]

    with pytest.raises(ExportError, match="has no thread binding"):
        check(_module(unbound), resolve("opencl"))


def test_webgpu_refuses_more_storage_buffers_than_a_kernel_may_bind():
    import tvm
    from k3compile.targets.gpu import check
    from tvm import te

    xs = [te.placeholder((64,), "float32", name=f"x{i}") for i in range(11)]
    y = te.compute((64,), lambda i: sum(x[i] for x in xs), name="y")
    func = te.create_prim_func([*xs, y])
    sch = tvm.s_tir.Schedule(func)
    (i,) = sch.get_loops(sch.get_sblock("y"))
    sch.bind(i, "threadIdx.x")
    func = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    with pytest.raises(ExportError, match="takes 12 storage buffers; WGSL allows 10 per kernel"):
        check(_module(func), resolve("webgpu"))


# ---- every target: k3-tiny built or refused; k3-small's kernels (shapes only) ---------------------------------------

EXPECTED = {  # target -> None (builds) or the refusal's words
    "opencl": None, "metal": None, "cuda": None,
    "webgpu": None,
    "rocm": "target 'rocm' needs a ROCm install",
    "vulkan": "target 'vulkan': this TVM build has no SPIR-V code generator",
}


def test_the_table_names_every_target():
    assert set(TARGETS) == {"llvm", *EXPECTED}


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_k3_tiny_builds_or_is_refused_with_one_line(tiny_export, tmp_path, target, request):
    import shutil

    from k3compile.backends.executor import DRIVERS as EXECUTORS

    folder = tiny_export[1]
    if target == "cuda" and shutil.which("nvcc") is None:
        one_line_error(run("compile", folder, "-o", tmp_path / "out", "--target", "cuda"), "needs nvcc")
        return
    if target in ("opencl", "webgpu"):  # built once per session (conftest.py), by the compile_export the CLI calls
        out = request.getfixturevalue(f"{target}_artifact")
    else:
        out = tmp_path / "out"
        r = run("compile", folder, "-o", out, "--target", target, "--quiet")
    if EXPECTED[target] is None:
        assert target in ("opencl", "webgpu") or r.exit_code == 0, r.output
        manifest = json.loads((out / "manifest.json").read_text())
        suffix = resolve(target).source[1]
        assert manifest["target"] == target and f"device{suffix}" in manifest["files"]
        source = (out / f"device{suffix}").read_text()
        assert "k3_kda_recurrence" in source and "k3_latent_moe_dispatch_mxfp4_up" in source
        assert "inff" not in source and "3.402823e+38" not in source  # constants written exactly
        r = run("generate", out, "--backend", "tvm", "--max-new-tokens", "1", "--json")
        if target in EXECUTORS:  # an artifact runs on its own target: the device's executor (test_executor.py)
            assert r.exit_code == 0 and json.loads(r.output)["backend"] == target, r.output
        else:
            one_line_error(r, f"no executor runs target '{target}' here")
    else:
        one_line_error(r, EXPECTED[target])
        assert not out.exists()


def test_tensor_intrinsics_import_leaves_inspect_as_it_was():
    """The Metal build's import of TVM's tensor intrinsics (targets/gpu.py: import_tensor_intrinsics), in a fresh
    process: the module and Metal's intrinsics are there afterwards, inspect.getmodule is the standard one again."""
    import subprocess
    import sys

    code = ("import inspect, sys; plain = inspect.getmodule\n"
            "from k3compile.targets.gpu import import_tensor_intrinsics\n"
            "import_tensor_intrinsics()\n"
            "assert inspect.getmodule is plain and 'tvm.s_tir.tensor_intrin' in sys.modules\n"
            "from tvm.s_tir.tensor_intrin.metal import get_simdgroup_intrin_group\n"
            "get_simdgroup_intrin_group('shared', 'global', 'float32')\n"
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.parametrize("target", ["opencl", "webgpu", "metal", "cuda"])
def test_k3_small_kernels_build_for_every_gpu_target(target):
    """k3-small's k3 kernels at its sizes (shapes only: no weights) pass the target's limits and generate source."""
    import shutil

    import tvm
    from k3compile.targets.gpu import check, kernel_source

    from k3compile.kernels import gpu

    if target == "cuda" and shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH: the cuda target refuses (tested above)")
    tgt = resolve(target)
    funcs = {"kda": gpu.kda_gpu_kernel(8, 128, 128), "up": gpu.moe_up_gpu_kernel(32, 512, 512, 0, True, 4.0, 25.0),
             "down": gpu.moe_down_gpu_kernel(32, 512, 512, 0), "quant": gpu.mxfp8_quant_gpu_kernel(512, "e4m3"),
             "matmul": gpu.mxfp4_matmul_gpu_kernel(1024, 2816)}
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
    for name, low in check(mod, tgt).items():
        assert low.kernels and all(kernel_source(k, tgt.tvm()) for k in low.kernels), name


# ---- the whole model on OpenCL, and verify --kernels ----------------------------------------------------------------

def test_verify_device_runs_k3_tiny_on_opencl_kernel_by_kernel(opencl_artifact):
    """The artifact's whole model on PoCL (prefill of a left-padded batch, one decode step) against eager, and its
    k3 kernels against the llvm build and eager."""
    out = opencl_artifact
    r = run("verify", out, "--kernels", "opencl", "--decode-steps", "1", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["ok"] and doc["whole_model_refused"] is None
    assert {k["kernel"].split()[0] for k in doc["kernels"]} == {"k3.kda_recurrence", "k3.latent_moe_dispatch"}
    assert {r["phase"] for r in doc["rows"]} == {"prefill", "decode 1"}
    assert all(r["backend"] == "opencl-device" and r["max_abs"] <= 1e-4 for r in doc["rows"])
    one_line_error(run("verify", out, "--kernels", "webgpu"), "compiled for opencl, not webgpu")


def test_verify_device_on_an_export_runs_the_webgpu_kernels_and_the_whole_model(tiny_export):
    """The k3 kernels on lavapipe against the llvm build and eager, then the whole model kernel by kernel (phase 4
    narrows its int64 for WGSL) against eager."""
    _driver("webgpu")
    r = run("verify", tiny_export[1], "--kernels", "webgpu", "--decode-steps", "0", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["ok"] and len(doc["kernels"]) == 4 and doc["whole_model_refused"] is None
    assert doc["rows"] and all(row["max_abs"] <= 1e-4 for row in doc["rows"])


def test_a_k3_call_left_without_a_gpu_kernel_is_refused():
    """A k3 call no kernel covers is refused, naming the op (a written artifact never calls the host reference)."""
    from tvm import relax

    from k3compile.compile import _no_extern_calls

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 48), "float32"))
    with bb.function("main", [x]):
        y = bb.emit(relax.call_dps_packed("k3.mxfp4_matmul", [x], out_ty=relax.TensorType((4, 8), "float32")))
        bb.emit_func_output(y)
    with pytest.raises(ExportError, match="k3.mxfp4_matmul has no opencl kernel"):
        _no_extern_calls(bb.get(), resolve("opencl"))
