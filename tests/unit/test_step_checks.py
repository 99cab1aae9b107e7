"""interface.check_step, what every backend's step runs first (docs/architecture.md, "The graph interface"): the
inputs a compiled kernel would trust are refused with one StepInputError naming the input; valid ones pass."""

from __future__ import annotations

import pytest
import torch

from k3compile.interface import StepInputError, check_step, init_past, state_shapes
from k3compile.presets import load_config


@pytest.fixture(scope="module")
def cfg():
    return load_config("k3-tiny")


def test_state_shapes_are_init_past_shapes(cfg):
    for batch, past in ((1, 0), (3, 0), (2, 5)):
        shapes = state_shapes(cfg, batch, past)
        made = init_past(cfg, batch)
        for i, (pair, want) in enumerate(zip(made, shapes)):
            got = tuple(tuple(t.shape) for t in pair)
            if cfg.is_mla(i):  # init_past's caches are empty; state_shapes' are `past` rows long
                got = tuple((s[0], past, *s[2:]) for s in got)
            assert got == want


@pytest.mark.parametrize("mask_value,dtype,ok", [
    (1, torch.long, True), (0, torch.int32, True), (True, torch.bool, True), (1.0, torch.float32, True),
    (2, torch.long, False), (-1, torch.long, False), (0.5, torch.float32, False), (255, torch.uint8, False),
])
def test_the_mask_holds_only_zeros_and_ones(cfg, mask_value, dtype, ok):
    ids = torch.tensor([[1, 2, 3]])
    mask = torch.ones(1, 3, dtype=dtype)
    mask[0, 1] = mask_value
    if ok:
        check_step(cfg, ids, mask, init_past(cfg, 1))
    else:
        with pytest.raises(StepInputError, match="only 0 \\(padding\\) and 1"):
            check_step(cfg, ids, mask, init_past(cfg, 1))


def test_ids_and_state_shapes_are_checked(cfg):
    past = init_past(cfg, 2)
    mask = torch.ones(2, 2, dtype=torch.long)
    check_step(cfg, torch.tensor([[0, cfg.vocab_size - 1], [4, 5]]), mask, past)
    for bad in (-1, cfg.vocab_size):
        with pytest.raises(StepInputError, match=f"token id {bad} is outside"):
            check_step(cfg, torch.tensor([[1, 2], [bad, 3]]), mask, past)
    kda = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_mla(i))
    wrong = list(past)
    wrong[kda] = (past[kda][0], past[kda][1][:, :1])
    with pytest.raises(StepInputError, match=f"past.{kda}.* expected"):
        check_step(cfg, torch.tensor([[1, 2], [3, 4]]), mask, wrong)
