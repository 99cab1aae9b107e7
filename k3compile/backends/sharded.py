"""A sharded OUT as one backend (docs/architecture.md, "Serving a sharded artifact"): what `k3compile serve` runs
when SOURCE is `export --mesh`'s folder.

The backend is the controller of its ranks: it checks the whole artifact (manifest.read_sharded), hosts a store on
127.0.0.1, starts one worker per rank on this machine (runtime/launch.py's `spawn`, the workers in serve mode:
runtime/worker.py's `serve_rank`) and joins their gloo world as its last rank. Every step it broadcasts a command
header and the batch's ids and mask; the ranks run their layers as `k3compile run` does and keep the present state
in a numbered slot, so a decode step moves only the tokens in and each row's last logits out (the engine samples
them per request). The state comes to this process only when the engine asks for it on the host (a row joining or
leaving the batch, a prefix-cache snapshot: `host_past`) and goes back with the next step (PUT), as a GPU executor's
state does. A state held by the ranks is a `RankState`; when the engine drops one, its slot is freed with the next
command.

The batch the ranks see is padded to at least one row per token source of every replica (a mesh with data-parallel
replicas or all-to-all dispatch splits rows between ranks); the padding rows repeat the last row and their logits
are never read. While the engine is idle a keep-alive command goes out every third of the timeout, so a rank's wait
is bounded by the timeout and a rank that died is noticed. One controller per process (it owns torch.distributed's
default group).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from k3compile.interface import Past, init_past, past_length
from k3compile.runtime.worker import (
    DEFAULT_TIMEOUT,
    EMPTY,
    FREE,
    GET,
    GO,
    HEADER,
    NOOP,
    PUT,
    READY,
    START_S,
    STEP,
    STEP_ALL,
    STOP,
    Options,
    RuntimeFault,
    collective_timeout,
    holds_rows,
    own_rows,
    process_groups,
    state_shapes,
    write_options,
)
from k3compile.sharding.tensor import rank_config, state_join, state_piece


@contextlib.contextmanager
def _gloo_interface(name: str):
    """GLOO_SOCKET_IFNAME set to `name` while this process's gloo groups are made (each reads it then; the ranks get
    it from runtime/launch.py's environment): gloo listens on that interface, not on what the host name resolves to."""
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def _fresh_world() -> None:
    """Name this process's next world as a fresh worker names its: torch names a process's groups by a count of the
    groups it has made, which destroying the world resets but a world that failed to start leaves raised, so every
    later world of this process would wait for keys its new ranks never write (a server restarted in one process
    could then never start again). Only when no world exists."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if not dist.is_initialized() and getattr(world, "group_count", 0):
        world.group_count = 0


class RankState:
    """A decode state the ranks hold in `slot`, for `rows` rows after `length` tokens."""

    def __init__(self, backend: ShardedBackend, slot: int, rows: int, length: int,
                 mask: Tensor | None = None) -> None:
        self.backend, self.slot, self.rows, self.length = backend, slot, rows, length
        self.host: Past | None = None  # fetched once (host_past)
        self.mask = mask  # the attention mask [rows, length] the ranks keep with the slot (None: they keep none)
        if slot != EMPTY:
            weakref.finalize(self, backend._freed.append, slot)


class ShardedBackend:
    def __init__(self, folder: str | Path, threads: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                 devices: tuple[int, ...] = (), progress: Callable[[str], None] | None = None,
                 wire: str = "fp32", rendezvous=None, start_timeout: float = START_S) -> None:
        """`wire`: the all-to-all dispatch's vectors on the wire (as `run --wire-dtype`). `rendezvous` (a
        runtime.rendezvous.Rendezvous of node 0): the ranks spread over its nnodes machines, this one starting its
        share (the others: `k3compile serve OUT --node-rank R` there, runtime/launch.serve_node) and hosting the
        store on its address; default: every rank here, the store on 127.0.0.1. `start_timeout`: seconds the ranks
        may take to load (`--start-timeout`; `timeout` bounds every wait after that)."""
        import torch.distributed as dist

        from k3compile.manifest import read_sharded
        from k3compile.runtime.launch import check_wire, node_options, node_share, spawn
        from k3compile.runtime.rendezvous import Rendezvous, RendezvousError, host_store, interface_of

        step = progress or (lambda msg: None)
        folder = Path(folder)
        if dist.is_initialized():
            raise RuntimeFault("this process already belongs to a torch.distributed world; one sharded backend a "
                               "process")
        step("checking the artifact")
        doc, self.config, self.plan = read_sharded(folder)
        check_wire(self.plan, wire, folder)
        mesh = self.plan.mesh
        self._state_cfg = rank_config(self.config, mesh.tp)  # a rank's heads: its state's shapes
        self.ctl = mesh.size  # this process's rank: the world's last
        self.name = f"{doc['target']} over {mesh.size} ranks (mesh {mesh}, {self.plan.dispatch} dispatch)"
        self.timeout, self.start_timeout = timeout, start_timeout
        # the fewest rows every rank has one of: every replica's token sources (runtime/launch.py's rule)
        self.min_rows = mesh.dp * len(self.plan.token_sources(0))
        self._lock = threading.Lock()
        self._freed: deque[int] = deque()
        self._next_slot = 0
        self.failure: str | None = None
        self._last = time.monotonic()
        self._closed = False
        self._stopped = threading.Event()  # set by close: the keep-alive thread ends at once
        self._keeper: threading.Thread | None = None
        rdzv = rendezvous or Rendezvous()
        if rdzv.node_rank != 0:
            raise RendezvousError("the server is node 0 of its mesh's nodes; on the others run `k3compile serve OUT "
                                  "--nnodes N --node-rank R --rendezvous HOST:PORT`, which starts their ranks")
        local = node_share(self.plan, rdzv)
        self._nnodes = rdzv.nnodes
        options, device_env = node_options(doc, Options([], 0, threads=threads, timeout=timeout, devices=devices,
                                                        wire=wire, start_timeout=start_timeout), local, rdzv,
                                           serve=True)
        self._run_dir = Path(tempfile.mkdtemp(prefix="k3compile-serve-"))  # 0700
        self._procs: dict = {}
        self._hosted = None
        try:
            self._hosted = host_store(rdzv, mesh.size + 1, timeout)
            write_options(self._run_dir, folder.resolve(), options, self._hosted.rendezvous)
            step(f"starting {len(local)} ranks" + (f" (ranks {local.stop}..{mesh.size - 1} join from "
                                                   f"{rdzv.nnodes - 1} more nodes at {self._hosted.rendezvous})"
                                                   if rdzv.nnodes > 1 else ""))
            self._procs = spawn(self._run_dir, local, mesh.size + 1, options.threads,
                                interface_of(self._hosted.rendezvous), device_env)
            delta = datetime.timedelta(seconds=start_timeout)  # joining: the start-up bound (collective_timeout)
            _fresh_world()
            with _gloo_interface(interface_of(self._hosted.rendezvous)):  # as the ranks': loopback, nothing beyond
                self._joined(lambda: dist.init_process_group("gloo", store=self._hosted.store, rank=self.ctl,
                                                             world_size=mesh.size + 1, timeout=delta))
                self._joined(lambda: process_groups(self.plan, delta))
                self._work = self._joined(lambda: dist.new_group(list(range(mesh.size + 1)), timeout=delta))
            step("loading the ranks' libraries")
            self._wait_ready()
            collective_timeout([None, self._work], timeout)  # its groups: the world and the work group
        except BaseException:
            self.close()
            raise
        self._keeper = threading.Thread(target=self._keep_alive, name="k3compile-keepalive", daemon=True)
        self._keeper.start()

    # ---- the Backend protocol (backends/base.py) -------------------------------------------------------------------

    def init_past(self, batch: int) -> RankState:
        return RankState(self, EMPTY, batch, 0, torch.zeros(batch, 0, dtype=torch.int64))

    def step(self, input_ids: Tensor, attention_mask: Tensor, past) -> tuple[Tensor, RankState]:
        """Every position's logits [B, T, V] (what verify compares; generation and serving take step_last)."""
        return self._step(input_ids, attention_mask, past, every=True)

    def step_last(self, input_ids: Tensor, attention_mask: Tensor, past) -> tuple[Tensor, RankState]:
        """Each row's last logits only, [B, 1, V]: all that crosses from the ranks."""
        return self._step(input_ids, attention_mask, past, every=False)

    def _step(self, input_ids: Tensor, attention_mask: Tensor, past, every: bool) -> tuple[Tensor, RankState]:
        import torch.distributed as dist

        rows, tokens = input_ids.shape
        with self._lock:
            self._check()
            self._flush()
            if isinstance(past, RankState):
                if past.backend is not self or past.rows != rows:
                    raise ValueError(f"a state of {past.rows} rows for a batch of {rows}")
                state, length = past, past.length
            else:
                length = past_length(self.config, past)
                state = self._put(past, rows, length)
            if attention_mask.shape != (rows, length + tokens):
                raise ValueError(f"attention mask {tuple(attention_mask.shape)} for {rows} rows of {length} + "
                                 f"{tokens} tokens")
            padded = max(rows, self.min_rows)
            out = self._slot()
            mask = attention_mask.to(torch.int64, copy=True)  # kept with the state: a caller may reuse its tensor
            # the ranks keep each slot's mask: a step whose mask extends it sends only its new columns, so a decode
            # step moves the tokens in, not the whole context's mask (the check is on this host, no traffic)
            keep = state.mask is not None and torch.equal(state.mask, mask[:, :length])
            self._command(STEP_ALL if every else STEP, state.slot, out, padded, tokens, length, int(keep))
            for t in (input_ids.to(torch.int64), mask[:, length:] if keep else mask):
                self._talk(dist.broadcast, own_rows(t, 0, rows, padded).contiguous(), src=self.ctl)
            logits = torch.empty(padded, tokens if every else 1, self.config.vocab_size)
            for d in range(self.plan.mesh.dp):
                for r in self.plan.token_sources(d):
                    lo, hi, _ = self.plan.rank_rows(padded, r)
                    self._talk(dist.recv, logits[lo:hi] if every else logits[lo:hi, 0], src=r, group=self._work)
            self._last = time.monotonic()
            return logits[:rows], RankState(self, out, rows, length + tokens, mask)

    def host_past(self, past) -> Past:
        """The state in this process's memory (fetched from the ranks once)."""
        import torch.distributed as dist

        if not isinstance(past, RankState):
            return past
        if past.host is not None:
            return past.host
        if past.slot == EMPTY:
            past.host = init_past(self.config, past.rows)
            return past.host
        padded = max(past.rows, self.min_rows)
        full = [torch.empty(s) for s in state_shapes(self.config, (0, self.config.num_hidden_layers), padded,
                                                      past.length)]
        pieces: dict[tuple[int, int, int], list[Tensor]] = {}  # (flat index, rows) -> the tp ranks' pieces, in t order
        with self._lock:
            self._check()
            self._flush()
            self._command(GET, past.slot, 0, padded, 0, past.length)
            for r in range(self.plan.mesh.size):
                if holds_rows(self.plan, r):
                    p = self.plan.rank(r)
                    lo, hi, _ = self.plan.rank_rows(padded, r)
                    shapes = state_shapes(self._state_cfg, p.layers, hi - lo, past.length)
                    for j, shape in enumerate(shapes, start=2 * p.layers[0]):
                        t = torch.empty(shape)
                        self._talk(dist.recv, t, src=r, group=self._work)
                        pieces.setdefault((j, lo, hi), []).append(t)
            self._last = time.monotonic()
        for (j, lo, hi), got in pieces.items():
            full[j][lo:hi] = state_join(self.config, j // 2, j % 2, got)
        past.host = [(full[2 * i][:past.rows], full[2 * i + 1][:past.rows])
                     for i in range(self.config.num_hidden_layers)]
        return past.host

    def close(self) -> None:
        """STOP the ranks, leave the world, end the workers (SIGTERM, then SIGKILL), remove the run folder and end the
        keep-alive thread. Every gloo group of this process is gone when it returns: torch releases the GIL while a
        group's threads are joined, and a thread that takes it back while the interpreter is finalizing aborts the
        process (runtime/rendezvous.py), so none may be left for a late thread or the exit to destroy."""
        import torch.distributed as dist

        from k3compile.runtime.launch import stop_all

        if self._closed:
            return
        self._closed = True
        self._stopped.set()
        with self._lock:
            if dist.is_initialized():
                if self.failure is None:
                    try:
                        self._command(STOP, 0, 0, 0, 0, 0)
                    except RuntimeFault:
                        pass
                dist.destroy_process_group()
            self._work = None  # its gloo threads end here, not in whichever thread drops this object last
            stop_all(self._procs)
            shutil.rmtree(self._run_dir, ignore_errors=True)
            if self._hosted is not None:
                self._hosted.close()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join()  # no thread of ours is left to wake into a finalizing interpreter

    # ---- the protocol's side here (runtime/worker.py, "a server's rank") -------------------------------------------

    def _put(self, past: Past, rows: int, length: int) -> RankState:
        """Send every rank its rows of a host state (padded as the ranks pad them); a RankState for it."""
        import torch.distributed as dist

        padded = max(rows, self.min_rows)
        flat = [own_rows(t, 0, rows, padded) for pair in past for t in pair]
        state = RankState(self, self._slot(), rows, length)
        self._command(PUT, state.slot, 0, padded, 0, length)
        for r in range(self.plan.mesh.size):
            p = self.plan.rank(r)
            lo, hi, n = self.plan.rank_rows(padded, r)
            for j, t in enumerate(flat[2 * p.layers[0]:2 * p.layers[1]], start=2 * p.layers[0]):
                piece = state_piece(self.config, j // 2, j % 2, own_rows(t, lo, hi, n), p.tensor, p.tp)
                self._talk(dist.send, piece.float().contiguous(), dst=r, group=self._work)
        return state

    def _slot(self) -> int:
        self._next_slot += 1
        return self._next_slot

    def _flush(self) -> None:
        while self._freed:
            self._command(FREE, self._freed.popleft(), 0, 0, 0, 0)

    def _command(self, *fields: int) -> None:
        import torch.distributed as dist

        header = torch.tensor(fields + (0,) * (HEADER - len(fields)), dtype=torch.int64)
        self._talk(dist.broadcast, header, src=self.ctl)

    def _talk(self, fn, *args, **kw):
        """A collective with the ranks; a failure (a dead rank, a timeout) names the rank that failed first, and the
        backend refuses every later step with that line."""
        try:
            return fn(*args, **kw)
        except (RuntimeError, OSError) as e:
            self.failure = self._cause() or f"the ranks stopped answering ({str(e).strip()[:200]})"
            raise RuntimeFault(self.failure) from None

    def _joined(self, fn):
        """A step of joining the ranks' world; a rank that exits meanwhile is named instead of a timeout."""
        try:
            return fn()
        except (RuntimeError, OSError, ValueError) as e:
            raise RuntimeFault(self._cause() or f"the ranks did not start ({str(e).strip()[:200]})") from None

    def _wait_ready(self) -> None:
        """Until every rank has loaded (its key in the store), then GO; a rank that exits meanwhile is named."""
        from k3compile.runtime.launch import exit_code

        keys = [f"{READY}{r}" for r in range(self.plan.mesh.size)]
        deadline = time.monotonic() + self.start_timeout
        while not self._hosted.store.check(keys):
            if any(exit_code(p) is not None for p in self._procs.values()):
                raise RuntimeFault(self._cause() or "a rank exited while loading")
            remote = self._node_failure()
            if remote is not None:
                raise RuntimeFault(remote)
            if time.monotonic() > deadline:
                raise RuntimeFault(f"the ranks did not load their libraries within --start-timeout "
                                   f"{self.start_timeout:g} s")
            time.sleep(0.05)
        self._hosted.store.set(GO, "1")
        self._last = time.monotonic()

    def _cause(self) -> str | None:
        from k3compile.runtime.launch import SETTLE_S, exit_code, failure_line

        deadline = time.monotonic() + SETTLE_S
        while True:  # over several nodes the whole settle time: another node's line may come after a local one
            failed = {r: c for r, p in self._procs.items() if (c := exit_code(p)) not in (None, 0)}
            if (failed and self._nnodes == 1) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        remote = self._node_failure()
        lines = ([failure_line(failed, self._run_dir)] if failed else []) + ([remote] if remote else [])
        # the cause, not a rank that only saw its peer go ("... with rank(s) [r] failed")
        return next((line for line in lines if "with rank(s)" not in line), lines[0] if lines else None)

    def _node_failure(self) -> str | None:
        """The line another node's launcher left in the store when its ranks failed (runtime/launch.serve_node)."""
        from k3compile.runtime.worker import node_failure

        store = getattr(self._hosted, "store", None)
        try:
            return None if store is None or self._nnodes == 1 else node_failure(store, self._nnodes)
        except (RuntimeError, OSError):
            return None

    def _check(self) -> None:
        if self._closed:
            raise RuntimeFault("the sharded backend is closed")
        if self.failure is not None:
            raise RuntimeFault(self.failure)

    def _keep_alive(self) -> None:
        """While the engine is idle, a NOOP every third of the timeout (the ranks wait at most the timeout)."""
        period = self.timeout / 3
        while not self._stopped.wait(min(period, 1.0)) and self.failure is None:
            if time.monotonic() - self._last < period:
                continue
            with self._lock:
                if self._closed or self.failure is not None:
                    return
                try:
                    self._flush()
                    self._command(NOOP, 0, 0, 0, 0, 0)
                except RuntimeFault:
                    return
                self._last = time.monotonic()
