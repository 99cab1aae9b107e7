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


@pytest.fixture(scope="session")
def opencl_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for opencl (skips where no OpenCL device is): its folder."""
    from k3compile.executors.opencl import DeviceError, devices

    try:
        devices()
    except DeviceError as e:
        pytest.skip(str(e))
    from k3compile.compile import compile_export

    out = tmp_path_factory.mktemp("artifacts") / "k3-tiny-opencl"
    compile_export(tiny_export[1], out, target="opencl")
    return out


@pytest.fixture(scope="session")
def webgpu_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for webgpu (skips where wgpu finds no adapter): its folder."""
    from k3compile.executors.webgpu import DeviceError, adapters

    try:
        adapters()
    except DeviceError as e:
        pytest.skip(str(e))
    from k3compile.compile import compile_export

    out = tmp_path_factory.mktemp("artifacts") / "k3-tiny-webgpu"
    compile_export(tiny_export[1], out, target="webgpu")
    return out
