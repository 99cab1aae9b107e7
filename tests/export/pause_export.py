"""Run `k3compile export` in this process with the trace replaced by a saved graph, pausing at a named point.

    python pause_export.py TRACED.onnx POINT [export arguments...]

At POINT it prints `PAUSED POINT` and sleeps, so that a test can signal it there. Points: load (before any work
folder exists), trace (the work folder exists), save (model.onnx written), parity (the onnxruntime run), none.
"""

from __future__ import annotations

import sys
import time

import onnx

import k3compile.export as export_mod
import k3compile.source as source
import k3compile.verify as verify
from k3compile.cli import main


def pause(point: str) -> None:
    if point == POINT:
        print(f"PAUSED {point}", flush=True)
        # Short sleeps, as real work returns to Python often: a signal delivered to another thread (torch and
        # onnxruntime start worker threads) only sets a flag that the main thread acts on at its next bytecode,
        # so one long sleep could hold the SIGTERM handler back for its whole length.
        for _ in range(1200):
            time.sleep(0.1)


TRACED, POINT, ARGS = sys.argv[1], sys.argv[2], sys.argv[3:]
graph = onnx.load(TRACED)
real_load, real_save, real_compare = source.load_model, onnx.save_model, verify.compare


def load_model(*a, **k):
    pause("load")
    return real_load(*a, **k)


def trace_to_onnx(*a, **k):
    pause("trace")
    return graph


def save_model(*a, **k):
    real_save(*a, **k)
    pause("save")


def compare(*a, **k):
    pause("parity")
    return real_compare(*a, **k)


source.load_model, export_mod.trace_to_onnx, onnx.save_model, verify.compare = (
    load_model, trace_to_onnx, save_model, compare)
main(["export", *ARGS], prog_name="k3compile")
