"""One rank of distributed decode (docs/architecture.md, "Sharding and the runtime").

A worker is one process of a torch.distributed world (gloo on CPU), started by `k3compile run`'s launcher
(runtime/launch.py) on its machine, with its rank in the environment and its options in the launcher's private run
folder (JSON). It joins the run's store (runtime/rendezvous.py), checks its own files against the manifest
(manifest.read_sharded), loads its library and weight shard into the Relax VM, and runs its step schedule for
every token (a GPU target's rank runs its launch plan on its device instead: backends/executor.py):

    recv the carry from the previous stage -> run its layers (inside the graph, each MoE layer's all-reduce of the
    latent partial sums, or all-to-all dispatch and combine, over its stage's ranks; with tensor parallelism the
    attention's, MLP's and embedding's all-reduces over its tp group: ops/collectives.py) -> (tp) the logits of
    each vocabulary slice gathered at the token source (greedy decoding: only each slice's argmax) -> send the
    carry on -> the new tokens are broadcast from the last stage to every rank of the replica.

Tensors cross between TVM and torch by DLPack (no copies). Every collective checks its place in the schedule and
counts the payload bytes it hands over (`Stats`), which `run --stats` prints beside the plan's prediction. A peer
that dies or a collective that waits past `timeout` raises here; the worker writes its one-line error into the run
folder and exits 1, and the launcher then ends every rank. At the end every rank's result crosses to rank 0 as JSON
(`gather_json`: nothing a peer sends is unpickled), which writes them into its launcher's run folder.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from k3compile.errors import UserError
from k3compile.sharding.plan import A2A_DISPATCH, A2A_ID_COLUMN, AR_LATENT, AR_PARTS

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for a peer
START_S = 600.0  # seconds every rank's loading (its library and weights) may take: `--start-timeout`'s default
# Where a node's launcher leaves its one line when one of its ranks failed (+ its node rank): the other nodes' ranks
# stop waiting for the ranks to load (loaded), a server names it (backends/sharded.py).
NODE_FAILED = "k3compile/failed/"
ANY_FAILED = "k3compile/failures"  # a count of those lines: one key to poll
LOADED = "k3compile/loaded/"  # + rank: set when the rank has loaded (loaded)


class RuntimeFault(UserError):
    """A rank that cannot go on: a missing peer, a timeout, a collective out of schedule."""


@dataclass
class Stats:
    """Payload bytes this rank handed to each collective, in prefill and in decode."""

    prefill: Counter = field(default_factory=Counter)
    decode: Counter = field(default_factory=Counter)
    counting: str = "prefill"

    def add(self, op: str, nbytes: int) -> None:
        (self.decode if self.counting == "decode" else self.prefill)[op] += nbytes


@dataclass
class Options:
    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    threads: int | None = None
    timeout: float = DEFAULT_TIMEOUT
    states_dir: str | None = None  # each rank writes its layers' final decode state here (states.rank<r>.npz)
    progress: bool = False  # rank 0 reports each step on stderr
    devices: tuple[int, ...] = ()  # GPU ranks: the device of each of this node's ranks in rank order (one: all)
    serve: bool = False  # a server's rank (backends/sharded.py): commands from the world's last rank, not a decode
    # each step's rows in this many micro-batches, so that stages overlap (Rank.decode_micro); AUTO_MICRO_BATCHES
    # (sharding/plan.py): launch.run picks the count (auto_micro_batches), so a rank always gets a count
    micro_batches: int = 1
    wire: str = "fp32"  # the all-to-all's latent vectors on the wire: fp32 (exact) or bf16 (Rank._exchange)
    start_timeout: float = START_S  # seconds loading may take before the ranks wait for each other (loaded)
    nnodes: int = 1  # the machines the world spans (each node's failure key: NODE_FAILED)


class Rank:
    """This process's rank: its plan, library, weights and process groups."""

    def __init__(self, folder: Path, rank: int, world: int, options: Options) -> None:
        import torch.distributed as dist

        from k3compile.manifest import read_sharded
        from k3compile.sharding.tensor import rank_config

        self.doc, self.cfg, self.plan = read_sharded(folder, rank)
        self.state_cfg = rank_config(self.cfg, self.plan.mesh.tp)  # its decode state's shapes (its heads)
        ranks = world - 1 if options.serve else world  # a server's world has its controller besides the mesh
        if ranks != self.plan.mesh.size:
            raise RuntimeFault(f"rank {rank}: the world has {ranks} ranks, the mesh {self.plan.mesh} needs "
                               f"{self.plan.mesh.size}")
        self.p = self.plan.rank(rank)
        self.entry = self.doc["ranks"][rank]
        self.schedule = self.entry["schedule"]
        # the replica's token sources, in the order every rank broadcasts their tokens
        self.sources = [s["from"] for s in self.schedule if s["op"] == "broadcast"]
        self.stats = Stats()
        self.wire = options.wire
        timeout = datetime.timedelta(seconds=options.start_timeout)  # joining: the start-up bound (started())
        ep_groups, tp_groups, replicas = process_groups(self.plan, timeout)
        self.ep_group = ep_groups[self.p.replica, self.p.stage]
        self.tp_group = tp_groups.get((self.p.replica, self.p.stage, self.p.shard // self.plan.mesh.tp))
        self.replica = replicas[self.p.replica]
        # a server's world also holds its controller (backends/sharded.py): tensors go point to point in a group of
        # every process, the controller's commands over the default group (kept alive while the server is idle)
        self.work = dist.new_group(list(range(world)), timeout=timeout) if options.serve else None
        self.groups = [None, *ep_groups.values(), *tp_groups.values(), *replicas.values(),
                       *([self.work] if self.work is not None else [])]  # None: the default group
        self._load(folder)

    def started(self, timeout: float) -> None:
        """Start-up is over (every rank joined and loaded): from now on every collective waits at most `timeout`."""
        collective_timeout(self.groups, timeout)

    def _load(self, folder: Path) -> None:
        """The rank's graph in TVM's VM (llvm), or its launch plan on its device's executor (a GPU target: the
        collectives are the plan's host functions, backends/executor.py)."""
        names, weights = self.entry["params"], folder / self.entry["weights"]
        self.program = None
        if "launch_plan" in self.entry:
            from k3compile.backends.executor import DeviceProgram
            from k3compile.ops.collectives import host_functions

            self.program = DeviceProgram(folder / self.entry["launch_plan"], folder / self.entry["constants"],
                                         weights, names, self.doc["target"], externs=host_functions())
            return
        from k3compile import library
        from k3compile.lean import check_host, import_tvm
        from k3compile.ops import register_tvm_references

        if "host" in self.doc:  # recorded since the torch-free decode: checked without LLVM (lean.check_host), and a
            check_host(folder, self.doc)  # rank never compiles, so it loads TVM's runtime library alone
            import_tvm(beside_torch=True)
        import tvm
        from tvm.runtime.vm import VirtualMachine

        register_tvm_references()  # the collectives' symbols, which the rank's graph calls
        self.vm = VirtualMachine(library.load(folder / self.entry["library"], names, weights), tvm.cpu())
        self.params = library.read_weights(weights, names, tvm.cpu())

    def run_graph(self, feeds: list, head: int) -> list:
        """The rank's graph on feeds: its first `head` results (the logits, or the carry) in host memory (of the
        logits, only each row's last position), the rest (the decode state) where the graph keeps it."""
        import torch

        if self.program is None:
            outs = self.vm["main"](*(_tvm(x) for x in feeds), *self.params)
            return [torch.from_dlpack(o) for o in outs]
        outs = self.program.run(feeds)
        heads = [self.program.last_positions(outs[0])] if self.p.last else [self.program.host(o) for o in
                                                                               outs[:head]]
        return [*heads, *outs[head:]]

    def host(self, t):
        """A decode state tensor in host memory."""
        return t if self.program is None else self.program.host(t)

    # ---- the collectives, each checked against the schedule and counted -------------------------------------------
    def expect_collectives(self) -> None:
        run = next(s for s in self.schedule if s["op"] == "run")
        self._calls = [(c["op"], c["tag"], c["part"]) for c in run["collectives"]]
        self._open: dict = {}  # tag -> a layer's all-to-all selection, from its dispatch to its outputs (_exchange)

    def collective(self, op: str, x, out, tag: int, part: int) -> None:
        """ops/collectives.py's hook: the graph's all-reduce or all-to-all, over this rank's stage group (ep · tp
        ranks: the MoE's latent partial sums, the all-to-all) or its tensor-parallel group (attention, MLP)."""
        import torch.distributed as dist

        if not self._calls or self._calls[0] != (op, tag, part):
            raise RuntimeFault(f"rank {self.p.rank}: {op} of layer {tag} (part {part}) is not next in its schedule "
                               f"({self._calls[:1] or 'none left'})")
        self._calls.pop(0)
        nbytes = x.numel() * x.element_size()
        peers = self.plan.ep_group(self.p.rank)
        if op == "all_reduce":
            self.stats.add(op, nbytes)
            out.copy_(x)
            if part != AR_LATENT:
                peers = self.plan.tp_group(self.p.rank)
            self._talk(f"the all-reduce of layer {tag} ({AR_PARTS[part]})", peers, dist.all_reduce, out,
                       group=self.ep_group if part == AR_LATENT else self.tp_group)
        else:
            self._exchange(x, out, tag, part, peers)

    def _exchange(self, x, out, tag: int, part: int, peers: list[int]) -> None:
        """An all-to-all of the dispatch that moves only routed rows (docs/architecture.md, "All-to-all dispatch").

        The graph's buffer x is [G, C, W]: block g for rank g, with room for all C of this rank's token slots. A
        dispatch row is a slot's latent vector, expert id and weight, id -1 where the slot is not for that rank: the
        rows with an id are the layer's selection, whose per-destination counts the ranks exchange first (G int64s
        each); then exactly those rows go out, in the sender's slot order, with split sizes, and arrive packed at the
        front of each source's block of `out` (the rest zeros with id -1: as a full buffer's empty slots are). The
        outputs go back the other way, each source's first count rows, and land where the sender's selection was
        (zeros elsewhere), so the graph's sum over blocks and slots is the full buffers' sum."""
        import torch
        import torch.distributed as dist

        what = f"the all-to-all of layer {tag}"
        if part == A2A_DISPATCH:
            sel = x[..., A2A_ID_COLUMN] >= 0
            counts = sel.sum(1).to(torch.int64)
            arriving = torch.empty_like(counts)
            self.stats.add("all_to_all", (len(counts) - 1) * counts.element_size())
            self._talk(what, peers, dist.all_to_all_single, arriving, counts, group=self.ep_group)
            room = torch.arange(x.shape[1]).unsqueeze(0) < arriving.unsqueeze(1)  # arrivals: each block's front
            sent, got = counts.tolist(), arriving.tolist()
            self._open[tag] = (sel, sent, room, got)
        else:  # the outputs: back to where each row came from
            room, got, sel, sent = self._open.pop(tag)
        rows = wire_rows(x[sel], part == A2A_DISPATCH) if self.wire == "bf16" else x[sel]
        buf = torch.empty((sum(got), *rows.shape[1:]), dtype=rows.dtype)
        row_bytes = rows.shape[1] * rows.element_size()  # rows: [n, W]
        self.stats.add("all_to_all", (sum(sent) - sent[peers.index(self.p.rank)]) * row_bytes)
        self._talk(what, peers, dist.all_to_all_single, buf, rows, output_split_sizes=got, input_split_sizes=sent,
                   group=self.ep_group)
        out.zero_()
        if part == A2A_DISPATCH:
            out[..., A2A_ID_COLUMN] = -1
        out[room] = host_rows(buf, part == A2A_DISPATCH) if self.wire == "bf16" else buf

    def _talk(self, what: str, peers: list[int], fn, *args, **kw):
        """A torch.distributed call (its result) whose failure (a dead peer, a timeout) names this rank and its
        peers."""
        try:
            return fn(*args, **kw)
        except (RuntimeError, OSError) as e:  # gloo's errors (DistBackendError is a RuntimeError)
            others = [r for r in peers if r != self.p.rank]
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise RuntimeFault(f"rank {self.p.rank}: {what} with rank(s) {others} failed ({why})") from None

    def send(self, tensors, to: int) -> None:
        import torch.distributed as dist

        for t in tensors:
            self.stats.add("send", t.numel() * t.element_size())
            self._talk("sending the carry", [to], dist.send, t.contiguous(), dst=to, group=self.work)

    def recv(self, shapes, src: int):
        import torch
        import torch.distributed as dist

        out = [torch.empty(s, dtype=torch.float32) for s in shapes]
        for t in out:
            self._talk("receiving the carry", [src], dist.recv, t, src=src, group=self.work)
        return out

    def broadcast(self, t, src: int) -> None:
        self._talk("the broadcast of the tokens", self._peers_of(src), self.broadcast_async(t, src).wait)

    def broadcast_async(self, t, src: int):
        """The broadcast of tokens from `src` over the replica, started: its Work (wait() ends it)."""
        import torch.distributed as dist

        if self.p.rank == src:
            self.stats.add("broadcast", t.numel() * t.element_size())
        return self._talk("the broadcast of the tokens", self._peers_of(src), dist.broadcast, t, src=src,
                          group=self.replica, async_op=True)

    def _peers_of(self, src: int) -> list[int]:
        """Whom a broadcast from `src` waits on here: the source, or on the source its replica."""
        return [src] if src != self.p.rank else self.plan.replica_group(self.p.replica)

    # ---- one step of the schedule ---------------------------------------------------------------------------------
    def forward(self, ids, mask, past: list) -> tuple[list, int]:
        """The graph's part of a step (recv the carry, run the layers with their collectives, send the carry on):
        (outputs, head), the first `head` of them the logits or the carry, the rest the present state."""
        import torch

        b, t = ids.shape
        feeds = []
        for s in self.schedule:
            if s["op"] == "recv":
                feeds = self.recv([(b, t, self.cfg.hidden_size)] * len(s["tensors"]), s["from"])
        if self.p.first:
            feeds = [ids]
        feeds = [*feeds, mask, *past]
        if self.plan.mesh.group > 1:
            feeds.append(torch.tensor(self.p.experts[0], dtype=torch.int64))
        if self.p.tp > 1:
            feeds.append(torch.tensor(self.p.tensor, dtype=torch.int64))
        self.expect_collectives()
        head = 1 if self.p.last else len(next(s for s in self.schedule if s["op"] == "send")["tensors"])
        outs = self.run_graph(feeds, head)
        if self._calls:
            raise RuntimeFault(f"rank {self.p.rank}: the library skipped collectives of its schedule {self._calls}")
        for s in self.schedule:
            if s["op"] == "send":
                self.send(outs[:head], s["to"])
        return outs, head

    def whole_logits(self, logits):
        """The logits of the whole vocabulary on the token source, from each rank's vocabulary slice (tp > 1: the
        ranks of the source's tensor-parallel group gather theirs there in t order, sharding/tensor.py); as they
        are at tp = 1, None on a rank of that group that is not the source. Every rank of the group calls it."""
        import torch

        pieces = self.gathered(logits)
        return torch.cat(pieces, dim=-1) if isinstance(pieces, list) else pieces

    def gathered(self, logits, argmax: bool = False):
        """`logits` as they are where the schedule has no gather (tp = 1); else each rank's piece at the token
        source in t order, a list (None on the others): its vocabulary slice's logits, or with `argmax` only its
        greedy candidate per row (sharding/tensor.slice_argmax, ARGMAX_BYTES a row)."""
        import torch
        import torch.distributed as dist

        from k3compile.sharding.tensor import slice_argmax, vocab_slice

        gather = next((s for s in self.schedule if s["op"] == "gather"), None)
        if gather is None:
            return logits
        piece = (slice_argmax(logits, vocab_slice(self.cfg, self.p.tensor, self.p.tp)[0]) if argmax
                 else logits.float().contiguous())
        source = gather["to"]
        if self.p.rank != source:
            self.stats.add("gather", piece.numel() * piece.element_size())
        pieces = [torch.empty_like(piece) for _ in gather["group"]] if self.p.rank == source else None
        self._talk("gathering the logits", gather["group"], dist.gather, piece, pieces, dst=source,
                   group=self.tp_group)
        return pieces

    def step(self, ids, mask, past: list, pick, rows: list[tuple[int, int, int]], pick_across=None):
        """One token's step: ids and mask are this rank's rows, `rows` every token source's (first, end, padded)
        rows within the replica. Returns (the replica's next tokens, present). The token source picks the tokens
        with `pick(the whole vocabulary's logits)`, or with tp > 1 and `pick_across` (greedy decoding) with
        `pick_across(the tp ranks' argmax rows)`: a distributed argmax, which gathers ARGMAX_BYTES a row instead of
        each slice's logits (docs/architecture.md, "Tensor parallelism"). Micro-batches run in `decode_micro`."""
        import torch

        outs, head = self.forward(ids, mask, past)
        last = self.picked(outs[0][:, -1], pick, pick_across) if self.p.last else None
        nxt = torch.empty(rows[-1][1], dtype=torch.int64)
        for s, (lo, hi, padded) in zip(self.sources, rows):
            buf = torch.empty(padded, dtype=torch.int64)
            if self.p.rank == s:
                buf.copy_(last)
            self.broadcast(buf, s)
            nxt[lo:hi] = buf[:hi - lo]
        return nxt, outs[head:]

    def picked(self, last, pick, pick_across=None):
        """The last stage's rows' next tokens from their last logits [rows, vocab slice] (every rank of the
        source's tp group calls it): a tensor on a token source, None elsewhere."""
        if pick_across is not None:
            pieces = self.gathered(last, argmax=True)  # a list on the source: the tp ranks' argmax rows
            if isinstance(pieces, list):
                return pick_across(pieces)
            return pick(pieces) if pieces is not None and self.p.rank in self.sources else None  # tp = 1: no gather
        whole = self.whole_logits(last)
        return pick(whole) if whole is not None and self.p.rank in self.sources else None

    def decode_micro(self, prompts: list[list[int]], max_new_tokens: int, pad: int, eos: int | None, past: list,
                     own: tuple[int, int, int], rows: list[tuple[int, int, int]], micro_batches: int, pick,
                     pick_across=None, on_step=None):
        """`run --micro-batches M` (M > 1): decoding.decode_loop's rows, tokens and timings, with the stages
        pipelined across steps (docs/architecture.md, "Micro-batches"). The rank's rows (`own`: first, end, padded,
        within the replica) run as M contiguous micro-batches (even_slices; every rank of the replica splits its
        rows alike), each its own recv / run / send, so stage s runs micro-batch m while stage s + 1 runs m - 1.
        The token sources pick and broadcast each micro-batch's tokens as soon as it has run (asynchronously), and
        the first stage waits for micro-batch m's tokens only when the next step reaches m: a step never drains the
        pipeline, where one broadcast of every row's tokens at the end of the step left the first stage idle while
        the last ran its last micro-batch. Each micro-batch keeps its own state from step to step (MicroStates).
        Every rank decides the next step from the tokens it has (those of two steps back): when every row has
        ended, at most one step more runs, whose tokens are dropped as decode_loop drops a finished row's.
        Returns (Generation, the present MicroStates). `pick(logits, index)`, `pick_across(pieces, index)`."""
        import numpy as np
        import torch

        from k3compile.decoding import StepClock, left_pad
        from k3compile.sharding.plan import even_slices

        lo, hi, padded = own
        parts = [(a, b) for a, b in even_slices(padded, micro_batches) if b > a]
        sources = list(zip(self.sources, rows))
        states = MicroStates([t[a:b] for t in past] for a, b in parts)
        ids, mask = (torch.from_numpy(x) for x in left_pad(prompts, pad))
        n_rows = len(prompts)
        out: list[list[int]] = [[] for _ in range(n_rows)]
        done = np.zeros(n_rows, dtype=bool)
        known = np.ones(n_rows, dtype=bool)  # the rows of `ids` that hold their token
        waiting: list[list] = []  # per micro-batch: the broadcasts of the step before, not yet taken

        def take(works) -> None:
            """The tokens of one micro-batch of the step before, into `ids` (as decode_loop keeps them)."""
            for work, buf, first, end in works:
                self._talk("the broadcast of the tokens", [w for w, _ in sources], work.wait)
                for row, token in zip(range(first, end), buf.tolist()):
                    token = pad if done[row] else token
                    if not done[row]:
                        out[row].append(token)
                    done[row] |= eos is not None and token == eos
                    ids[row, 0] = token
                    known[row] = True

        clock, index = StepClock(), 0
        while index < max_new_tokens and not done.all():
            self.stats.counting = "prefill" if index == 0 else "decode"
            if index:
                ids, known[:] = ids[:, -1:].clone(), False
                mask = torch.cat([mask, torch.ones(n_rows, 1, dtype=mask.dtype)], dim=1)
            sent = []
            for k, (a, b) in enumerate(parts):
                if index:
                    take(waiting[k])
                if not known[lo + a:min(lo + b, hi)].all():
                    raise RuntimeFault(f"rank {self.p.rank}: micro-batch {k}'s tokens did not arrive before its step")
                outs, head = self.forward(own_rows(ids, lo, hi, padded)[a:b], own_rows(mask, lo, hi, padded)[a:b],
                                          states[k])
                states[k] = outs[head:]
                last = None
                if self.p.last:
                    last = self.picked(outs[0][:, -1], lambda x, i=index: pick(x, i),
                                       None if pick_across is None else lambda x, i=index: pick_across(x, i))
                works = []
                for s, (s_lo, s_hi, _) in sources:
                    buf = last.to(torch.int64).contiguous() if self.p.rank == s else torch.empty(b - a,
                                                                                              dtype=torch.int64)
                    works.append((self.broadcast_async(buf, s), buf, s_lo + a, min(s_lo + b, s_hi)))
                sent.append(works)
            waiting = sent
            clock.stepped(index, on_step)
            index += 1
        for works in waiting:  # the last step's tokens
            take(works)
        return clock.generation(out), states


class MicroStates(list):
    """A rank's decode state as one flat state per micro-batch, in row order (Rank.decode_micro)."""

    def joined(self, host) -> list:
        """The whole state, each tensor's micro-batches joined by rows in host memory (`host`: Rank.host)."""
        import torch

        return [torch.cat([host(t) for t in ts]) for ts in zip(*self)]


def wire_rows(rows, dispatch: bool):
    """All-to-all rows as `--wire-dtype bf16` sends them: the latent vectors rounded to bf16; a dispatch row's expert
    id and weight (its last two fp32 columns) as their bits, four bf16 halves, so the ids stay exact."""
    import torch

    if not dispatch:
        return rows.to(torch.bfloat16)
    return torch.cat([rows[:, :-2].to(torch.bfloat16), rows[:, -2:].contiguous().view(torch.bfloat16)], dim=1)


def host_rows(buf, dispatch: bool):
    """wire_rows' inverse: fp32 rows (the vectors widened, the id and weight bits as they were)."""
    import torch

    if not dispatch:
        return buf.float()
    bits = buf[:, -4:].reshape(-1).clone().view(torch.float32)  # a fresh 1-D copy: any row count, any offset
    return torch.cat([buf[:, :-4].float(), bits.reshape(-1, 2)], dim=1)


def process_groups(plan, timeout) -> tuple[dict, dict, dict]:
    """Every group of the mesh, made in one order by every process of the world (torch.distributed's rule: a
    server's controller makes them too): ({(replica, stage): its group of ep · tp ranks}, {(replica, stage, e): its
    tensor-parallel group} (tp > 1), {replica: its group})."""
    import torch.distributed as dist

    mesh, ep, tp, replicas = plan.mesh, {}, {}, {}
    for d in range(mesh.dp):
        for s in range(mesh.pp):
            ep[d, s] = dist.new_group([mesh.rank(d, s, g) for g in range(mesh.group)], timeout=timeout)
            for e in range(mesh.ep if mesh.tp > 1 else 0):
                tp[d, s, e] = dist.new_group(plan.tp_group(mesh.rank(d, s, e * mesh.tp)), timeout=timeout)
        replicas[d] = dist.new_group(plan.replica_group(d), timeout=timeout)
    return ep, tp, replicas


def own_rows(t, lo: int, hi: int, padded: int):
    """Rows [lo, hi) of t, padded to `padded` by repeating the last (the group's static row count: rank_rows)."""
    import torch

    part = t[lo:hi]
    return torch.cat([part, part[-1:].expand(padded - len(part), *part.shape[1:])]) if len(part) < padded else part


def _tvm(x):
    """A TVM view of a torch tensor (DLPack, no copy) when TVM can take it as it is (aligned, not empty)."""
    import tvm

    x = x.contiguous()
    if x.numel() and x.data_ptr() % 64 == 0:
        return tvm.runtime.from_dlpack(x)
    return tvm.runtime.tensor(x.numpy(), tvm.cpu())


def decode(folder: str | Path, options: Options, rank: int, world: int, store) -> dict:
    """This rank's whole run in a gloo world met through `store` (runtime/rendezvous.py): returns every rank's
    result (each rank gets them all; rank 0's launcher reports them)."""
    import torch
    import torch.distributed as dist

    from k3compile.decoding import Sampler
    from k3compile.generate import check_request, decode_loop, pick_next
    from k3compile.interface import init_past
    from k3compile.ops.collectives import set_collective
    from k3compile.sharding.tensor import join_argmax
    from k3compile.threads import use_threads

    if options.threads:
        use_threads(options.threads)  # before TVM's pool starts (Rank._load)
    torch.set_num_threads(1)  # a rank's model runs in TVM; torch only glues (threads.glue_threads)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=options.start_timeout))  # joining: start-up
    try:
        me = Rank(Path(folder), rank, world, options)
        loaded(store, rank, world, options)  # no collective waits on a rank that is still loading
        me.started(options.timeout)
        cfg, p = me.cfg, me.p
        if options.progress:
            print(f"rank {rank} (pid {os.getpid()}, {socket.gethostname()}): layers [{p.layers[0]}, {p.layers[1]}), "
                  f"experts [{p.experts[0]}, {p.experts[1]})", file=sys.stderr, flush=True)
        check_request(cfg, options.prompts, options.max_new_tokens, options.temperature, options.top_p)
        plan, batch = me.plan, len(options.prompts)
        sources = [plan.rank_rows(batch, r) for r in plan.token_sources(p.replica)]
        if any(hi == lo for lo, hi, _ in sources):
            raise RuntimeFault(f"mesh {plan.mesh} with {plan.dispatch} dispatch needs a batch of at least "
                               f"{len(sources) * plan.mesh.dp} prompts")
        first, end = sources[0][0], sources[-1][1]  # this replica's rows
        rows = [(lo - first, hi - first, padded) for lo, hi, padded in sources]
        own_lo, own_hi, padded = plan.rank_rows(batch, rank)

        def mine(t):
            """This rank's rows of a replica tensor, padded to the group's count by repeating its last row."""
            return own_rows(t, own_lo - first, own_hi - first, padded)

        prompts = options.prompts[first:end]
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        past = [t for state in init_past(me.state_cfg, padded)[slice(*p.layers)] for t in state]
        sampler = Sampler(options.temperature, options.top_p, options.seed)
        greedy = sampler.greedy  # pick_next's argmax: with tp > 1 a distributed one (Rank.picked)

        def pick(logits, index):
            if not bool(torch.isfinite(logits).all()):
                raise RuntimeFault(f"rank {rank}: non-finite logits at step {index}; check the weights")
            return pick_next(logits, sampler)

        def pick_across(pieces, index):  # greedy with tp > 1: the tp ranks' argmax rows (sharding/tensor.py)
            tokens, finite = join_argmax(pieces)
            if not finite:
                raise RuntimeFault(f"rank {rank}: non-finite logits at step {index}; check the weights")
            return tokens

        def step(all_ids, all_mask, index):  # the replica's batch in; this rank runs its rows, the replica's
            nonlocal past                     # tokens come back from the last stage (Rank.step, M = 1)
            me.stats.counting = "prefill" if index == 0 else "decode"
            nxt, past = me.step(mine(all_ids), mine(all_mask), past, lambda x: pick(x, index), rows,
                                (lambda x: pick_across(x, index)) if greedy else None)
            return nxt

        def on_step(index):
            if options.progress and rank == 0:
                print(f"step {index + 1}/{options.max_new_tokens}", file=sys.stderr, flush=True)

        set_collective(me.collective)
        if options.micro_batches > 1:  # the stages pipelined across steps
            decoded, past = me.decode_micro(prompts, options.max_new_tokens, pad, cfg.eos_token_id, past,
                                            (own_lo - first, own_hi - first, padded), rows, options.micro_batches,
                                            pick, pick_across if greedy else None, on_step)
        else:
            decoded = decode_loop(step, prompts, options.max_new_tokens, pad, cfg.eos_token_id, on_step)
        set_collective(None)
        if options.states_dir:
            import numpy as np

            names = [n for n in me.entry["inputs"] if n.startswith("past.")]
            np.savez(Path(options.states_dir) / f"states.rank{rank}.npz",
                     **{n: me.host(t).numpy() for n, t in
                        zip(names, past.joined(me.host) if isinstance(past, MicroStates) else past)})
        result = {"rank": rank, "replica": p.replica, "rows": [first, end], "own_rows": [own_lo, own_hi],
                  "padded_rows": padded, "tokens": decoded.tokens, "prefill_s": decoded.prefill_s,
                  "decode_s": decoded.decode_s, "decode_steps": decoded.decode_steps,
                  "bytes_prefill": dict(me.stats.prefill), "bytes_decode": dict(me.stats.decode),
                  "wire": options.wire, "greedy": greedy}
        return gather_json(result, world)  # after decode: not counted
    finally:
        dist.destroy_process_group()


def loaded(store, rank: int, world: int, options: Options, poll: float = 0.05) -> None:
    """Say this rank has loaded, then wait until all `world` ranks have: loading a large shard takes minutes and
    varies by rank, so it is bounded by `start_timeout` (as joining the world is), not by the collectives'
    `timeout`, which then bounds every wait of the decode (Rank.started). A node whose rank failed meanwhile (its
    key NODE_FAILED + n) ends the wait with its line."""
    store.set(f"{LOADED}{rank}", "1")
    keys = [f"{LOADED}{r}" for r in range(world)]
    deadline = time.monotonic() + options.start_timeout
    while not store.check(keys):
        failed = node_failure(store, options.nnodes)
        if failed is not None:
            raise RuntimeFault(f"rank {rank}: the ranks stopped while loading ({failed[:300]})")
        if time.monotonic() > deadline:
            late = [r for r in range(world) if not store.check([f"{LOADED}{r}"])]
            raise RuntimeFault(f"rank {rank}: rank(s) {late[:8]} did not load within --start-timeout "
                               f"{options.start_timeout:g} s")
        time.sleep(poll)


def collective_timeout(groups, timeout: float) -> None:
    """Every group of `groups` this process belongs to (None: the default group) waits at most `timeout` seconds in a
    collective from now on. The groups were made with the start-up bound, which their joining honours (processes of
    a large mesh start and connect unevenly); torch sets a gloo group's wait apart from its joining only through its
    private `_set_pg_timeout` (torch 2.13, pinned)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout

    delta = datetime.timedelta(seconds=timeout)
    for g in groups:
        if g is None or (g is not dist.GroupMember.NON_GROUP_MEMBER and not _rank_not_in_group(g)):
            _set_pg_timeout(delta, g)


def report_failure(store, node: int, line: str) -> None:
    """A node's launcher: its failure's line into the run's store, for the other nodes and a server."""
    store.set(f"{NODE_FAILED}{node}", line)
    store.add(ANY_FAILED, 1)  # after the line: whoever sees the count finds it


def node_failure(store, nnodes: int) -> str | None:
    """"node n: <its line>" of the first node that reported a failure (report_failure), or None."""
    if not store.check([ANY_FAILED]):
        return None
    for n in range(nnodes):
        key = f"{NODE_FAILED}{n}"
        if store.check([key]):
            return f"node {n}: {store.get(key).decode(errors='replace')[:400]}"
    return None


# ---- a server's rank (docs/architecture.md, "Serving a sharded artifact") ------------------------------------------
# The controller (backends/sharded.py, the world's last rank) broadcasts a header of HEADER int64s over the world's
# default group: (command, slot, slot out, rows, tokens, past length, keep); then, by command:
#   STEP: ids [rows, tokens] and the mask broadcast: with keep 0 the whole [rows, past + tokens], with keep 1 only
#         its new columns [rows, tokens], appended to the mask the ranks kept with `slot` (an empty one for -1);
#         every rank runs its part of the step on the state in `slot` (-1: an empty state) and keeps the present and
#         the mask in `slot out`; each token source sends the controller the last position's logits of its own rows.
#   STEP_ALL: as STEP, but the token sources send the logits of every position [rows, tokens, vocab] (verify).
#   PUT:  the controller sends every rank its rows of a state (its layers, padded as own_rows pads), kept in `slot`.
#   GET:  every rank that holds rows (holds_rows) sends the controller its own rows of `slot`'s state.
#   FREE: `slot` is dropped.  NOOP: nothing (the controller's keep-alive).  STOP: the rank exits 0.
# Rows are the physical batch the controller pads to (at least one row per token source of every replica); a rank's
# part is plan.rank_rows(rows, rank). Nothing crosses but tensors of shapes both sides derive from the header.
HEADER = 7
STOP, NOOP, FREE, PUT, GET, STEP, STEP_ALL = range(7)
EMPTY = -1  # the slot of a state no token has entered
READY, GO = "k3compile/serve/ready/", "k3compile/serve/go"  # the store's keys of the start


def holds_rows(plan, r: int) -> bool:
    """Whether rank r's rows of the state are its own: every shard with all-to-all dispatch, else each stage's first
    tensor-parallel group (the others of the stage hold the same rows; with tp > 1 each of the first group holds
    its heads' share: sharding/tensor.py, state_piece)."""
    return plan.dispatch == "all_to_all" or plan.mesh.coords(r)[2] < plan.mesh.tp


def state_shapes(cfg, layers: tuple[int, int], rows: int, length: int) -> list[tuple[int, ...]]:
    """The shapes of layers [a, b)'s decode state (flat, two tensors a layer) for `rows` rows after `length` tokens."""
    from k3compile.interface import init_past

    shapes = []
    for i, pair in enumerate(init_past(cfg, 1)[layers[0]:layers[1]], start=layers[0]):
        for t in pair:
            shape = [rows, *t.shape[1:]]
            if cfg.is_mla(i):
                shape[1] = length
            shapes.append(tuple(shape))
    return shapes


def serve_rank(folder: str | Path, options: Options, rank: int, world: int, store) -> None:
    """This rank in a server's world until the controller says STOP (the protocol above)."""
    import torch
    import torch.distributed as dist

    from k3compile.ops.collectives import set_collective
    from k3compile.threads import use_threads

    if options.threads:
        use_threads(options.threads)
    torch.set_num_threads(1)  # as in decode
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=options.start_timeout))  # joining: start-up
    try:
        me = Rank(Path(folder), rank, world, options)
        cfg, plan, p, ctl = me.state_cfg, me.plan, me.p, world - 1
        store.set(f"{READY}{rank}", "1")  # loaded; the controller says go when every rank is (loading takes long)
        store.wait([GO], datetime.timedelta(seconds=options.start_timeout))
        me.started(options.timeout)
        set_collective(me.collective)
        slots: dict[int, list] = {}
        masks: dict[int, torch.Tensor] = {}  # each slot's attention mask, all rows [rows, past]
        header = torch.zeros(HEADER, dtype=torch.int64)
        sources = set(plan.token_sources(p.replica))
        with torch.no_grad():
            while True:
                me._talk("waiting for the controller", [ctl], dist.broadcast, header, src=ctl)
                cmd, slot, out, rows, tokens, length, keep = (int(x) for x in header)
                if cmd == STOP:
                    return
                if cmd in (NOOP, FREE):
                    slots.pop(slot, None)
                    masks.pop(slot, None)
                    continue
                lo, hi, padded = plan.rank_rows(rows, rank)
                if cmd == PUT:
                    slots[slot] = me.recv(state_shapes(cfg, p.layers, padded, length), ctl)
                    masks.pop(slot, None)
                elif cmd == GET:
                    if holds_rows(plan, rank):
                        me.send([me.host(t)[:hi - lo] for t in slots[slot]], ctl)
                elif cmd in (STEP, STEP_ALL):
                    ids = torch.empty(rows, tokens, dtype=torch.int64)
                    mask = torch.empty(rows, tokens if keep else length + tokens, dtype=torch.int64)
                    for t in (ids, mask):
                        me._talk("receiving a step", [ctl], dist.broadcast, t, src=ctl)
                    if keep:
                        kept = masks[slot] if slot != EMPTY else torch.zeros(rows, 0, dtype=torch.int64)
                        mask = torch.cat([kept, mask], dim=1)
                    masks[out] = mask
                    past = slots[slot] if slot != EMPTY else [
                        torch.zeros(s) for s in state_shapes(cfg, p.layers, padded, 0)]
                    outs, head = me.forward(own_rows(ids, lo, hi, padded), own_rows(mask, lo, hi, padded), past)
                    slots[out] = outs[head:]
                    if p.last:
                        logits = me.whole_logits(outs[0][:hi - lo] if cmd == STEP_ALL else outs[0][:hi - lo, -1])
                    if rank in sources:
                        me.send([logits.float()], ctl)
                else:
                    raise RuntimeFault(f"rank {rank}: unknown command {cmd} from the controller")
    finally:
        set_collective(None)
        dist.destroy_process_group()


def gather_json(doc: dict, world: int) -> list[dict]:
    """Every rank's `doc`, on every rank, as JSON bytes over gloo (never pickles: all_gather_object unpickles what a
    peer sends)."""
    import json

    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    longest = max(int(n) for n in sizes)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, torch.cat([data, torch.zeros(longest - data.numel(), dtype=torch.uint8)]))
    return [json.loads(b[:int(n)].numpy().tobytes()) for b, n in zip(bufs, sizes)]


RUN_OPTIONS = "options.json"  # in the launcher's private run folder: what every worker of this node runs
RESULT = "result.json"  # written there by rank 0: every rank's result
ENV_RANK, ENV_WORLD = "K3COMPILE_RANK", "K3COMPILE_WORLD_SIZE"


def error_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"error.rank{rank}.json"


def write_options(run_dir: Path, folder: Path, options: Options, rendezvous) -> None:
    """What the launcher hands its workers, as JSON in its private run folder (no pickles, no command line)."""
    import json

    doc = {"folder": str(folder), "rendezvous": [rendezvous.host, rendezvous.port],
           "options": dataclasses.asdict(options)}
    (Path(run_dir) / RUN_OPTIONS).write_text(json.dumps(doc))


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when its launcher dies, however it dies (no orphan left decoding)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def main(argv: list[str] | None = None) -> None:
    """A worker process: `python -m k3compile.runtime.worker RUN_DIR`, started by runtime/launch.py with its rank in
    the environment. An error is written to RUN_DIR/error.rank<r>.json (one line for the launcher) and exits 1."""
    import json
    import traceback

    from k3compile.runtime.rendezvous import Rendezvous, join

    args = sys.argv[1:] if argv is None else argv
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        print("Error: k3compile's workers are started by `k3compile run` (for several machines: `k3compile run "
              "--nnodes N --node-rank R --rendezvous HOST:PORT` on each), not by torchrun, whose rendezvous unpickles "
              "what its store holds", file=sys.stderr)
        sys.exit(2)
    if len(args) != 1 or ENV_RANK not in os.environ:
        print("Error: this module is k3compile run's worker; use `k3compile run OUT`", file=sys.stderr)
        sys.exit(2)
    _die_with_parent()
    run_dir = Path(args[0])
    rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    try:
        doc = json.loads((run_dir / RUN_OPTIONS).read_text())
        options = Options(**doc["options"])
        host, port = doc["rendezvous"]
        store = join(Rendezvous(host, port), options.timeout)
        if options.serve:
            serve_rank(doc["folder"], options, rank, world, store)
        results = None if options.serve else decode(doc["folder"], options, rank, world, store)
        if rank == 0 and results is not None:
            tmp = run_dir / (RESULT + ".tmp")
            tmp.write_text(json.dumps(results))
            os.replace(tmp, run_dir / RESULT)
    except BaseException as e:  # noqa: B036 - every way out is reported to the launcher, then the process exits
        if isinstance(e, UserError):
            msg = str(e)
        elif isinstance(e, KeyboardInterrupt):
            msg = "interrupted"
        else:
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        msg = msg if msg.startswith(f"rank {rank}:") else f"rank {rank}: {msg}"
        try:
            error_file(run_dir, rank).write_text(json.dumps({"message": msg, "traceback": traceback.format_exc()}))
        except OSError:
            print(f"Error: {msg}", file=sys.stderr)
        sys.stdout.flush()
        os._exit(1)  # a store client stuck on a silent listener is a thread that would keep the process alive
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
