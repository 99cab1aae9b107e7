"""The host GEMM that compiled CPU prefill matmuls call (docs/toolchain.md, "CPU schedules": the host GEMM).

TVM's schedule for a dense matmul reaches ~160-175 GFLOP/s on this machine's prefill shapes (symbolic rows leave it
no register tiling of the rows; the bf16 panels are widened once per chunk for 4 rows), where the BLAS numpy ships
(OpenBLAS: its own AVX-512 micro-kernels over packed panels) reaches ~180-200 in fp32 from ~1000 rows on.
`targets/llvm.py` therefore gives every packed dense matmul over symbolic rows a branch: from HOST_GEMM_ROWS rows
on, the kernel calls the packed function `k3compile.host_gemm` (registered here by `register`) instead of its own
loops; below that (decode, short prompts) it runs as before.

The callback gets the matmul's three buffers as the kernel holds them: x [..., K] fp32, the panels wp [N/P, K, P]
(fp32, or bf16 patterns as uint16) and y [..., N] fp32. The panels are split between the threads of a pool of the
process's thread count (TVM's, `k3compile.threads`); each widens a chunk of its panels at a time into an fp32
[K, cols] scratch (the 16-bit shift the kernel does: the same values) and multiplies all of x by it, y = x @ W in
fp32 as the kernel computes it, the sums in the BLAS's order (equal within fp32 rounding). A chunk is at most
CHUNK_BYTES, so the full K3's widest matrices never widen whole. The calling thread only waits.

Each pool thread runs the BLAS on one thread (threadpoolctl, set once as the thread starts; OpenBLAS keeps the
count per thread, so the caller's own numpy keeps its setting): OpenBLAS's own workers spin for a while after each
call, and beside TVM's pool on the same cores they halved the kernels that ran next (k3-small prefill T = 2048: the
MoE kernel 1.07 -> 1.52 s, the other kernels 0.94 -> 1.85 s; measured).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HOST_GEMM = "k3compile.host_gemm"  # the packed function's name (targets/llvm.py: HOST_GEMM names it too)
CHUNK_BYTES = 8 << 20  # fp32 bytes of weights one thread widens at once
_local = threading.local()
_state: dict = {}  # "pool": (its thread count, the ThreadPoolExecutor)


class _Array:
    """numpy's array interface over a TVM tensor's memory (the callback's arguments are views that DLPack cannot
    export)."""

    def __init__(self, t) -> None:
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(int(d) for d in t.shape),
                                    "typestr": np.dtype(str(t.dtype)).str, "version": 3}


def _view(t) -> np.ndarray:
    return np.asarray(_Array(t))


def _scratch(size: int) -> np.ndarray:
    """This thread's fp32 scratch of `size` values (kept: a new one each call would fault its pages in again)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = _local.buf = np.empty(size, np.float32)
    return buf[:size]


def _columns(a: np.ndarray, w: np.ndarray, out: np.ndarray, g0: int, g1: int) -> None:
    """out[:, panels g0..g1) = a @ widen(w[g0:g1]), CHUNK_BYTES of widened panels at a time."""
    _, k_dim, panel = w.shape
    step = max(1, CHUNK_BYTES // (4 * k_dim * panel))
    for c0 in range(g0, g1, step):
        c1 = min(g1, c0 + step)
        wide = _scratch(k_dim * (c1 - c0) * panel)
        if w.dtype == np.uint16:
            bits = wide.view(np.uint32).reshape(k_dim, c1 - c0, panel)
            np.copyto(bits, w[c0:c1].transpose(1, 0, 2))
            np.left_shift(bits, 16, out=bits)
        else:
            np.copyto(wide.reshape(k_dim, c1 - c0, panel), w[c0:c1].transpose(1, 0, 2))
        np.matmul(a, wide.reshape(k_dim, (c1 - c0) * panel), out=out[:, c0 * panel:c1 * panel])


def _threads() -> int:
    from k3compile.threads import available_cores, capped

    return capped(int(os.environ.get("TVM_NUM_THREADS") or available_cores()))


def _pool(threads: int):
    """The pool of `threads` threads (made again only when the process's count changes: its threads keep their
    scratch)."""
    held = _state.get("pool")
    if held is None or held[0] != threads:
        if held is not None:
            held[1].shutdown(wait=False)
        held = _state["pool"] = (threads, ThreadPoolExecutor(threads, thread_name_prefix="k3-host-gemm",
                                                             initializer=_one_blas_thread))
    return held[1]


def _one_blas_thread() -> None:
    """A pool thread's BLAS calls run on that thread alone (OpenBLAS keeps the count per thread)."""
    import threadpoolctl

    threadpoolctl.threadpool_limits(1, user_api="blas")


def host_gemm(x, wp, y) -> None:
    """y[..., n] = sum_k x[..., k] * widen(wp[n // P, k, n % P]) (the packed function HOST_GEMM)."""
    w = _view(wp)
    groups, k_dim, panel = w.shape
    a = _view(x).reshape(-1, k_dim)
    out = _view(y).reshape(a.shape[0], groups * panel)
    threads = _threads()
    pool = _pool(threads)
    parts = min(threads, groups)  # a matrix of fewer panels than threads: one share per panel
    bounds = [groups * t // parts for t in range(parts + 1)]
    for f in [pool.submit(_columns, a, w, out, bounds[t], bounds[t + 1]) for t in range(parts)]:
        f.result()


def register() -> None:
    """Register `host_gemm` as the packed function HOST_GEMM (idempotent, and never replaced: a compiled kernel keeps
    the handle it first looked up, so a registration swapped later would leave it dangling; a test that did so
    crashed its process at exit)."""
    import tvm_ffi

    if tvm_ffi.get_global_func(HOST_GEMM, allow_missing=True) is None:
        tvm_ffi.register_global_func(HOST_GEMM, host_gemm)
