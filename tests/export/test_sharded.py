"""Sharded builds and distributed decode (k3compile/partition.py, k3compile/runtime/): every mesh's tokens and
decode states against eager and against the single-process TVM build, the runtime's bytes against the plan and
against the accounting rule written out here, two torchrun agents, a killed worker, damaged artifacts.

The eight sharded artifacts (two models x four meshes) are built once per session with the CLI, two at a time.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import build_hf

from k3compile.generate import generate, left_pad
from k3compile.runtime.launch import run
from k3compile.runtime.worker import Options

PROMPTS = [[5, 17, 42, 9], [3, 77], [60, 4, 8]]  # a left-padded batch of three (ids below both vocabularies)
NEW = 32
MESHES = ["ep=2", "ep=3", "pp=2", "ep=2,pp=2"]
MODELS = ["k3-tiny", "kimi-linear"]
A2A = "all-to-all"
CASES = [(m, mesh, "all-reduce") for m in MODELS for mesh in MESHES] + [("k3-tiny", "ep=2", A2A),
                                                                       ("k3-tiny", "ep=3", A2A)]
# Decode states after 32 steps, distributed vs one process: the expert-parallel all-reduce adds the slices' partial
# sums, where one process sums all experts in one kernel: fp32 rounding of another order (observed <= 1e-5 on
# values of order 1). A wrong expert slice or a lost carry tensor moves them by O(1).
STATE_ATOL = 1e-4


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3compile.cli", *args], capture_output=True, text=True, **kw)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A float-expert Kimi-Linear checkpoint written by transformers (6 experts, 5 layers)."""
    folder = tmp_path_factory.mktemp("hf") / "kimi-linear"
    build_hf(folder, q_lora_rank=24, heads=4, kda_heads=3, head_dim=8)
    return folder


@pytest.fixture(scope="session")
def sources(hf_checkpoint):
    return {"k3-tiny": "k3-tiny", "kimi-linear": str(hf_checkpoint)}


@pytest.fixture(scope="session")
def sharded(sources, tmp_path_factory):
    """(model, mesh, dispatch) -> the folder `k3compile export SOURCE --mesh MESH --dispatch D` wrote (built two at
    a time)."""
    root = tmp_path_factory.mktemp("sharded")
    keys = [*CASES, ("k3-tiny", "ep=2,dp=2", "all-reduce")]
    jobs = {k: root / "-".join(k).replace(",", "-").replace("=", "") for k in keys}

    def build(key):
        model, mesh, dispatch = key
        res = cli("export", sources[model], "--mesh", mesh, "--dispatch", dispatch, "-o", str(jobs[key]), "--quiet")
        assert res.returncode == 0, res.stderr[-2000:]
        return key

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(build, jobs))
    return jobs


@pytest.fixture(scope="session")
def references(sources, tvm_artifact, tmp_path_factory):
    """model -> (eager backend, single-process TVM backend)."""
    from k3compile.backends.eager import EagerBackend
    from k3compile.backends.tvm import TvmBackend
    from k3compile.pipeline import export_checked
    from k3compile.source import load_model

    hf = load_model(sources["kimi-linear"])
    folder = tmp_path_factory.mktemp("exports") / "kimi-linear"
    export_checked(hf, folder, source={"source": sources["kimi-linear"]})
    return {"k3-tiny": (EagerBackend(load_model("k3-tiny")), TvmBackend(tvm_artifact[1])),
            "kimi-linear": (EagerBackend(hf), TvmBackend(folder))}


def final_states(backend, tokens: list[list[int]]):
    """The decode state after feeding the prompts and then `tokens` (as the runtime does, padding after EOS)."""
    cfg = backend.config
    pad = cfg.pad_token_id
    ids, mask = left_pad(PROMPTS, pad)
    past = backend.init_past(len(PROMPTS))
    for step in range(max(len(t) for t in tokens)):
        _, past = backend.step(ids, mask, past)
        ids = torch.tensor([[t[step] if step < len(t) else pad] for t in tokens])
        mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
    return past


def accounted(cfg, plan, rank: int, rows: int) -> dict:
    """The accounting rule, written out independently of sharding/cost.py, for a replica of `rows` rows. All-reduce
    dispatch: per decode step a rank all-reduces one [rows, latent] fp32 tensor per MoE layer of its stage when
    ep > 1, sends every carry tensor ([rows, 1, hidden] fp32: the residual and the AttnRes summaries closed before
    its last layer) to the next stage, and the last stage's first shard broadcasts the rows' int64 tokens.
    All-to-all: a rank holds ceil(rows / ep) rows (padded), and per MoE layer sends to each of the ep - 1 others a
    block with room for all its rows x top-k slots, four times: latent vectors (fp32), expert ids (int64), weights
    (fp32), outputs (fp32); every shard of the last stage broadcasts its rows' tokens."""
    d, s, e = plan.mesh.coords(rank)
    a, b = plan.cuts[s], plan.cuts[s + 1]
    moe = sum(cfg.is_moe(i) for i in range(a, b))
    block = cfg.attn_res_block_size
    carry = 1 + (len([i for i in range(b) if i % block == 0]) if block else 0)
    last = s == plan.mesh.pp - 1
    ep = plan.mesh.ep
    if plan.dispatch == "all_to_all":
        held = -(-rows // ep)
        slot = cfg.latent_size * 4 + 8 + 4 + cfg.latent_size * 4
        return {"all_reduce": 0, "all_to_all": moe * (ep - 1) * held * cfg.num_experts_per_token * slot,
                "send": 0 if last else carry * held * cfg.hidden_size * 4, "broadcast": held * 8 if last else 0}
    return {"all_reduce": moe * rows * cfg.latent_size * 4 if ep > 1 else 0, "all_to_all": 0,
            "send": 0 if last else carry * rows * cfg.hidden_size * 4,
            "broadcast": rows * 8 if last and e == 0 else 0}


@pytest.mark.parametrize("model,mesh,dispatch", CASES)
def test_distributed_decode_equals_eager_and_one_process(model, mesh, dispatch, sharded, references, tmp_path):
    from k3compile.partition import read_sharded

    eager, tvm = references[model]
    want = generate(eager, PROMPTS, NEW, eos_token_id=eager.config.eos_token_id).tokens
    assert generate(tvm, PROMPTS, NEW, eos_token_id=tvm.config.eos_token_id).tokens == want
    folder = sharded[(model, mesh, dispatch)]
    res = run(folder, Options(PROMPTS, NEW, threads=1, states_dir=str(tmp_path)))
    assert res["tokens"] == want
    assert sum(len(t) for t in want) > 3 * 8  # enough decode steps to mean something

    doc, cfg, plan = read_sharded(folder)
    assert plan.dispatch == dispatch.replace("-", "_")
    ref = final_states(tvm, want)
    for r in range(plan.mesh.size):
        got = np.load(tmp_path / f"states.rank{r}.npz")
        lo, hi, _ = plan.rank_rows(len(PROMPTS), r)  # its rows (all of them, or with all-to-all its share + pads)
        a, b = plan.rank(r).layers
        assert sorted(got.files) == sorted(f"past.{i}.{n}" for i in range(a, b) for n in
                                           (("latent", "k_rope") if cfg.is_mla(i) else ("conv_state",
                                                                                        "recurrent_state")))
        for name in got.files:
            i, which = int(name.split(".")[1]), name.split(".")[2]
            expect = ref[i][0 if which in ("latent", "conv_state") else 1].numpy()[lo:hi]
            np.testing.assert_allclose(got[name][:hi - lo], expect, rtol=0, atol=STATE_ATOL, err_msg=f"rank {r} {name}")

    for row in res["ranks"]:
        assert row["decode_steps"] == max(len(t) for t in want) - 1
        rule = accounted(cfg, plan, row["rank"], row["rows"])
        assert row["bytes_per_step"] == row["predicted_bytes_per_step"] == rule, row


def test_data_parallel_replicas_decode_their_rows(sharded, references):
    """dp=2 with ep=2: rows [0, 2) on ranks 0-1, row 2 on ranks 2-3, each replica all-reducing in its own group."""
    eager, _ = references["k3-tiny"]
    want = generate(eager, PROMPTS, NEW, eos_token_id=eager.config.eos_token_id).tokens
    res = run(sharded[("k3-tiny", "ep=2,dp=2", "all-reduce")], Options(PROMPTS, NEW, threads=1))
    assert res["tokens"] == want
    assert [r["rows"] for r in res["ranks"]] == [2, 2, 1, 1]
    assert [r["bytes_per_step"]["broadcast"] for r in res["ranks"]] == [16, 0, 8, 0]
    assert all(r["bytes_per_step"] == r["predicted_bytes_per_step"] for r in res["ranks"])


def test_two_torchrun_agents_decode_the_same_tokens(sharded, references, tmp_path):
    """Two elastic agents on this machine (--nnodes 2, one worker each, rendezvous on localhost): the multi-node
    path, as the README gives it."""
    from k3compile.runtime.launch import free_port

    eager, _ = references["k3-tiny"]
    want = generate(eager, PROMPTS, NEW, eos_token_id=eager.config.eos_token_id).tokens
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "k3test",
           "-m", "k3compile.runtime.worker", str(sharded[("k3-tiny", "ep=2", "all-reduce")]),
           "--max-new-tokens", str(NEW),
           *(a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p))))]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1][-2000:] for o in outs]
    printed = [json.loads(line) for o, _ in outs for line in o.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and printed[0]["tokens"] == want  # rank 0 prints, on whichever agent holds it


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_lost_worker_ends_the_run_naming_its_rank(sharded, how):
    """SIGKILL: the agent sees rank 1 die. SIGSTOP: rank 1 goes silent, rank 0's next collective times out after
    --timeout (5 s) naming rank 1 as the peer, and the agent kills the frozen worker (after torch's 30 s SIGTERM
    grace). Either way: one error line, exit 1, no worker left."""
    import psutil

    folder = sharded[("k3-tiny", "pp=2", "all-reduce")]
    proc = subprocess.Popen([sys.executable, "-m", "k3compile.cli", "run", str(folder), "--max-new-tokens", "4000",
                             "--timeout", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    deadline = time.monotonic() + 120
    pid = None
    while victim is None and time.monotonic() < deadline:  # wait until decoding runs, then stop rank 1
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith("rank 1 (pid "):
            pid = int(line.split()[3].rstrip(","))
        if line.startswith("step 20/") and pid is not None:
            victim = psutil.Process(pid)
    assert victim is not None, "the run did not start decoding"
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True)]
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < (30 if how == "killed" else 5 + 30 + 20)  # timeout + grace + margin
    assert proc.returncode == 1
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, err[-2000:]
    if how == "killed":
        assert "rank 1 failed: killed by SIGKILL" in errors[0]
    else:
        assert "rank 0 failed" in errors[0] and "with rank(s) [1]" in errors[0] and "Timed out" in errors[0]
    time.sleep(1)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]  # no orphan


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


@pytest.mark.parametrize("damage", ["weights", "missing", "plan"])
def test_a_damaged_artifact_is_refused_with_one_line(sharded, tmp_path, damage):
    folder = _copy(sharded[("k3-tiny", "ep=2", "all-reduce")], tmp_path)
    if damage == "weights":
        path = folder / "rank1" / "weights.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        expect = "rank1/weights.safetensors: its sha256 differs"
    elif damage == "missing":
        (folder / "rank1" / "model.so").unlink()
        expect = "rank1/model.so: missing"
    else:
        doc = json.loads((folder / "manifest.json").read_text())
        doc["plan"]["expert_slices"] = [[0, 5], [5, 8]]
        (folder / "manifest.json").write_text(json.dumps(doc))
        expect = "not the plan of its mesh"
    res = cli("run", str(folder), "--max-new-tokens", "2")
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.count("Error:") == 1 and expect in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_run_stats_prints_measured_next_to_the_plan(sharded):
    folder = sharded[("k3-tiny", "ep=2,pp=2", "all-reduce")]
    res = cli("run", str(folder), "--max-new-tokens", "4", "--stats", "--quiet")
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("│")]
    assert len(rows) == 4
    # rank 0: 3 MoE layers x 32 latent x 4 bytes per token; the carry (hidden + 2 summaries) 3 x 64 x 4
    assert "384 (384)" in rows[0] and "768 (768)" in rows[0]


def test_the_manifest_names_each_ranks_share(sharded):
    from k3compile.partition import read_sharded

    doc, cfg, plan = read_sharded(sharded[("k3-tiny", "ep=3", "all-reduce")])
    assert [r["experts"] for r in doc["ranks"]] == [[0, 3], [3, 6], [6, 8]]  # 8 experts on 3 ranks
    assert doc["builds"] == 2  # slices of 3 share one library, the slice of 2 has its own
    from safetensors import safe_open

    def packed(rank):  # the MXFP4 experts, re-laid for the kernel: the only uint8 tensors
        with safe_open(sharded[("k3-tiny", "ep=3", "all-reduce")] / f"rank{rank}" / "weights.safetensors", "np") as f:
            return [t for t in (f.get_tensor(k) for k in f.keys()) if t.dtype == np.uint8]

    assert {t.shape[0] for t in packed(0)} == {3} and {t.shape[0] for t in packed(2)} == {2}  # its experts only
    assert sum(t.nbytes for t in packed(2)) * 3 == sum(t.nbytes for t in packed(0)) * 2
    pp = read_sharded(sharded[("k3-tiny", "pp=2", "all-reduce")])[0]
    assert [r["layers"] for r in pp["ranks"]] == [[0, 4], [4, 7]]  # the cut on an AttnRes block edge (size 2)
    assert pp["ranks"][1]["inputs"][:3] == ["carry.hidden", "carry.bank.0", "carry.bank.1"]


def test_export_refuses_a_mesh_the_model_cannot_be_split_over(tmp_path):
    for mesh, words in (("ep=9", "8 experts cannot be split over ep=9"), ("pp=8", "7 layers cannot be split"),
                        ("ep=2,tp=2", "expected degrees")):
        res = cli("export", "k3-tiny", "--mesh", mesh, "-o", str(tmp_path / "out"), "--quiet")
        assert res.returncode == 1 and res.stderr.count("Error:") == 1 and words in res.stderr, res.stderr
        assert not (tmp_path / "out").exists()


def test_gpu_targets_are_refused_for_a_mesh(tmp_path):
    res = cli("export", "k3-tiny", "--mesh", "ep=2", "--target", "opencl", "-o", str(tmp_path / "out"))
    assert res.returncode == 1 and "gloo on CPU" in res.stderr and not (tmp_path / "out").exists()
