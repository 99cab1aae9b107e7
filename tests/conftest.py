"""Shared fixtures: a fixed seed per test and the independent KDA oracle (docs/model.md, "How it is checked")."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# CI runs the property tests on a fixed sequence of examples (a red CI must be reproducible); a developer's run
# explores new examples each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("thorough", max_examples=800)  # pytest --hypothesis-profile thorough: 8x the examples
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


@pytest.fixture(autouse=True)
def _all_cores():
    """TVM's config_threadpool in its mode -1 pinned this process's main thread to one core (threads.py now uses
    mode -3; tests/unit/test_threads.py); every process a later test started (builds, `run`'s ranks) inherited it
    and two ranks ran on one core, doubling the suite's time. A guard against anything else doing so: each test
    starts with the session's cores, and a test that pinned is named in a warning."""
    yield
    if _CPUS is not None and os.sched_getaffinity(0) != _CPUS:
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, _CPUS)
        warnings.warn(f"this test left the main thread pinned to cores {sorted(pinned)}; restored", stacklevel=1)


@pytest.fixture(scope="session", autouse=True)
def _build_cache(tmp_path_factory):
    """No test writes into the user's ~/.cache/k3compile: the build cache lives in this session's temp folder."""
    old = os.environ.get("K3COMPILE_CACHE")
    os.environ["K3COMPILE_CACHE"] = str(tmp_path_factory.mktemp("k3compile-cache"))
    yield
    if old is None:
        os.environ.pop("K3COMPILE_CACHE", None)
    else:
        os.environ["K3COMPILE_CACHE"] = old


@pytest.fixture(scope="session")
def fla_naive():
    """fla-core's naive KDA file, loaded directly (importing fla.ops needs triton, which must stay absent)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


# The longest files first, the rest in collection order: the README's command hands whole files (pyproject.toml's
# --dist loadfile) to two pytest-xdist workers as each frees up, and a long file handed out last would run alone at
# the end. The order of the files' times in a two-worker CI run (test_sharded.py alone is a third of the suite).
LONGEST_FIRST = ["export/test_sharded.py", "export/test_tvm.py", "export/test_gpu.py", "export/test_executor.py",
                 "export/test_hardening_trust.py", "export/test_every_width.py", "export/test_tune.py",
                 "unit/test_hardening_cli.py", "unit/test_prefix_state.py", "export/test_dense_mxfp8.py"]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(Path(item.fspath).relative_to(here).as_posix(), len(first)))  # stable
