"""`k3compile plan`: where a model fits on N devices, and what each mesh moves per token (no weights)."""

from __future__ import annotations

import click

from k3compile.cli.common import (
    DISPATCH_FLAGS,
    FiniteFloat,
    IntRange,
    dumps,
    micro_batches_callback,
    name_list,
    table_console,
    user_errors,
)
from k3compile.sharding.plan import AUTO_MICRO_BATCHES as AUTO
from k3compile.sharding.plan import MAX_RANKS

GIB = 2**30
SIZE = IntRange(1, 2**31 - 1)  # every size at most 2^31 - 1 (docs/architecture.md, "Errors")
MAX_DEVICE_GIB = 2**20  # 1 PiB a device: a typo's bound, far past any accelerator


@click.command("plan")
@click.argument("source", default="k3")
@click.option("--devices", required=True, type=IntRange(1, MAX_RANKS),
              help=f"Accelerators of the supernode (at most {MAX_RANKS}).")
@click.option("--mesh", default=None, metavar="[tp=T,]ep=E[,pp=P][,dp=D]",
              help="Only this mesh (dp fills the devices it leaves); refused when it cannot hold the model.")
@click.option("--context", default=8192, show_default=True, type=SIZE,
              help="Tokens per sequence the MLA caches hold.")
@click.option("--batch", default=1, show_default=True, type=SIZE, help="Sequences decoded at once.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Dense weights, caches, activations and wire (routed experts keep their stored format; KDA states "
                   "are fp32). The CPU artifacts of `export --mesh` are fp32.")
@click.option("--device-memory", "device_memory", default=64.0, show_default=True,
              type=FiniteFloat(min=0, min_open=True, max=MAX_DEVICE_GIB),
              help=f"GiB of memory per device (at most {MAX_DEVICE_GIB}).")
@click.option("--device-bandwidth", "device_bandwidth", default=1600.0, show_default=True,
              type=FiniteFloat(min=0, min_open=True, max=1e9),
              help="GB/s a device reads its memory at (the decode-time prediction; default: the documented "
                   "assumed class, docs/architecture.md \"The plan's device model\").")
@click.option("--link-bandwidth", "link_bandwidth", default=100.0, show_default=True,
              type=FiniteFloat(min=0, min_open=True, max=1e9),
              help="GB/s a device sends to its peers at (all its collectives share it).")
@click.option("--device-tflops", "device_tflops", default=312.0, show_default=True,
              type=FiniteFloat(min=0, min_open=True, max=1e9),
              help="TFLOP/s a device computes at (dense bf16 matrix work; a stage takes the longer of its reads and "
                   "its compute).")
@click.option("--micro-batches", "micro_batches", default="1", show_default=True,
              callback=micro_batches_callback(2**31 - 1), metavar="M|auto",
              help="Price each mesh with pp > 1 running its rows as M micro-batches (run --micro-batches; at most a "
                   "replica's rows); auto: each mesh at the count that predicts its fastest step.")
@click.option("--dispatch", "dispatches", default="all-reduce", show_default=True,
              callback=name_list(tuple(DISPATCH_FLAGS)),
              help="Comma-separated all-reduce, all-to-all: each mesh with ep > 1 priced once per dispatch (the "
                   "all-to-all where the batch gives every row group of every replica a row).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def command(source, devices, mesh, context, batch, dtype, device_memory, device_bandwidth, link_bandwidth,
            device_tflops, micro_batches, dispatches, as_json):
    """Per-device memory and bytes per decode token of the meshes of SOURCE (a preset, config.json or checkpoint
    folder; only its config is read) over DEVICES accelerators: weights by format, KDA state, MLA cache for CONTEXT
    and BATCH, activations; all-reduce / send / broadcast bytes, and the all-to-all dispatch alternative at latent
    and at full width (the slots it routes, expected under uniform routing); a predicted decode step on the stated
    device (memory and link bandwidth, compute). The meshes that fit come first, fastest first."""
    from k3compile.presets import load_config
    from k3compile.sharding import Mesh, PlanError
    from k3compile.sharding.cost import (
        Device,
        Sizes,
        candidate_meshes,
        does_not_fit,
        evaluate,
        fastest_micro_batches,
    )

    memory = int(device_memory * GIB)
    with user_errors():
        cfg = load_config(source)
        if mesh is not None:
            m = Mesh.parse(mesh)
            if devices % (m.group * m.pp) or (m.dp > 1 and m.size != devices):
                raise PlanError(f"mesh {m} does not divide {devices} devices")
            meshes = [Mesh(m.ep, m.pp, devices // (m.group * m.pp), m.tp)]
        else:
            meshes = candidate_meshes(cfg, devices)
            if not meshes:
                raise PlanError(f"{cfg.name} cannot be split over {devices} devices")
        if batch < max(m.dp for m in meshes) and mesh is not None:
            raise PlanError(f"mesh {meshes[0]}: dp={meshes[0].dp} needs a batch of at least {meshes[0].dp}")
        if mesh is not None and micro_batches > 1 and meshes[0].pp == 1:
            raise PlanError(f"--micro-batches {micro_batches}: mesh {meshes[0]} has no stages to overlap (pp=1)")
        if mesh is not None and micro_batches > batch // meshes[0].dp:
            raise PlanError(f"--micro-batches {micro_batches}: above the {batch // meshes[0].dp} rows a replica of "
                            f"mesh {meshes[0]} decodes")
        meshes = [m for m in meshes if m.dp <= batch]
        if not meshes:
            raise PlanError(f"every mesh of {devices} devices needs a batch of at least its dp; raise --batch")
        wanted = [DISPATCH_FLAGS[d] for d in dispatches]
        if mesh is not None and "all_reduce" not in wanted and meshes[0].ep * meshes[0].dp > batch:
            raise PlanError(f"mesh {meshes[0]} with all-to-all dispatch needs a batch of at least "
                            f"{meshes[0].ep * meshes[0].dp} (a row for every row group of every replica)")
        runs = [(m, d) for m in meshes for d in wanted
                if d == "all_reduce" or mesh is not None or (m.ep > 1 and m.ep * m.dp <= batch)]
        if not runs:
            raise PlanError(f"no mesh of {devices} devices runs the all-to-all dispatch at batch {batch} (it needs "
                            "ep > 1 and a row for every row group of every replica)")
        sizes = Sizes.of(cfg)
        device = Device(bandwidth=device_bandwidth * 1e9, link=link_bandwidth * 1e9, flops=device_tflops * 1e12)
        rows = [fastest_micro_batches(cfg, sizes, m, batch, context, dtype, memory, device, d)
                if micro_batches == AUTO else evaluate(cfg, sizes, m, batch, context, dtype, memory, device,
                                                       micro_batches, d) for m, d in runs]
        rows.sort(key=lambda r: (not r["fits"], r["predicted"]["step_s"]))  # stable: equal times keep their order
        if mesh is not None and not rows[0]["fits"]:
            raise PlanError(does_not_fit(rows[0], memory))
        if not any(r["fits"] for r in rows):
            raise PlanError(f"no mesh of {devices} devices holds {cfg.name}; the least full: "
                            + does_not_fit(min(rows, key=lambda r: r["device_total"]), memory))
    if as_json:
        click.echo(dumps({"source": source, "devices": devices, "context": context, "batch": batch, "dtype": dtype,
                          "device_memory": memory, "device_bandwidth": device.bandwidth,
                          "link_bandwidth": device.link, "device_flops": device.flops,
                          "micro_batches": "auto" if micro_batches == AUTO else micro_batches, "meshes": rows},
                         indent=2))
        return
    _table(cfg, rows, devices, context, batch, dtype, device_memory, device_bandwidth, link_bandwidth, device_tflops,
           micro_batches)


def _table(cfg, rows, devices, context, batch, dtype, device_memory, device_bandwidth, link_bandwidth, device_tflops,
           micro_batches) -> None:
    from rich.table import Table

    t = Table(title=f"k3compile plan: {cfg.name} on {devices} devices of {device_memory:g} GiB, "
                    f"{device_bandwidth:g} GB/s memory, {link_bandwidth:g} GB/s link, {device_tflops:g} TFLOP/s "
                    f"({dtype}, context {context}, "
                    f"batch {batch}). GiB on the fullest device (state: KDA + MLA cache + activations); "
                    "bytes per decode token over the mesh (a mesh marked a2a: with the all-to-all dispatch, else the "
                    "all-reduce); a2a D_e / D: the all-to-all alternative at latent width D_e and at D (the routed "
                    "slots, expected under uniform routing); "
                    "max ctx: the longest context every device holds at this batch; step: the predicted decode "
                    "step (each stage the longer of its reads and its compute, then its collectives; "
                    + ("M: the micro-batches that predict the fastest step where pp > 1" if micro_batches == AUTO
                       else f"{micro_batches} micro-batches in flight where pp > 1" if micro_batches > 1
                       else "one batch in flight") + "), the meshes "
                    "that fit first, fastest first")
    t.add_column("mesh", no_wrap=True)
    shown = micro_batches != 1  # the micro-batch count of each row (auto: chosen per mesh)
    for col in ("dense", "experts", "state", "total", "fits", "max ctx", *(("M",) if shown else ()), "step ms", "tok/s",
                "all-reduce", "send", "a2a D_e", "a2a D", "D_e/D"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        b = r["device_bytes"]
        experts = b.get("experts_mxfp4", b.get("experts_float", 0))
        state = b["kda_state"] + b["mla_cache"] + b["activations"]
        a2a = r["all_to_all_per_token"]
        ratio = f"{a2a['latent'] / a2a['full_width']:.2f}" if a2a["full_width"] else "-"
        name = r["mesh"] + (" a2a" if r["dispatch"] == "all_to_all" else "")
        t.add_row(name, f"{b['dense'] / GIB:,.1f}", f"{experts / GIB:,.1f}", f"{state / GIB:,.2f}",
                  f"{r['device_total'] / GIB:,.1f}", "yes" if r["fits"] else "no", f"{r['max_context']:,}",
                  *((str(r["predicted"]["micro_batches"]),) if shown else ()),
                  f"{r['predicted']['step_s'] * 1e3:,.2f}", f"{r['predicted']['tokens_per_s']:,.1f}",
                  _bytes(r["bytes_per_token"]["all_reduce"]), _bytes(r["bytes_per_token"]["send"]),
                  *((_bytes(a2a["latent"]), _bytes(a2a["full_width"])) if a2a["full_width"] else ("-", "-")), ratio)
    table_console().print(t)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"
