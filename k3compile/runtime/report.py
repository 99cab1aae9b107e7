"""The result of a distributed run, from every rank's report (docs/architecture.md, "Sharding and the runtime"):
used by `k3compile run`'s launcher on node 0 (runtime/launch.py), from what rank 0 gathered (runtime/worker.py)."""

from __future__ import annotations

from pathlib import Path


def summarize(folder: str | Path, results: list[dict]) -> dict:
    """Tokens per prompt (from each replica's token source), decode speed, and bytes per decode step and per decode
    token of every rank and collective, next to the plan's prediction (sharding/cost.py)."""
    from k3compile.manifest import read_sharded
    from k3compile.sharding.cost import COLLECTIVES, WIRE_BYTES, step_bytes

    doc, cfg, plan = read_sharded(folder, rank=0)
    tokens: list[list[int]] = []
    decode_s = 0.0
    decode_tokens = 0
    for d in range(plan.mesh.dp):
        src = results[plan.token_sources(d)[0]]
        tokens += src["tokens"]
        decode_s = max(decode_s, src["decode_s"])
        decode_tokens += src["decode_steps"] * (src["rows"][1] - src["rows"][0])
    ranks = []
    for r in results:
        rows = r["rows"][1] - r["rows"][0]  # its replica's: the tokens each step makes there
        steps = max(r["decode_steps"], 1)
        measured = {op: r["bytes_decode"].get(op, 0) / steps for op in COLLECTIVES}
        predicted = step_bytes(cfg, plan, r["rank"], len(tokens), wire_bytes=WIRE_BYTES[r.get("wire", "fp32")],
                               greedy=r.get("greedy", False))
        ranks.append({"rank": r["rank"], "rows": rows, "own_rows": r["own_rows"], "padded_rows": r["padded_rows"],
                      "decode_steps": r["decode_steps"], "bytes_per_step": measured,
                      "bytes_per_token": {k: v / rows for k, v in measured.items()},
                      "predicted_bytes_per_step": predicted})
    return {"mesh": doc["plan"]["mesh"], "dispatch": plan.dispatch, "tokens": tokens, "decode_s": decode_s,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else None,
            "prefill_s": max(r["prefill_s"] for r in results), "ranks": ranks}
