"""The KDA recurrence as a TIR kernel for CPU targets (docs/model.md, "Kimi Delta Attention").

Layout as the k3 node has it: q̂, k̂, g [B, T, H, K], v [B, T, H, V], β [B, T, H], state [B, H, K, V] ->
o [B, T, H, V], present [B, H, K, V]. Per (batch, head), in parallel, and per time step in order:

    S ← diag(exp g_t) · S              decay the key rows
    e = k̂_tᵀ S;  u = β_t · (v_t − e)   erase against the decayed state
    S ← S + k̂_t ⊗ u                    write
    o_t = Sᵀ q̂_t                        read

S lives in `present` (the state is copied there first), `e`/`u` in two thread-local arrays of V floats. This is
the recurrent form, exact for every T and linear in T; the chunked form for long prefills is a later kernel.
H, K, V are compile-time constants (TVM vectorizes only loops of static extent); B and T are symbolic.
"""

from __future__ import annotations


def kda_recurrence_kernel(heads: int, dk: int, dv: int):
    from tvm.script import tirx as T

    @T.prim_func(private=True)
    def kda_recurrence(q: T.handle, k: T.handle, v: T.handle, g: T.handle, beta: T.handle, state: T.handle,
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
            e = T.alloc_buffer((dv,), "float32", scope="local")
            for i, j in T.grid(dk, dv):
                S[bh // heads, bh % heads, i, j] = S0[bh // heads, bh % heads, i, j]
            for t in range(L):
                for i in range(dk):
                    for j in T.vectorized(dv):
                        S[bh // heads, bh % heads, i, j] = S[bh // heads, bh % heads, i, j] * T.exp(
                            G[bh // heads, t, bh % heads, i])
                for j in T.vectorized(dv):
                    e[j] = T.float32(0)
                for i in range(dk):
                    for j in T.vectorized(dv):
                        e[j] = e[j] + K[bh // heads, t, bh % heads, i] * S[bh // heads, bh % heads, i, j]
                for j in T.vectorized(dv):
                    e[j] = Beta[bh // heads, t, bh % heads] * (V[bh // heads, t, bh % heads, j] - e[j])
                for i in range(dk):
                    for j in T.vectorized(dv):
                        S[bh // heads, bh % heads, i, j] = S[bh // heads, bh % heads, i, j] + K[
                            bh // heads, t, bh % heads, i] * e[j]
                for j in T.vectorized(dv):
                    Out[bh // heads, t, bh % heads, j] = T.float32(0)
                for i in range(dk):
                    for j in T.vectorized(dv):
                        Out[bh // heads, t, bh % heads, j] = Out[bh // heads, t, bh % heads, j] + S[
                            bh // heads, bh % heads, i, j] * Q[bh // heads, t, bh % heads, i]

    return kda_recurrence
