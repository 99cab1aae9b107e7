"""The k3 kernels of a GPU target executed here and compared (docs/architecture.md, "GPU targets"): each kernel's
device code, run by k3compile/devices.py, against the llvm build of the same op (the CPU kernel, written apart) and
the eager op (torch), on the same seeded inputs. What `k3compile verify OUT --device D` prints per kernel, and what
the tests assert on shapes chosen not to divide the workgroups.

Inputs are drawn per op: q̂, k̂, v normal (scaled so the state stays O(1)), log-decays g <= 0, β in [0, 1); z
normal, expert ids over twice the expert slice (so slots outside the slice, which weigh zero, occur), routing weights
in [0, 1), MXFP4 codes of every value and E8M0 scales over 2^-8 .. 2^8. Each backend gets them in its own layout:
the op's packed arrays for eager, their column tiles (kernels/moe.py: `expert_tiles`) for the CPU MoE kernel and
transposes ("kn") for the CPU matmul, uint32 words for the GPU kernel
(`gpu_words`: written here from the layout's definition in docs/mx.md, apart from the compile path's Relax version).

The error of a kernel is max |device − reference| / max |reference| over its outputs: fp32 sums over 32 to thousands
of terms taken in another order (or with fused multiply-adds) differ by ulps of the terms, not of a result that may
cancel to near 0, so the error is measured against the output's scale; RTOL = 1e-5 is the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RTOL = 1e-5  # module docstring: errors are relative to the output's scale


@dataclass(frozen=True)
class Row:
    kernel: str              # the op and its sizes
    shape: str               # the inputs' leading sizes (tokens, batch)
    launches: int            # device kernel launches
    vs_llvm: float           # scaled error against the llvm build
    vs_eager: float          # scaled error against the eager op

    @property
    def ok(self) -> bool:
        return self.vs_llvm <= RTOL and self.vs_eager <= RTOL  # NaN is not ok

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "shape": self.shape, "launches": self.launches, "vs_llvm": self.vs_llvm,
                "vs_eager": self.vs_eager, "ok": self.ok}


def scaled_error(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    worst = 0.0
    for g, r in zip(got, ref):
        r = np.asarray(r, np.float64)
        scale = max(float(np.abs(r).max()) if r.size else 0.0, 1e-30)
        err = float(np.abs(np.asarray(g, np.float64) - r).max()) / scale if r.size else 0.0
        worst = max(worst, err) if err == err else float("nan")
        if worst != worst:
            return worst
    return worst


def gpu_words(codes: np.ndarray) -> np.ndarray:
    """[E, R, C/2] uint8 E2M1 codes -> [E, C/8, R] uint32: element k of row r is nibble k % 8 of word [k / 8, r]."""
    e, r, half = codes.shape
    nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(e, r, half * 2).astype(np.uint32)
    words = nibbles.reshape(e, r, half // 4, 8) << (4 * np.arange(8, dtype=np.uint32))
    return np.ascontiguousarray(np.bitwise_or.reduce(words, axis=-1).transpose(0, 2, 1))


def gpu_scale_words(scales: np.ndarray) -> np.ndarray:
    """[E, R, C/32] uint8 E8M0 codes -> [E, C/32, R/4] uint32: the scale of (block b, row r) is byte r % 4 of word
    [b, r / 4]."""
    e, r, blocks = scales.shape
    t = scales.transpose(0, 2, 1).reshape(e, blocks, r // 4, 4).astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))
    return np.ascontiguousarray(np.bitwise_or.reduce(t, axis=-1))


def _kn(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def _llvm(func, args: list[np.ndarray], outputs: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """The CPU kernel built for llvm (with k3compile's own exp / tanh / sigmoid, as the compile path builds it)."""
    import tvm

    from k3compile.targets import resolve

    llvm = resolve("llvm")
    with llvm.compiling():
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=llvm.tvm())
    tensors = [tvm.runtime.tensor(np.asarray(a, order="C")) for a in args]
    outs = [tvm.runtime.tensor(np.zeros(s, d)) for s, d in outputs]
    lib["main"](*tensors, *outs)
    return [o.numpy() for o in outs]


class _Launches:
    """Counts the device launches of the runs it wraps."""

    def __init__(self, dev) -> None:
        self.dev, self.count = dev, 0

    def __getattr__(self, name):
        return getattr(self.dev, name)

    def launch(self, *args) -> None:
        self.count += 1
        self.dev.launch(*args)


def check_kda(target, heads: int, dk: int, dv: int, batch: int = 2, tokens: int = 11, seed: int = 0,
              dev=None) -> Row:
    import torch

    from k3compile import devices
    from k3compile.kernels.gpu import kda_gpu_kernel
    from k3compile.kernels.kda import kda_chunked_kernel
    from k3compile.ops.kda_recurrence import kda_recurrence

    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((batch, tokens, heads, dk)) / np.sqrt(dk)).astype(np.float32)
    k = rng.standard_normal((batch, tokens, heads, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the op takes k̂ normalized
    v = rng.standard_normal((batch, tokens, heads, dv)).astype(np.float32)
    g = -rng.exponential(0.3, (batch, tokens, heads, dk)).astype(np.float32)
    beta = rng.random((batch, tokens, heads)).astype(np.float32)
    state = rng.standard_normal((batch, heads, dk, dv)).astype(np.float32)
    args = [q, k, v, g, beta, state]
    outs = [((batch, tokens, heads, dv), "float32"), ((batch, heads, dk, dv), "float32")]
    counter = _Launches(dev or devices.driver(target.name))
    got = devices.run(kda_gpu_kernel(heads, dk, dv), target, args, outs, counter)
    cpu = _llvm(kda_chunked_kernel(heads, dk, dv), args, outs)
    with torch.no_grad():
        eager = [t.numpy() for t in kda_recurrence(*(torch.from_numpy(a) for a in args))]
    return Row(f"k3.kda_recurrence H={heads} K={dk} V={dv}", f"B={batch} T={tokens}", counter.count,
               scaled_error(got, cpu), scaled_error(got, eager))


def check_moe(target, experts: int, inter: int, width: int, offset: int = 0, activation: str = "situ",
              beta: float = 4.0, linear_beta: float = 25.0, act_quant: str = "none", mx: bool = True,
              tokens: int = 5, top_k: int = 3, seed: int = 0, dev=None) -> Row:
    import torch

    from k3compile import devices
    from k3compile.kernels import gpu
    from k3compile.kernels.moe import expert_tiles, moe_kernel
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch_eager

    rng = np.random.default_rng(seed)
    z = rng.standard_normal((tokens, width)).astype(np.float32)
    idx = rng.integers(max(offset - experts // 2, 0), offset + experts + experts // 2, (tokens, top_k))
    w = rng.random((tokens, top_k)).astype(np.float32)
    if mx:
        w13 = rng.integers(0, 256, (experts, 2 * inter, width // 2), dtype=np.uint8)
        w2 = rng.integers(0, 256, (experts, width, inter // 2), dtype=np.uint8)
        s13 = rng.integers(119, 136, (experts, 2 * inter, width // 32), dtype=np.uint8)
        s2 = rng.integers(119, 136, (experts, width, inter // 32), dtype=np.uint8)
    else:
        w13 = (rng.standard_normal((experts, 2 * inter, width)) / np.sqrt(width)).astype(np.float32)
        w2 = (rng.standard_normal((experts, width, inter)) / np.sqrt(inter)).astype(np.float32)
        s13 = s2 = None
    counter = _Launches(dev or devices.driver(target.name))
    ids = idx.astype(np.int32)
    zq = z
    if act_quant != "none":
        zq, = devices.run(gpu.mxfp8_quant_gpu_kernel(width, act_quant), target, [z], [((tokens, width), "float32")],
                          counter)
    if mx:
        up_w, up_s, down_w, down_s = gpu_words(w13), gpu_scale_words(s13), gpu_words(w2), gpu_scale_words(s2)
    else:
        up_w, down_w = _kn(w13), _kn(w2)
        up_s = down_s = np.zeros((1, 1, 1), np.uint32)
    h, = devices.run(gpu.moe_up_gpu_kernel(experts, inter, width, offset, activation == "situ", beta, linear_beta,
                                           mx), target, [zq, ids, up_w, up_s], [((tokens, top_k, inter), "float32")],
                     counter)
    if act_quant != "none":
        h, = devices.run(gpu.mxfp8_quant_gpu_kernel(inter, act_quant), target, [h.reshape(tokens * top_k, inter)],
                         [((tokens * top_k, inter), "float32")], counter)
        h = h.reshape(tokens, top_k, inter)
    y, = devices.run(gpu.moe_down_gpu_kernel(experts, inter, width, offset, mx), target,
                     [h, ids, w, down_w, down_s], [((tokens, width), "float32")], counter)
    placeholder = np.zeros((1, 1, 1, 1), np.uint8)
    cpu, = _llvm(moe_kernel(experts, inter, width, offset, activation == "situ", beta, linear_beta, act_quant, mx),
                 [z, idx, w, expert_tiles(w13), expert_tiles(w2), expert_tiles(s13) if mx else placeholder,
                  expert_tiles(s2) if mx else placeholder],
                 [((tokens, width), "float32")])
    with torch.no_grad():
        t = torch.from_numpy
        eager = latent_moe_dispatch_eager(t(z), t(idx), t(w), t(w13), t(w2), None if s13 is None else t(s13),
                                          None if s2 is None else t(s2), offset, activation, beta, linear_beta,
                                          act_quant).numpy()
    kind = "mxfp4" if mx else "float"
    quant = "" if act_quant == "none" else f" {act_quant}"
    return Row(f"k3.latent_moe_dispatch ({kind}{quant}) E={experts}@{offset} I={inter} D={width}",
               f"N={tokens} k={top_k}", counter.count, scaled_error([y], [cpu]), scaled_error([y], [eager]))


def check_matmul(target, k: int, n: int, act_quant: str = "none", rows: int = 5, seed: int = 0, dev=None) -> Row:
    import torch

    from k3compile import devices
    from k3compile.kernels import gpu
    from k3compile.kernels.mxfp4_matmul import mxfp4_matmul_kernel
    from k3compile.ops.mxfp4_matmul import mxfp4_matmul_eager

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.integers(119, 136, (n, k // 32), dtype=np.uint8)
    counter = _Launches(dev or devices.driver(target.name))
    xq = x
    if act_quant != "none":
        xq, = devices.run(gpu.mxfp8_quant_gpu_kernel(k, act_quant), target, [x], [((rows, k), "float32")], counter)
    y, = devices.run(gpu.mxfp4_matmul_gpu_kernel(k, n), target,
                     [xq, gpu_words(packed[None]), gpu_scale_words(scales[None])], [((rows, n), "float32")], counter)
    cpu, = _llvm(mxfp4_matmul_kernel(k, n, act_quant), [x, _kn(packed), _kn(scales)], [((rows, n), "float32")])
    with torch.no_grad():
        eager = mxfp4_matmul_eager(torch.from_numpy(x), torch.from_numpy(packed), torch.from_numpy(scales),
                                   act_quant).numpy()
    quant = "" if act_quant == "none" else f" {act_quant}"
    return Row(f"k3.mxfp4_matmul{quant} K={k} N={n}", f"M={rows}", counter.count, scaled_error([y], [cpu]),
               scaled_error([y], [eager]))


def kernels_of(mod) -> list[tuple[str, tuple]]:
    """The k3 ops a lowered module holds, as (op symbol, key) from the kernels' `k3.op` / `k3.key` attributes
    (passes/lower_k3_calls.py), each once."""
    import json

    seen = []
    for _, func in mod.functions_items():
        attrs = getattr(func, "attrs", None)
        if attrs is None or "k3.op" not in attrs:
            continue
        item = (str(attrs["k3.op"]), tuple(json.loads(str(attrs["k3.key"]))))
        if item not in seen:
            seen.append(item)
    return seen


def check_op(target, op: str, key: tuple, dev=None) -> list[Row]:
    """The rows for one k3 op of a module: a prefill-sized and a decode-sized run."""
    if op == "k3.kda_recurrence":
        return [check_kda(target, *key, batch=2, tokens=11, dev=dev), check_kda(target, *key, batch=1, tokens=1,
                                                                                 dev=dev)]
    if op in ("k3.latent_moe_dispatch_mxfp4", "k3.latent_moe_dispatch"):
        experts, inter, width, offset, activation, beta, linear_beta, act_quant = key
        common = dict(offset=offset, activation=activation, beta=beta, linear_beta=linear_beta, act_quant=act_quant,
                      mx=op.endswith("mxfp4"), dev=dev)
        return [check_moe(target, experts, inter, width, tokens=9, **common),
                check_moe(target, experts, inter, width, tokens=1, **common)]
    if op == "k3.mxfp4_matmul":
        k, n, act_quant = key
        return [check_matmul(target, k, n, act_quant, rows=9, dev=dev), check_matmul(target, k, n, act_quant,
                                                                                     rows=1, dev=dev)]
    raise ValueError(f"no device check for {op}")
