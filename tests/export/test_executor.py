"""GPU artifacts run on their device from their launch plan (k3compile/executors/, backends/executor.py;
docs/architecture.md, "GPU artifacts and their executors"): k3-tiny compiled for OpenCL (run on PoCL) and for WebGPU
(run on Mesa's lavapipe through wgpu, after phase 4 narrowed its integers), with the decode state kept in device
memory, equals eager in every output and gives eager's greedy tokens; loading it imports no TVM; an edited plan, a
missing device or driver, a weight over the device's limit is one line.

Each artifact is built once per session (conftest.py's opencl_artifact and webgpu_artifact, ~1 min each)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hardening import one_line_error, run

from k3compile.backends.eager import EagerBackend
from k3compile.generate import generate
from k3compile.modes import Forms
from k3compile.verify import compare

PROMPTS = [[5, 17, 42, 9], [3, 77], [60, 4, 8]]  # a left-padded batch of three
# fp32 on both sides; the device kernels sum blocks in the CPU kernels' order but the standard ops are dlight's
# (another reduction order): observed ~1e-6 on values of order 1
ATOL = 1e-4
TARGETS = ("opencl", "webgpu")
DEVICE_NAME = {"opencl": "OpenCL 0", "webgpu": "WebGPU "}


@pytest.fixture(params=TARGETS)
def gpu_artifact(request):
    """(target, the k3-tiny artifact built for it once per session)."""
    return request.param, request.getfixturevalue(f"{request.param}_artifact")


def test_a_gpu_artifact_runs_on_its_device_and_equals_eager(tiny_export, gpu_artifact):
    from k3compile.backends.executor import ExecutorBackend

    target, artifact = gpu_artifact
    model = tiny_export[0]
    host = ExecutorBackend(artifact, host=True)
    assert host.name == target
    rows = compare(EagerBackend(model, Forms.exported()), host, decode_steps=3, prompts=PROMPTS)
    bad = [r for r in rows if not r["max_abs"] <= ATOL]  # every output: logits and each layer's state
    assert not bad, bad[:3]
    want = generate(EagerBackend(model), PROMPTS, 32, eos_token_id=model.config.eos_token_id).tokens
    device = ExecutorBackend(artifact)  # the state stays on the device, the last logits come back
    assert generate(device, PROMPTS, 32, eos_token_id=model.config.eos_token_id).tokens == want


def test_loading_a_gpu_artifact_imports_no_tvm(gpu_artifact):
    """Nothing is lowered at load: the plan is data, the kernels are source (the device's driver compiles them). The
    whole run, in a fresh process, never imports TVM."""
    target, artifact = gpu_artifact
    code = ("import json, sys; from k3compile.backends.executor import ExecutorBackend; "
            "from k3compile.generate import generate; "
            f"b = ExecutorBackend({str(artifact)!r}); t = generate(b, [[5, 17, 42, 9]], 4).tokens; "
            "print(json.dumps({'tvm': 'tvm' in sys.modules, 'tokens': t, 'device': b.describe()}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["tvm"] is False and len(doc["tokens"][0]) == 4 and DEVICE_NAME[target] in doc["device"]


def test_generate_runs_a_gpu_artifact_and_names_its_device(gpu_artifact, tiny_export):
    target, artifact = gpu_artifact
    r = run("generate", artifact, *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))],
            "--max-new-tokens", "8", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.splitlines()[-1])
    model = tiny_export[0]
    assert doc["tokens"] == generate(EagerBackend(model), PROMPTS, 8, eos_token_id=model.config.eos_token_id).tokens
    assert doc["backend"] == target and doc["device"].startswith(DEVICE_NAME[target])


def test_an_edited_plan_a_missing_device_or_driver_is_one_line(opencl_artifact, tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "art"
    shutil.copytree(opencl_artifact, copy)
    plan = json.loads((copy / "launch.json").read_text())
    plan["main"]["bindings"] = plan["main"]["bindings"][1:]
    (copy / "launch.json").write_text(json.dumps(plan))
    one_line_error(run("generate", copy), "launch.json: its sha256 differs")
    shutil.copy(opencl_artifact / "launch.json", copy / "launch.json")
    doc = json.loads((copy / "manifest.json").read_text())
    doc["params"][0], doc["params"][1] = doc["params"][1], doc["params"][0]  # no file touched, hashes valid
    (copy / "manifest.json").write_text(json.dumps(doc))
    one_line_error(run("generate", copy), "not the weights its launch plan was built for")
    one_line_error(run("generate", opencl_artifact, "--device", "7"), "OpenCL device 7 does not exist")
    monkeypatch.setenv("OCL_ICD_VENDORS", str(tmp_path / "none"))  # the ICD loader finds no platform
    res = subprocess.run([sys.executable, "-m", "k3compile.cli", "generate", str(opencl_artifact)],
                         capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                           "OCL_ICD_VENDORS": str(tmp_path / "none")})
    assert res.returncode == 1 and res.stderr.count("Error:") == 1 and "OpenCL" in res.stderr, res.stderr[-2000:]


def test_verify_runs_a_gpu_artifact_on_its_device(opencl_artifact):
    """`verify OUT` compares the artifact's own executable with eager: for a GPU target, on its device."""
    r = run("verify", opencl_artifact, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["rows"]
    mine = [row for row in rows if row["backend"] == "opencl"]
    assert mine and all(row["max_abs"] <= ATOL for row in mine)
    assert {row["backend"] for row in rows} == {"onnxruntime", "opencl"}
    # --device picks the artifact's device: one that does not exist is one line, before anything is compared
    one_line_error(run("verify", opencl_artifact, "--device", "99"), "OpenCL device 99 does not exist")
    one_line_error(run("verify", opencl_artifact, "--kernels", "opencl", "--device", "0"), "--device picks")


def test_users_helper_runs_a_gpu_artifact_on_its_device(opencl_artifact):
    """k3compile.testing.assert_matches_eager on an OpenCL artifact compares it, run on its device, with eager."""
    from k3compile.testing import assert_matches_eager, open_backend

    assert open_backend(opencl_artifact).name == "opencl"
    rows = assert_matches_eager(opencl_artifact, prompts=PROMPTS, atol=ATOL, decode_steps=1, new_tokens=4)
    assert len(rows) == 2 * (1 + 2 * 7)  # 2 phases x (logits + two states per layer)


def test_a_weight_over_the_devices_limit_or_a_full_device_is_one_line(opencl_artifact, monkeypatch):
    """A device whose per-allocation limit is below the largest weight (PoCL's is GBs: the limit it reports is set
    low after it opens), and one whose allocations fail (pyopencl's MemoryError, as a full device raises it): one
    line each, naming the limit or the allocation; nothing is written into the artifact."""
    import pyopencl as cl

    from k3compile.executors import opencl

    before = sorted((p.name, p.stat().st_mtime_ns) for p in opencl_artifact.iterdir())
    real_init = opencl.OpenCLDriver.__init__

    def small(self, *a, **kw):
        real_init(self, *a, **kw)
        self.max_alloc = 4096

    monkeypatch.setattr(opencl.OpenCLDriver, "__init__", small)
    one_line_error(run("generate", opencl_artifact), "over this OpenCL device's 4.0 KiB per allocation")
    monkeypatch.setattr(opencl.OpenCLDriver, "__init__", real_init)

    def full(*a, **kw):
        raise cl.MemoryError("clCreateBuffer", cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE, "out of device memory")

    monkeypatch.setattr(cl, "Buffer", full)
    one_line_error(run("generate", opencl_artifact), "OpenCL: cannot allocate")
    monkeypatch.setenv("K3COMPILE_OPENCL_DEVICE", "x1")
    one_line_error(run("generate", opencl_artifact), "expected a device index")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in opencl_artifact.iterdir()) == before


def test_webgpu_bad_adapter_index_and_a_weight_over_the_binding_limit_are_one_line(webgpu_artifact, monkeypatch):
    """An adapter index that does not exist (--device, and a malformed $K3COMPILE_WEBGPU_ADAPTER), and an adapter
    whose binding limit is below the largest weight (lavapipe's is 128 MiB: set low after it opens): one line each;
    nothing is written into the artifact."""
    from k3compile.executors import webgpu

    before = sorted((p.name, p.stat().st_mtime_ns) for p in webgpu_artifact.iterdir())
    one_line_error(run("generate", webgpu_artifact, "--device", "9"), "WebGPU adapter 9 does not exist")
    monkeypatch.setenv("K3COMPILE_WEBGPU_ADAPTER", "first")
    one_line_error(run("generate", webgpu_artifact), "expected an adapter index")
    monkeypatch.delenv("K3COMPILE_WEBGPU_ADAPTER")
    real_init = webgpu.WebGPUDriver.__init__

    def small(self, *a, **kw):
        real_init(self, *a, **kw)
        self.max_alloc = 4096

    monkeypatch.setattr(webgpu.WebGPUDriver, "__init__", small)
    one_line_error(run("generate", webgpu_artifact), "over this WebGPU adapter's 4.0 KiB per binding")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in webgpu_artifact.iterdir()) == before


def test_a_webgpu_artifact_takes_no_int64_and_its_plan_and_kernels_are_hashed(webgpu_artifact):
    """WGSL has no 64-bit integers: phase 4 narrowed main's ids, mask and index tensors (docs/architecture.md,
    "GPU targets"); the manifest's sha256s cover the launch plan, its constants and the WGSL."""
    plan = json.loads((webgpu_artifact / "launch.json").read_text())
    dtypes = {p["dtype"] for p in plan["main"]["params"]}
    dtypes |= {r["dtype"] for b in plan["main"]["bindings"] for r in b.get("results", [])}
    assert not dtypes & {"int64", "bool"} and [p["dtype"] for p in plan["main"]["params"][:2]] == ["int32", "int32"]
    source = (webgpu_artifact / "device.wgsl").read_text()
    assert "array<i8>" not in source and "i64" not in source
    files = json.loads((webgpu_artifact / "manifest.json").read_text())["files"]
    assert {"launch.json", "constants.safetensors", "device.wgsl"} <= set(files)


def test_a_webgpu_grid_wider_than_the_adapter_allows_is_folded_over_z(tiny_export, webgpu_artifact, monkeypatch):
    """An 800-token prefill on a driver that allows 1,024 workgroups per dimension (as an adapter with that limit
    would; lavapipe's is WebGPU's 65,535, which k3-tiny's widest kernel passes only from ~13k tokens since the KDA
    short convolution runs as elementwise products: 4,000 workgroups along x at 800 tokens): the driver folds the
    wider grids over z as TVM's WGSL expects (blockIdx.z · gridDim.x + blockIdx.x, guarded by packGridDimX), and
    every output still equals eager's within ATOL."""
    from k3compile.backends.executor import ExecutorBackend
    from k3compile.executors import webgpu

    limit = 1024
    widest = []
    real = webgpu.WebGPUDriver.dispatch

    def watch(self, key, pipeline, iface, layout, names, handles, values, grid):
        self.max_workgroups = min(self.max_workgroups, limit)
        widest.append(grid[0])
        return real(self, key, pipeline, iface, layout, names, handles, values, grid)

    monkeypatch.setattr(webgpu.WebGPUDriver, "dispatch", watch)
    prompt = [(i * 7) % 250 + 3 for i in range(800)]
    rows = compare(EagerBackend(tiny_export[0], Forms.exported()), ExecutorBackend(webgpu_artifact, host=True),
                   decode_steps=1, prompts=[prompt])
    assert max(widest) > limit
    assert all(r["max_abs"] <= ATOL for r in rows), [r for r in rows if not r["max_abs"] <= ATOL][:3]
