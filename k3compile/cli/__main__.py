"""`python -m k3compile.cli`: the same as the `k3compile` console script."""

from k3compile.cli import main

main(prog_name="k3compile")
