"""Decode states as rows of a batch (docs/architecture.md, "Serving"): the operations continuous batching and the
prefix cache need on the graph interface's state (interface.py: per layer a KDA pair of fixed size or an MLA cache
[B, P, width] that grows with the tokens seen), all in host memory.

Rows of one batch share the cache length P; a row whose history is shorter sits behind left padding (its mask 0
there, its MLA rows zero: a masked key is never attended, docs/model.md). So rows of different lengths join by
left-padding the shorter ones to the longest, and a row leaves by being dropped, the columns that every remaining
row masks then cut from the front. Neither changes what any row computes: KDA's state is per row, and attention
reads a row's own unmasked keys only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.config import K3Config
from k3compile.interface import Past, past_length


def on_host(backend, past: Past) -> Past:
    """`past` as host tensors: a GPU executor's state is downloaded (backends/executor.py: `host_past`); any other
    backend's already is."""
    to_host = getattr(backend, "host_past", None)
    return to_host(past) if to_host is not None else past


def clone(past: Past) -> Past:
    """A copy that owns its memory: a compiled backend's `present` may be a view of buffers it writes again."""
    return [(a.detach().clone(), b.detach().clone()) for a, b in past]


def nbytes(past: Past) -> int:
    return sum(t.numel() * t.element_size() for pair in past for t in pair)


def take_rows(cfg: K3Config, past: Past, mask: Tensor, rows: list[int]) -> tuple[Past, Tensor]:
    """The state and mask of `rows` (in that order), with the leading columns that every kept row masks cut."""
    index = torch.tensor(rows, dtype=torch.long)
    past = [(a.index_select(0, index), b.index_select(0, index)) for a, b in past]
    mask = mask.index_select(0, index)
    length = past_length(cfg, past)
    valid = mask[:, :length].any(0).nonzero()
    cut = int(valid[0]) if len(valid) else length
    if cut:
        past = [(a[:, cut:], b[:, cut:]) if cfg.is_mla(i) else (a, b) for i, (a, b) in enumerate(past)]
        mask = mask[:, cut:]
    return past, mask


def left_pad_state(cfg: K3Config, past: Past, mask: Tensor, length: int) -> tuple[Past, Tensor]:
    """`past` (cache length P <= `length`) and its mask [B, P] left-padded to `length`: zero MLA rows, mask 0."""
    pad = length - past_length(cfg, past)
    if pad == 0:
        return past, mask
    if pad < 0:
        raise ValueError(f"a state of {past_length(cfg, past)} tokens cannot be padded to {length}")
    out = []
    for i, (a, b) in enumerate(past):
        if cfg.is_mla(i):
            a = torch.cat([a.new_zeros(a.shape[0], pad, a.shape[2]), a], dim=1)
            b = torch.cat([b.new_zeros(b.shape[0], pad, b.shape[2]), b], dim=1)
        out.append((a, b))
    return out, torch.cat([mask.new_zeros(mask.shape[0], pad), mask], dim=1)


def join_rows(cfg: K3Config, parts: list[tuple[Past, Tensor]]) -> tuple[Past, Tensor]:
    """One batch of the rows of `parts` ((state, mask [b, P]) each, in order), left-padded to the longest."""
    length = max(past_length(cfg, p) for p, _ in parts)
    padded = [left_pad_state(cfg, p, m, length) for p, m in parts]
    past = [(torch.cat([p[i][0] for p, _ in padded]), torch.cat([p[i][1] for p, _ in padded]))
            for i in range(cfg.num_hidden_layers)]
    return past, torch.cat([m for _, m in padded])
