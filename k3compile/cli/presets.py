"""`k3compile presets`: the built-in presets with their sizes."""

from __future__ import annotations

import click

from k3compile.cli.common import dumps, table_console
from k3compile.presets import PRESETS


@click.command("presets")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(as_json: bool) -> None:
    """List the built-in presets with parameter counts, active parameters per token and stored bytes."""
    from k3compile.presets import preset
    from k3compile.sizing import model_size

    rows = []
    for name in PRESETS:
        cfg = preset(name)
        size = model_size(cfg)
        rows.append({
            "name": name, "layers": cfg.num_hidden_layers, "mla_layers": len(cfg.full_attn_layers),
            "hidden": cfg.hidden_size, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
            "expert_format": cfg.expert_format, "params": size.params, "active_params": size.active_params,
            "bytes": size.bytes,
        })
    if as_json:
        click.echo(dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title="k3compile presets (bytes: bf16, routed experts in their stored format)")
    for col in ("preset", "layers (MLA)", "hidden", "experts", "params", "active/token", "bytes"):
        table.add_column(col, justify="left" if col == "preset" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['layers']} ({r['mla_layers']})", str(r["hidden"]),
                      f"{r['experts']} top-{r['top_k']} {r['expert_format']}", _human(r["params"]),
                      _human(r["active_params"]), _human(r["bytes"], "B"))
    table_console().print(table)


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.0f}{unit}" if suffix == "" else f"{n:.2f}{suffix}{unit}"
        n /= 1000
    return str(n)
