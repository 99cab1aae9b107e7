"""`k3compile run`: start this machine's workers, watch them, and gather what they decoded (docs/architecture.md,
"Sharding and the runtime").

The whole artifact is checked first (every file's sha256, the plan against the config): a damaged one is refused
before any process starts. The launcher of node 0 hosts the run's store (runtime/rendezvous.py: bound to 127.0.0.1
on one machine, to the address `--rendezvous` names on several); each launcher starts its node's ranks as
`python -m k3compile.runtime.worker RUN_DIR` processes, RUN_DIR a private (0700) temporary folder holding their
options, their one-line errors and rank 0's result, removed at the end. The launcher watches its workers: when
one fails (an error, a kill, a timeout in a collective) it stops the others and the run ends with one line naming
the rank; SIGTERM or Ctrl-C stop them all too. Workers die with their launcher (PR_SET_PDEATHSIG), so none is ever
left behind. Over several nodes every launcher is given the request (prompts, decoding options, micro-batches): node
0 puts its own into the store as JSON and another node that was given a different one stops the run with one line
naming the options that differ (`agree_with_node_0`), where ranks decoding different requests would wait on each
other until a timeout or decode another batch. `summarize` turns the ranks' results into the tokens per prompt, the
decode speed and each rank's bytes per collective next to the plan's (runtime/report.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from k3compile.runtime.rendezvous import Rendezvous, RendezvousError, host_store, interface_of, join
from k3compile.runtime.report import summarize
from k3compile.runtime.worker import (
    ENV_RANK,
    ENV_WORLD,
    RESULT,
    Options,
    RuntimeFault,
    error_file,
    node_failure,
    report_failure,
    write_options,
)
from k3compile.sharding.plan import AUTO_MICRO_BATCHES, auto_micro_batches

log = logging.getLogger(__name__)

SHUTDOWN_S = 5  # seconds a worker has to exit on SIGTERM when the run ends, before SIGKILL
POLL_S = 0.05
OTHERS_S = 0.5  # how often a launcher of several nodes asks the store whether another node failed (_watch_node)
SETTLE_S = 0.5  # after a first failure, how long the others' reports are awaited (to name the cause, not a victim)


def default_threads(world: int) -> int:
    from k3compile.threads import available_cores

    return max(1, available_cores() // world)


def check_wire(plan, wire: str, folder) -> None:
    """`--wire-dtype` other than fp32 takes the all-to-all dispatch's vectors only: refused on an all-reduce build."""
    if wire != "fp32" and plan.dispatch != "all_to_all":
        raise RuntimeFault(f"--wire-dtype {wire}: only the all-to-all dispatch's vectors take it; {folder} joins its "
                           f"experts by {plan.dispatch.replace('_', '-')}")


def run(folder: str | Path, options: Options, rendezvous: Rendezvous | None = None) -> dict | None:
    """Decode with every rank of OUT's mesh; this machine runs its node's share (all of them on one machine).
    Returns summarize()'s document on node 0, None on the other nodes."""
    from k3compile.generate import check_request
    from k3compile.manifest import read_sharded

    rdzv = rendezvous or Rendezvous()
    folder = Path(folder)
    doc, cfg, plan = read_sharded(folder)
    check_request(cfg, options.prompts, options.max_new_tokens, options.temperature, options.top_p)
    world = plan.mesh.size
    ranks = node_share(plan, rdzv)
    need = plan.mesh.dp * len(plan.token_sources(0))
    if len(options.prompts) < need:
        raise RuntimeFault(f"mesh {plan.mesh} with {plan.dispatch} dispatch needs a batch of at least {need} prompts "
                           "(every replica, and with all-to-all every row group of a stage, decodes at least one)")
    check_wire(plan, options.wire, folder)
    if options.micro_batches == AUTO_MICRO_BATCHES:
        options = dataclasses.replace(options, micro_batches=auto_micro_batches(plan.mesh, len(options.prompts)))
    if options.micro_batches > 1:
        rows = -(-len(options.prompts) // plan.mesh.dp)  # the rows of the fullest replica
        if plan.mesh.pp == 1:
            raise RuntimeFault(f"--micro-batches {options.micro_batches}: micro-batches pipeline the stages of a "
                               f"mesh with pp > 1; mesh {plan.mesh} has no stages to overlap")
        if options.micro_batches > rows:
            raise RuntimeFault(f"--micro-batches {options.micro_batches}: above the {rows} rows a replica decodes "
                               f"({len(options.prompts)} prompts over dp={plan.mesh.dp})")
    options, device_env = node_options(doc, options, ranks, rdzv)
    ifname = interface_of(rdzv)
    run_dir = Path(tempfile.mkdtemp(prefix="k3compile-run-"))  # 0700: only this user reads or writes it
    procs: dict[int, subprocess.Popen] = {}
    hosted = None
    try:
        if rdzv.node_rank == 0:
            hosted = host_store(rdzv, world, options.timeout)
            rdzv, store = hosted.rendezvous, hosted.store
            store.set(REQUEST, request_of(options))
        else:
            store = join(rdzv, options.timeout)  # fail here, with one line, when node 0 is not there
            agree_with_node_0(store, options, rdzv.node_rank)
        write_options(run_dir, folder.resolve(), options, rdzv)
        procs.update(spawn(run_dir, ranks, world, options.threads, ifname, device_env))
        _watch_node(procs, run_dir, store, rdzv.node_rank, rdzv.nnodes)
        if rdzv.node_rank != 0:
            return None
        results = json.loads((run_dir / RESULT).read_text())
    finally:
        stop_all(procs)
        shutil.rmtree(run_dir, ignore_errors=True)
        if hosted is not None:
            hosted.close()
    return {**summarize(folder, results), "micro_batches": options.micro_batches}


REQUEST = "k3compile/run/request"  # node 0's request_of, for the other nodes to compare theirs with
# what every node's ranks must decode alike: the options' fields, and the option that sets each
REQUEST_OPTIONS = {"prompts": "--prompt-ids", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                   "top_p": "--top-p", "seed": "--seed", "micro_batches": "--micro-batches", "wire": "--wire-dtype"}


def request_of(options: Options) -> str:
    """The request every node must share, as JSON (micro_batches as resolved: auto is a count by then)."""
    return json.dumps({k: getattr(options, k) for k in REQUEST_OPTIONS}, sort_keys=True)


def agree_with_node_0(store, options: Options, node: int) -> None:
    """Node `node` > 0: the request node 0 put into the store equals this node's, else the run stops (every node's
    launcher sees the line: worker.report_failure) with one line naming the options that differ. Node 0's value is
    read as JSON, nothing else; a value that is not the JSON of a request is a difference too."""
    try:
        theirs = store.get(REQUEST).decode(errors="replace")  # node 0 puts it there before this node could join
    except (RuntimeError, OSError) as e:  # the store's timeout (--timeout), or node 0 gone
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RuntimeFault(f"node {node}: node 0 gave no request to decode ({why})") from None
    mine = request_of(options)
    if theirs == mine:
        return
    try:
        doc = json.loads(theirs)
    except ValueError:
        doc = None
    mine_doc = json.loads(mine)  # as JSON gives it back (lists, not tuples)
    differ = [flag for k, flag in REQUEST_OPTIONS.items() if not isinstance(doc, dict) or doc.get(k) != mine_doc[k]]
    line = (f"node {node} was given another request than node 0 ({', '.join(differ or ['its form'])} differ): run "
            "every node with the same prompts and decoding options")
    try:
        report_failure(store, node, line)
    except (RuntimeError, OSError):  # node 0 is gone already
        pass
    raise RuntimeFault(line)


def node_share(plan, rdzv: Rendezvous) -> range:
    """The ranks node rdzv.node_rank starts: its equal share of the mesh's, in rank order (refused where the nodes
    cannot share them evenly). A server's controller, the world's last process, is on node 0 besides its share."""
    world = plan.mesh.size
    if world % rdzv.nnodes:
        raise RendezvousError(f"mesh {plan.mesh} has {world} ranks, which {rdzv.nnodes} nodes cannot share evenly")
    per_node = world // rdzv.nnodes
    return range(rdzv.node_rank * per_node, (rdzv.node_rank + 1) * per_node)


def node_options(doc: dict, options: Options, ranks: range, rdzv: Rendezvous, **more) -> tuple[Options, list[dict]]:
    """`options` as this node's workers get them (each rank's threads: as asked, capped at the cores, or the cores
    over this node's ranks; the node count; `more`), and each local rank's device environment (device_env_of)."""
    from k3compile.threads import capped

    device_env = device_env_of(doc["target"], options.devices, len(ranks))
    threads = capped(options.threads) if options.threads else default_threads(len(ranks))
    return dataclasses.replace(options, threads=threads, nnodes=rdzv.nnodes, **more), device_env


def serve_node(folder: str | Path, options: Options, rendezvous: Rendezvous) -> None:
    """`k3compile serve OUT --nnodes N --node-rank R` on a node R > 0: this machine's share of the ranks, in serve
    mode (runtime/worker.serve_rank), in the world of node 0's server (backends/sharded.py, which hosts the store and
    is the world's last process). Returns when the server stops them; a rank that fails stops the others, its line
    goes into the store for the server (worker.report_failure) and raises here."""
    from k3compile.manifest import read_sharded

    if rendezvous.node_rank == 0:
        raise RendezvousError("node 0 of a served mesh is the server itself (k3compile serve with --node-rank 0)")
    folder = Path(folder)
    doc, _, plan = read_sharded(folder)
    check_wire(plan, options.wire, folder)
    ranks = node_share(plan, rendezvous)
    options, device_env = node_options(doc, options, ranks, rendezvous, serve=True)
    ifname = interface_of(rendezvous)
    store = join(rendezvous, options.timeout)  # one line, within the timeout, when the server is not there
    run_dir = Path(tempfile.mkdtemp(prefix="k3compile-serve-"))  # 0700
    procs: dict[int, subprocess.Popen] = {}
    try:
        write_options(run_dir, folder.resolve(), options, rendezvous)
        procs.update(spawn(run_dir, ranks, plan.mesh.size + 1, options.threads, ifname, device_env))
        _watch_node(procs, run_dir, store, rendezvous.node_rank, rendezvous.nnodes)
    finally:
        stop_all(procs)
        shutil.rmtree(run_dir, ignore_errors=True)


def spawn(run_dir: Path, ranks, world: int, threads: int, ifname: str, device_env: list[dict]
          ) -> dict[int, subprocess.Popen]:
    """Start `ranks` (this node's, in order) as worker processes of a world of `world` processes reading RUN_DIR."""
    env = {**os.environ, ENV_WORLD: str(world), "GLOO_SOCKET_IFNAME": ifname,
           "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    procs = {}
    for i, rank in enumerate(ranks):
        procs[rank] = subprocess.Popen([sys.executable, "-m", "k3compile.runtime.worker", str(run_dir)],
                                       env={**env, ENV_RANK: str(rank), **device_env[i]}, stdin=subprocess.DEVNULL,
                                       start_new_session=True)  # Ctrl-C reaches the launcher, which stops them
    return procs


def device_env_of(target: str, devices, per_node: int) -> list[dict]:
    """Each local rank's environment that picks its GPU device (the driver's variable, which its executor reads):
    `devices` lists one index per rank of this node, or one for all; none leaves the variable as it is."""
    if not devices:
        return [{}] * per_node
    from k3compile.backends.executor import DRIVERS, device_variable

    if target not in DRIVERS:
        raise RuntimeFault(f"--device picks a GPU rank's device; this artifact's ranks are built for {target}")
    if len(devices) not in (1, per_node):
        raise RuntimeFault(f"--device lists {len(devices)} devices for this node's {per_node} ranks (give one per "
                           "rank, or one for all)")
    name = device_variable(target)
    return [{name: str(devices[i if len(devices) > 1 else 0])} for i in range(per_node)]


def _watch_node(procs: dict[int, subprocess.Popen], run_dir: Path, store, node: int, nnodes: int = 1) -> None:
    """_watch this node's workers; a failure's line also goes into the run's store (worker.report_failure), where the
    other nodes' launchers (polling it here), their ranks waiting for every rank to load (worker.loaded) and a server
    (backends/sharded.py) read it. A failure another node reported stops this node's workers with its line: its ranks
    may still be joining the world, which waits for the missing ranks until --start-timeout."""

    def elsewhere() -> str | None:
        try:
            return node_failure(store, nnodes)
        except (RuntimeError, OSError):  # the store's host is gone: the workers' collectives fail on their own
            return None

    try:
        _watch(procs, run_dir, elsewhere if nnodes > 1 else None)
    except RuntimeFault as e:
        try:
            report_failure(store, node, str(e))
        except (RuntimeError, OSError):  # the store's host is gone too
            pass
        raise


def _watch(procs: dict[int, subprocess.Popen], run_dir: Path, elsewhere: Callable[[], str | None] | None = None
           ) -> None:
    """Wait until every worker exits; at the first failure, stop the others and raise the line naming the cause.
    `elsewhere`: another node's failure line or None, asked every OTHERS_S (the caller then stops the workers)."""
    asked = time.monotonic()
    while True:
        codes = {r: exit_code(p) for r, p in procs.items()}
        if all(c == 0 for c in codes.values()):
            return
        if any(c not in (None, 0) for c in codes.values()):
            deadline = time.monotonic() + SETTLE_S
            while time.monotonic() < deadline and any(c is None for c in codes.values()):
                time.sleep(POLL_S)
                codes = {r: exit_code(p) for r, p in procs.items()}
            failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            raise RuntimeFault(failure_line(failed, run_dir))
        if elsewhere is not None and time.monotonic() - asked >= OTHERS_S:
            asked = time.monotonic()
            line = elsewhere()
            if line is not None:
                raise RuntimeFault(line)
        time.sleep(POLL_S)


def exit_code(p: subprocess.Popen) -> int | None:
    """p's exit status as Popen gives it (minus the signal that killed it), or None while it runs. Asked of waitid
    without reaping p, so no lock is taken while p runs: Popen.poll takes a lock of p's, and SIGTERM or Ctrl-C raising
    just after it is taken (CPython 3.11) leaves it held, after which every wait on p blocks for ever. Once p has
    exited it is reaped by one poll, which cannot block (a lock left held makes it a no-op, the status still known
    here), so no zombie outlives the failure it caused (a server's dead rank, backends/sharded.py)."""
    if p.returncode is not None:
        return p.returncode
    try:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: Popen knows how it ended
        return p.poll()
    if info is None:
        return None
    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    p.poll()  # reaps: Popen records the same status
    return code


def failure_line(failed: dict[int, int], run_dir: Path) -> str:
    """The cause among the failed ranks: one killed by a signal, else one whose error does not blame a peer, else
    the first; with its reason."""
    def why(rank: int, code: int) -> str:
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        try:
            doc = json.loads(error_file(run_dir, rank).read_text())
            msg = str(doc["message"]).strip().splitlines()[0]
            log.debug("rank %d:\n%s", rank, doc.get("traceback", ""))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return f"exit code {code}"
        return msg[len(f"rank {rank}: "):] if msg.startswith(f"rank {rank}: ") else msg

    reasons = {r: why(r, c) for r, c in sorted(failed.items())}
    rank = next((r for r, c in sorted(failed.items()) if c < 0), None)
    if rank is None:
        rank = next((r for r, m in reasons.items() if "with rank(s)" not in m), min(reasons))
    return f"rank {rank} failed: {reasons[rank]}"[:500] + " (the other ranks were stopped)"


def stop_all(procs: dict[int, subprocess.Popen]) -> None:
    """SIGTERM every worker still running, SIGKILL what is left after SHUTDOWN_S (a stopped process too), reap all
    (exit_code reaps each as it sees it exit). It waits with exit_code, never on Popen's lock, so a lock left held
    cannot hang it: the run ends, at worst leaving a zombie to this process's exit."""
    alive = [p for p in procs.values() if exit_code(p) is None]
    for p in alive:
        _signal(p, signal.SIGTERM)
        _signal(p, signal.SIGCONT)  # a stopped (SIGSTOP) worker acts on SIGTERM only once continued
    _wait_exit(alive, SHUTDOWN_S)
    alive = [p for p in alive if exit_code(p) is None]
    for p in alive:
        _signal(p, signal.SIGKILL)
    _wait_exit(alive, SHUTDOWN_S)  # SIGKILL ends them at once but for one in an uninterruptible wait


def _wait_exit(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(exit_code(p) is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass
