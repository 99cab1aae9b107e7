"""Run the CUDA C that `--target cuda` generates for the three k3 kernels on a real NVIDIA GPU, without a TVM CUDA
runtime: record here, replay there with CuPy.

    python examples/cuda_kernels_on_a_gpu.py record DIR     # here: sources, launches, inputs, OpenCL outputs
    python examples/cuda_kernels_on_a_gpu.py replay DIR     # on the GPU machine (numpy + cupy only)

`record` lowers each kernel for the cuda target (k3compile.targets.gpu.lower: the same TIR pipeline the compile
path uses), writes every launch's CUDA source, grid, workgroup and scalar arguments, the seeded inputs and the
outputs of the same kernel's OpenCL build run on this machine's OpenCL driver (which the tests hold to the llvm build
and eager). `replay` compiles each source with NVRTC, launches it as recorded and prints each output's error
relative to its scale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def record(folder: Path) -> None:
    import tvm
    from k3compile.targets import resolve
    from k3compile.targets.gpu import kernel_source, lower

    from k3compile import device_check as dc
    from k3compile import devices
    from k3compile.kernels import gpu

    folder.mkdir(parents=True, exist_ok=True)
    ocl, cuda = resolve("opencl"), resolve("cuda")
    rng = np.random.default_rng(0)
    cases = []

    def add(name, func, inputs, outs):
        expected = devices.run(func, ocl, inputs, outs)
        low = lower(tvm.IRModule({name: func.with_attr("global_symbol", name)}), cuda)[name]
        sizes = {dim.name: n for p, a in zip(func.params, inputs) for dim, n in zip(p.shape, np.shape(a))
                 if hasattr(dim, "name")}
        launches = [{"name": launch.kernel.name, "source": kernel_source(launch.kernel, cuda.tvm()),
                     "buffers": list(launch.buffers), "grid": list(launch.grid), "block": list(launch.block),
                     "scalars": [[v, p.dtype] for p, v in zip([p for p in launch.kernel.params if not p.buffer],
                                                              launch.scalars)]}
                    for launch in low.launches(sizes)]
        np.savez(folder / f"{name}.npz", **{f"in{i}": a for i, a in enumerate(inputs)},
                 **{f"exp{i}": e for i, e in enumerate(expected)})
        cases.append({"name": name, "n_in": len(inputs), "outs": [[list(s), d] for s, d in outs],
                      "launches": launches})
        return expected

    k = rng.standard_normal((2, 11, 2, 16)).astype(np.float32)
    kda = [(rng.standard_normal((2, 11, 2, 16)) / 4).astype(np.float32), k / np.linalg.norm(k, axis=-1, keepdims=True),
           rng.standard_normal((2, 11, 2, 24)).astype(np.float32),
           -rng.exponential(0.3, (2, 11, 2, 16)).astype(np.float32), rng.random((2, 11, 2)).astype(np.float32),
           rng.standard_normal((2, 2, 16, 24)).astype(np.float32)]
    add("kda", gpu.kda_gpu_kernel(2, 16, 24), kda, [((2, 11, 2, 24), "float32"), ((2, 2, 16, 24), "float32")])
    experts, inter, width, offset, tokens, top_k = 4, 96, 96, 3, 5, 3
    z = rng.standard_normal((tokens, width)).astype(np.float32)
    ids = rng.integers(1, 9, (tokens, top_k)).astype(np.int32)
    w = rng.random((tokens, top_k)).astype(np.float32)
    w13 = dc.gpu_words(rng.integers(0, 256, (experts, 2 * inter, width // 2), dtype=np.uint8))
    s13 = dc.gpu_scale_words(rng.integers(119, 136, (experts, 2 * inter, width // 32), dtype=np.uint8))
    w2 = dc.gpu_words(rng.integers(0, 256, (experts, width, inter // 2), dtype=np.uint8))
    s2 = dc.gpu_scale_words(rng.integers(119, 136, (experts, width, inter // 32), dtype=np.uint8))
    zq, = add("quant", gpu.mxfp8_quant_gpu_kernel(width, "e4m3"), [z], [((tokens, width), "float32")])
    h, = add("moe_up", gpu.moe_up_gpu_kernel(experts, inter, width, offset, True, 4.0, 25.0), [zq, ids, w13, s13],
             [((tokens, top_k, inter), "float32")])
    add("moe_down", gpu.moe_down_gpu_kernel(experts, inter, width, offset), [h, ids, w, w2, s2],
        [((tokens, width), "float32")])
    add("matmul", gpu.mxfp4_matmul_gpu_kernel(96, 72),
        [rng.standard_normal((5, 96)).astype(np.float32),
         dc.gpu_words(rng.integers(0, 256, (1, 72, 48), dtype=np.uint8)),
         dc.gpu_scale_words(rng.integers(119, 136, (1, 72, 3), dtype=np.uint8))], [((5, 72), "float32")])
    (folder / "cases.json").write_text(json.dumps(cases))
    print(f"recorded {len(cases)} kernels in {folder}")


def replay(folder: Path) -> int:
    import cupy as cp

    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    ok = True
    for case in json.loads((folder / "cases.json").read_text()):
        data = np.load(folder / f"{case['name']}.npz")
        bufs = [cp.asarray(data[f"in{i}"]) for i in range(case["n_in"])]
        bufs += [cp.zeros(tuple(s), d) for s, d in case["outs"]]
        for launch in case["launches"]:
            fn = cp.RawModule(code=launch["source"], options=("--std=c++17",)).get_function(launch["name"])
            scalars = [np.dtype(d).type(v) for v, d in launch["scalars"]]
            fn(tuple(launch["grid"]), tuple(launch["block"]), tuple([bufs[b] for b in launch["buffers"]] + scalars))
        cp.cuda.runtime.deviceSynchronize()
        for i in range(len(case["outs"])):
            got, exp = cp.asnumpy(bufs[case["n_in"] + i]), data[f"exp{i}"]
            err = float(np.abs(got - exp).max() / max(float(np.abs(exp).max()), 1e-30))
            ok &= err <= 1e-5  # the tests' bound (k3compile/device_check.py: relative to the output's scale)
            print(f"{case['name']} output {i}: {len(case['launches'])} launch(es), error vs OpenCL {err:.2e}")
    print("all match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "replay"):
        sys.exit(__doc__)
    sys.exit(record(Path(sys.argv[2])) if sys.argv[1] == "record" else replay(Path(sys.argv[2])))
