"""Exports shared by the export tests (each costs ~30 s of tracing on 2 cores, so each is made once)."""

from __future__ import annotations

import pytest

from k3compile.pipeline import export_checked as export
from k3compile.source import load_model


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """k3-tiny as published (MXFP4 experts, no activation quantization): (model, folder, export.json)."""
    model = load_model("k3-tiny", seed=0)
    out = tmp_path_factory.mktemp("exports") / "k3-tiny"
    doc = export(model, out, source={"source": "k3-tiny", "seed": 0, "experts": "auto"})
    return model, out, doc


@pytest.fixture(scope="session")
def tiny_mxfp8_export(tmp_path_factory):
    model = load_model("k3-tiny", seed=1)
    out = tmp_path_factory.mktemp("exports") / "k3-tiny-mxfp8"
    doc = export(model, out, activations="mxfp8", source={"source": "k3-tiny", "seed": 1, "experts": "auto"})
    return model, out, doc


@pytest.fixture(scope="session")
def tvm_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for llvm: (manifest, folder)."""
    from k3compile.compile import compile_export

    out = tmp_path_factory.mktemp("artifacts") / "k3-tiny-llvm"
    return compile_export(tiny_export[1], out), out


def _gpu_artifact(target: str, tiny_export, tmp_path_factory):
    """tiny_export compiled for a GPU target whose executor runs here (skips where its driver finds no device)."""
    from k3compile.compile import compile_export
    from k3compile.executors import opencl, webgpu

    try:
        {"opencl": opencl.devices, "webgpu": webgpu.adapters}[target]()
    except opencl.DeviceError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("artifacts") / f"k3-tiny-{target}"
    compile_export(tiny_export[1], out, target=target)
    return out


@pytest.fixture(scope="session")
def opencl_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for opencl (PoCL here): its folder."""
    return _gpu_artifact("opencl", tiny_export, tmp_path_factory)


@pytest.fixture(scope="session")
def webgpu_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for webgpu (lavapipe here, through wgpu): its folder."""
    return _gpu_artifact("webgpu", tiny_export, tmp_path_factory)
