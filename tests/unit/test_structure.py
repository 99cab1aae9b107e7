"""The shape of the house (docs/architecture.md, "Layers"): no import circles (function-local imports count), the
graph contract and the ONNX backend load without the model, every folder of the package ships in the wheel."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import tiny_model

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "k3compile"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every k3compile module `path` imports, at module level or inside functions (ast: nothing is executed)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: `from .x import y` in package p is p.x
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from k3compile.ops import mxfp4_matmul` imports a submodule; `from x import name` the module x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # import a.b.c -> the deepest known module
                t = t.rpartition(".")[0]
            if t and t.startswith("k3compile"):
                out.add(t)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {name: _imports(path, name, modules) for name, path in files.items()}
    # importing a.b.c runs a/__init__ and a/b/__init__ first
    for name in list(graph):
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in graph and parent != name:
                graph[name].add(parent)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if m.startswith(n + ".") and n.count(".") < m.count("."):
                continue  # a package's __init__ importing its own submodules is not a circle
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_leaves_stay_leaves():
    graph = import_graph()
    for leaf in ("k3compile.errors", "k3compile.modes", "k3compile.ops.spec", "k3compile.ops.onnx_body"):
        assert graph[leaf] <= {"k3compile", "k3compile.ops", "k3compile.errors", "k3compile.modes"}, (leaf, graph[leaf])
    for name, deps in graph.items():
        if name.startswith("k3compile.quant"):
            assert not any(d.startswith("k3compile.ops") for d in deps), (name, deps)
        if name in ("k3compile.export", "k3compile.interface") or name.startswith("k3compile.ops"):
            assert not any(d.startswith(("k3compile.verify", "k3compile.backends", "k3compile.pipeline"))
                           for d in deps), (name, deps)
    assert not any(d.startswith("k3compile.model") for d in graph["k3compile.interface"])


@pytest.mark.parametrize("module", ["k3compile.backends.onnx", "k3compile.interface", "k3compile.backends.tvm",
                                    "k3compile.frontend"])
def test_importing_leaves_the_model_out(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m.startswith('k3compile.model'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {module} loaded {out}"


def test_every_package_folder_ships():
    """pyproject's package list (with the passes/targets mapping) names every folder holding Python code, and each
    such folder is a regular package (an __init__.py: a namespace package is left out of a wheel)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(tool["packages"])
    mapping = tool.get("package-dir", {})
    found = set()
    for pkg_dir, src in [("k3compile", "k3compile"), *[(k, v) for k, v in mapping.items() if k != "k3compile"]]:
        base = ROOT / src
        for module in base.rglob("*.py"):
            rel = module.parent.relative_to(base).parts
            found.add(".".join([pkg_dir, *rel]))
            assert (module.parent / "__init__.py").is_file(), f"{module.parent} holds Python code but no __init__.py"
    assert declared == found


# ---- the decoder cut into stages -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [1, 3, 6])
def test_stages_equal_the_whole_forward(cut):
    """embed -> layers [0, k) -> layers [k, n) -> head == forward, for prefill and a cached decode step (k3-tiny:
    AttnRes blocks of 2, so cuts inside and at block edges). Exact: the same ops in the same order."""
    m = tiny_model()
    n = m.config.num_hidden_layers
    ids = torch.tensor([[3, 1, 4, 1, 5], [0, 0, 9, 2, 6]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.no_grad():
        want, present = m(ids, mask)
        past = m.init_past(2)
        carry = m.embed(ids)
        carry, first = m.run_layers(carry, 0, cut, past[:cut], mask)
        carry, second = m.run_layers(carry, cut, n, past[cut:], mask)
        got = m.head(carry)
        assert torch.equal(got, want)
        for (a, b), (c, d) in zip(first + second, present):
            assert torch.equal(a, c) and torch.equal(b, d)
        step_ids, step_mask = torch.tensor([[7], [8]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        want_step, _ = m(step_ids, step_mask, present)
        carry = m.embed(step_ids)
        carry, _ = m.run_layers(carry, 0, cut, present[:cut], step_mask)
        carry, _ = m.run_layers(carry, cut, n, present[cut:], step_mask)
        assert torch.equal(m.head(carry), want_step)


def test_run_layers_checks_its_range():
    m = tiny_model()
    with pytest.raises(ValueError, match=r"layers \[2, 9\)"):
        m.run_layers(m.embed(torch.tensor([[1]])), 2, 9, m.init_past(1)[2:])


def test_the_artifact_format_is_read_through_one_module():
    """k3compile/manifest.py owns the artifact format: no other module names the artifact's files or reads its
    manifest (artifact.py's ownership rule for --overwrite names the record files too: it decides what is ours), and
    reading one imports neither the compiler nor the model (checked in a fresh process)."""
    import re as re_

    names = re_.compile(r'"(manifest\.json|model\.so|weights\.safetensors|launch\.json|constants\.safetensors|'
                        r'tvm-executable|tvm-sharded)"')
    allowed = {"k3compile/manifest.py", "k3compile/artifact.py"}
    found = []
    for src in ("k3compile", "targets", "passes"):
        for path in (ROOT / src).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in allowed and names.search(path.read_text()):
                found.append(rel)
    assert not found, found
    code = ("import sys, k3compile.manifest\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('k3compile.model', 'k3compile.compile', "
            "'k3compile.partition', 'tvm')))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing k3compile.manifest loaded {out}"
