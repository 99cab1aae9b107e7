"""Exports and artifacts shared by the export tests (an export costs ~30 s of tracing on 2 cores, a build as much),
each made once per test run (tests/built_once.py: once for both pytest-xdist workers)."""

from __future__ import annotations

import json

import pytest
from built_once import built_once

from k3compile.pipeline import export_checked as export
from k3compile.source import load_model


def _export(tmp_path_factory, name: str, seed: int, **kw):
    model = load_model("k3-tiny", seed=seed)
    out = built_once(tmp_path_factory, name, lambda folder: export(
        model, folder, source={"source": "k3-tiny", "seed": seed, "experts": "auto"}, **kw))
    return model, out, json.loads((out / "export.json").read_text())


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """k3-tiny as published (MXFP4 experts, no activation quantization): (model, folder, export.json)."""
    return _export(tmp_path_factory, "k3-tiny", 0)


@pytest.fixture(scope="session")
def tiny_mxfp8_export(tmp_path_factory):
    return _export(tmp_path_factory, "k3-tiny-mxfp8", 1, activations="mxfp8")


@pytest.fixture(scope="session")
def tvm_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for llvm: (manifest, folder)."""
    from k3compile.compile import compile_export

    out = built_once(tmp_path_factory, "k3-tiny-llvm", lambda folder: compile_export(tiny_export[1], folder))
    return json.loads((out / "manifest.json").read_text()), out


def _gpu_artifact(target: str, tiny_export, tmp_path_factory):
    """tiny_export compiled for a GPU target whose executor runs here (skips where its driver finds no device)."""
    from k3compile.compile import compile_export
    from k3compile.executors import opencl, webgpu

    try:
        {"opencl": opencl.devices, "webgpu": webgpu.adapters}[target]()
    except opencl.DeviceError as e:
        pytest.skip(str(e))
    return built_once(tmp_path_factory, f"k3-tiny-{target}",
                      lambda folder: compile_export(tiny_export[1], folder, target=target))


@pytest.fixture(scope="session")
def opencl_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for opencl (PoCL here): its folder."""
    return _gpu_artifact("opencl", tiny_export, tmp_path_factory)


@pytest.fixture(scope="session")
def webgpu_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for webgpu (lavapipe here, through wgpu): its folder."""
    return _gpu_artifact("webgpu", tiny_export, tmp_path_factory)
