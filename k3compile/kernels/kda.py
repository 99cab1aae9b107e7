"""The KDA recurrence as TIR kernels for CPU targets (docs/model.md, "Kimi Delta Attention"; the schedule and its
measurements: docs/toolchain.md, "CPU schedules").

Layout as the k3 node has it: q̂, k̂, g [B, T, H, K], v [B, T, H, V], β [B, T, H], state [B, H, K, V] ->
o [B, T, H, V], present [B, H, K, V]. Both kernels run per (batch, head) in parallel; S lives in `present` (the state
is copied there first, unless the first token's step reads it where it is: below). H, K, V are compile-time constants
(TVM vectorizes only loops of static extent); B and T are symbolic.

`kda_recurrence_kernel`, one token at a time:

    S ← diag(exp g_t) · S              decay the key rows
    e = k̂_tᵀ S;  u = β_t · (v_t − e)   erase against the decayed state
    S ← S + k̂_t ⊗ u                    write
    o_t = Sᵀ q̂_t                        read

in two passes over S: the first forms each decayed row as it reads it for e (never storing it), the second forms it
again, adds k̂_t[i] u, stores the row and adds its share of o_t. With a copy of the input state first and one pass
per line above, a decode step streamed S five times and wrote it three: at batch 8 (64 states of 64 KiB, out of L2)
the kernel took 0.76 ms a layer, now 0.54 (docs/toolchain.md, "CPU schedules"), the same bits (the decayed row
rounded before it is used, each product added by FMA, as before). A call without a whole chunk (decode) steps its
first token from the input state into `present`, no copy.

`kda_chunked_kernel` (the one the compile path uses) takes the tokens in chunks of C: with γ_t = Σ_{s≤t} g_s
inside the chunk and S₀ the state at its start,

    A[t, s] = β_t Σ_d k_t[d] k_s[d] exp(γ_t[d] − γ_s[d])      s < t
    Bq[t, s] = Σ_d q_t[d] k_s[d] exp(γ_t[d] − γ_s[d])         s ≤ t
    u = (I + A)⁻¹ · β ⊙ (v − (k ⊙ e^γ) S₀)                    forward substitution
    o = (q ⊙ e^γ) S₀ + Bq u
    S ← diag(e^γ_C) S₀ + (k ⊙ e^(γ_C − γ))ᵀ u

(every exponent is a difference γ_t − γ_s with t ≥ s, never above 0 while g ≤ 0, so nothing overflows), which reads S
twice a chunk in register blocks; the T mod C tokens after the last whole chunk, and decode's single token, take the
recurrent step. Exponentials use `vector_math.exp_f32`, which LLVM vectorizes (TVM's exp on llvm becomes one libm
call per lane, ~6x slower).
"""

from __future__ import annotations

from k3compile.kernels.vector_math import exp_f32

DEFAULT_CHUNK = 8  # measured on k3-small's 128 x 128 heads: 8 beats 4, 16 and 32 (the pair terms grow with C)


def _width(n: int, widest: int) -> int:
    return next(w for w in (widest, 16, 8, 4, 2, 1) if w <= widest and n % w == 0)


def _recurrent_step(heads: int, dk: int, dv: int):
    """A T.macro: one token `t` of the recurrence for head `bh`, reading the state from `Src` (the input state, or
    S itself) and writing it to S, in two passes over it (module docstring; e, o: V floats)."""
    from tvm.script import tirx as T

    @T.macro
    def step(t, bh, Q, K, V, G, Beta, Src, S, Out, e, o):
        for j in T.vectorized(dv):
            e[j] = T.float32(0)
        for i in range(dk):  # e = kᵀ (diag(e^g) S), the decayed rows formed as they are read
            for j in T.vectorized(dv):
                e[j] = e[j] + K[bh // heads, t, bh % heads, i] * (Src[bh // heads, bh % heads, i, j] * exp_f32(
                    G[bh // heads, t, bh % heads, i]))
        for j in T.vectorized(dv):
            e[j] = Beta[bh // heads, t, bh % heads] * (V[bh // heads, t, bh % heads, j] - e[j])
            o[j] = T.float32(0)
        for i in range(dk):  # S ← diag(e^g) S + k ⊗ u, each row read once more and written; o = Sᵀ q as it goes
            for j in T.vectorized(dv):
                S[bh // heads, bh % heads, i, j] = Src[bh // heads, bh % heads, i, j] * exp_f32(
                    G[bh // heads, t, bh % heads, i]) + K[bh // heads, t, bh % heads, i] * e[j]
                o[j] = o[j] + S[bh // heads, bh % heads, i, j] * Q[bh // heads, t, bh % heads, i]
        for j in T.vectorized(dv):
            Out[bh // heads, t, bh % heads, j] = o[j]

    return step


def kda_recurrence_kernel(heads: int, dk: int, dv: int):
    """The token-by-token kernel (the bench's baseline for the chunked one): no chunks, every token a step."""
    return kda_chunked_kernel(heads, dk, dv, chunk=0)


def kda_chunked_kernel(heads: int, dk: int, dv: int, chunk: int = DEFAULT_CHUNK):
    """The chunked kernel (module docstring); chunk = 0: none, every token a step. Register blocks, measured on
    128 x 128 heads: S·(k, q) over 2 rows x 16 columns, the state update over 4 rows x 16 columns (more accumulators
    spill: 16 vector registers on AVX2)."""
    from tvm.script import tirx as T

    C, chunked = max(chunk, 1), chunk > 0
    jv, tb, db = _width(dv, 16), _width(C, 2), _width(dk, 4)  # register block: columns, chunk rows, state rows
    vk = _width(dk, 16)  # lanes of the pair sums
    step = _recurrent_step(heads, dk, dv)

    @T.prim_func(private=True)
    def kda(q: T.handle, k: T.handle, v: T.handle, g: T.handle, beta: T.handle, state: T.handle,
                    o: T.handle, present: T.handle):
        T.func_attr({"tirx.noalias": True})
        B, L = T.int64(), T.int64()
        Q = T.match_buffer(q, (B, L, heads, dk), "float32")
        K = T.match_buffer(k, (B, L, heads, dk), "float32")
        V = T.match_buffer(v, (B, L, heads, dv), "float32")
        G = T.match_buffer(g, (B, L, heads, dk), "float32")
        Beta = T.match_buffer(beta, (B, L, heads), "float32")
        S0 = T.match_buffer(state, (B, heads, dk, dv), "float32")
        Out = T.match_buffer(o, (B, L, heads, dv), "float32")
        S = T.match_buffer(present, (B, heads, dk, dv), "float32")
        for bh in T.parallel(B * heads):
            kc = T.alloc_buffer((C, dk), "float32")  # k, q and γ of the chunk's tokens
            qc = T.alloc_buffer((C, dk), "float32")
            gc = T.alloc_buffer((C, dk), "float32")
            kd = T.alloc_buffer((C, dk), "float32")  # k ⊙ e^γ, q ⊙ e^γ, k ⊙ e^(γ_C − γ)
            qd = T.alloc_buffer((C, dk), "float32")
            kr = T.alloc_buffer((C, dk), "float32")
            u = T.alloc_buffer((C, dv), "float32")
            ob = T.alloc_buffer((C, dv), "float32")
            bc = T.alloc_buffer((C,), "float32")
            akk = T.alloc_buffer((C, C), "float32")
            bqk = T.alloc_buffer((C, C), "float32")
            e = T.alloc_buffer((dv,), "float32")
            ov = T.alloc_buffer((dv,), "float32")
            if (L // C * C if chunked else 0) == 0:  # no whole chunk (decode): the first token reads the input state
                if L > 0:
                    step(0, bh, Q, K, V, G, Beta, S0, S, Out, e, ov)
                else:
                    for i, j in T.grid(dk, dv):
                        S[bh // heads, bh % heads, i, j] = S0[bh // heads, bh % heads, i, j]
                for t in range(1, L):
                    step(t, bh, Q, K, V, G, Beta, S, S, Out, e, ov)
            else:
                for i, j in T.grid(dk, dv):
                    S[bh // heads, bh % heads, i, j] = S0[bh // heads, bh % heads, i, j]
            for c in range(L // C if chunked else 0):
                for t in range(C):
                    bc[t] = Beta[bh // heads, c * C + t, bh % heads]
                    for d in T.vectorized(dk):
                        kc[t, d] = K[bh // heads, c * C + t, bh % heads, d]
                        qc[t, d] = Q[bh // heads, c * C + t, bh % heads, d]
                        gc[t, d] = G[bh // heads, c * C + t, bh % heads, d]
                    for j in T.vectorized(dv):
                        u[t, j] = V[bh // heads, c * C + t, bh % heads, j]
                for t in range(1, C):  # γ_t = Σ_{s≤t} g_s
                    for d in T.vectorized(dk):
                        gc[t, d] = gc[t, d] + gc[t - 1, d]
                for t in range(C):
                    for d in T.vectorized(dk):
                        kd[t, d] = kc[t, d] * exp_f32(gc[t, d])
                        qd[t, d] = qc[t, d] * exp_f32(gc[t, d])
                        kr[t, d] = kc[t, d] * exp_f32(gc[C - 1, d] - gc[t, d])
                for t in range(C):  # the pair terms, decayed from s to t
                    for s in range(t + 1):
                        pa = T.alloc_buffer((vk,), "float32")
                        pb = T.alloc_buffer((vk,), "float32")
                        for lane in T.vectorized(vk):
                            pa[lane] = T.float32(0)
                            pb[lane] = T.float32(0)
                        for d0 in range(dk // vk):
                            for lane in T.vectorized(vk):
                                pa[lane] = pa[lane] + kc[t, d0 * vk + lane] * kc[s, d0 * vk + lane] * exp_f32(
                                    gc[t, d0 * vk + lane] - gc[s, d0 * vk + lane])
                                pb[lane] = pb[lane] + qc[t, d0 * vk + lane] * kc[s, d0 * vk + lane] * exp_f32(
                                    gc[t, d0 * vk + lane] - gc[s, d0 * vk + lane])
                        akk[t, s] = T.float32(0)
                        bqk[t, s] = T.float32(0)
                        for lane in range(vk):
                            akk[t, s] = akk[t, s] + pa[lane]
                            bqk[t, s] = bqk[t, s] + pb[lane]
                        akk[t, s] = akk[t, s] * bc[t]
                for jb, t0 in T.grid(dv // jv, C // tb):  # u = β (v − kd·S₀), ob = qd·S₀
                    au = T.alloc_buffer((tb, jv), "float32")
                    ao = T.alloc_buffer((tb, jv), "float32")
                    for ti in T.unroll(tb):
                        for j in T.vectorized(jv):
                            au[ti, j] = T.float32(0)
                            ao[ti, j] = T.float32(0)
                    for d in range(dk):
                        for ti in T.unroll(tb):
                            for j in T.vectorized(jv):
                                au[ti, j] = au[ti, j] + kd[t0 * tb + ti, d] * S[
                                    bh // heads, bh % heads, d, jb * jv + j]
                                ao[ti, j] = ao[ti, j] + qd[t0 * tb + ti, d] * S[
                                    bh // heads, bh % heads, d, jb * jv + j]
                    for ti in T.unroll(tb):
                        for j in T.vectorized(jv):
                            u[t0 * tb + ti, jb * jv + j] = bc[t0 * tb + ti] * (u[t0 * tb + ti, jb * jv + j]
                                                                                - au[ti, j])
                            ob[t0 * tb + ti, jb * jv + j] = ao[ti, j]
                for t in range(1, C):  # (I + A) u = u₀, forward
                    for s in range(t):
                        for j in T.vectorized(dv):
                            u[t, j] = u[t, j] - akk[t, s] * u[s, j]
                for t in range(C):  # o = ob + Bq u
                    for s in range(t + 1):
                        for j in T.vectorized(dv):
                            ob[t, j] = ob[t, j] + bqk[t, s] * u[s, j]
                    for j in T.vectorized(dv):
                        Out[bh // heads, c * C + t, bh % heads, j] = ob[t, j]
                for d0, jb in T.grid(dk // db, dv // jv):  # S ← diag(e^γ_C) S₀ + krᵀ u
                    acc = T.alloc_buffer((db, jv), "float32")
                    for di in T.unroll(db):
                        for j in T.vectorized(jv):
                            acc[di, j] = S[bh // heads, bh % heads, d0 * db + di, jb * jv + j] * exp_f32(
                                gc[C - 1, d0 * db + di])
                    for t in range(C):
                        for di in T.unroll(db):
                            for j in T.vectorized(jv):
                                acc[di, j] = acc[di, j] + kr[t, d0 * db + di] * u[t, jb * jv + j]
                    for di in T.unroll(db):
                        for j in T.vectorized(jv):
                            S[bh // heads, bh % heads, d0 * db + di, jb * jv + j] = acc[di, j]
            if (L // C * C if chunked else 0) > 0:
                for t in range(L // C * C, L):  # the tokens after the last whole chunk: token by token
                    step(t, bh, Q, K, V, G, Beta, S, S, Out, e, ov)

    return kda
