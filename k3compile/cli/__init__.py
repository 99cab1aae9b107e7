"""The `k3compile` command line: a thin click layer, one module per verb (presets, plan, generate, export, compile,
verify, run, serve, bench).

Each command parses, calls one library function, prints. A command's module is imported when that command runs
(`Group`'s table of verbs), so `generate` on a CPU artifact starts without torch (k3compile/lean.py). Errors the
user can fix (errors.UserError) print one line and exit 1; SIGTERM ends a command like Ctrl-C (its temporary files
removed) with one line and exit 143; progress goes to stderr on a terminal; `--json` prints strict JSON on stdout.
"""

from __future__ import annotations

import logging
import os

# torch's C++ side logs each failed connection of a rendezvous (with a stack of frames) on stderr, where a command
# prints its one `Error:` line instead; read once, when torch loads: set before anything imports it.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import click  # noqa: E402

from k3compile import __version__  # noqa: E402
from k3compile.cli.common import Group  # noqa: E402


@click.group(cls=Group, verbs=("presets", "plan", "generate", "export", "compile", "verify", "run", "serve", "bench"),
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3compile")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """k3compile: deploy Kimi K3 (and the Kimi-Linear family) to non-CUDA accelerators.

    SOURCE arguments take a preset name (see `k3compile presets`), an HF config.json (seeded random weights)
    or a checkpoint folder (config.json + safetensors).
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")

