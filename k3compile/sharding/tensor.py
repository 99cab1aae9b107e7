"""Tensor parallelism (docs/architecture.md, "Tensor parallelism"): which tensors the tp ranks of a stage split, and
along which dimension.

Rank t of tp holds the t-th of tp equal contiguous pieces of each split tensor:

- KDA (by heads): q/k/v projections and their short convs, the decay's f_b_proj and dt_bias, A_log, the beta
  projection b_proj and the output gate (g_proj, or g_b_proj) by output rows; o_proj by input columns. f_a_proj,
  g_a_proj and the per-head-dim o_norm are whole on every rank.
- MLA (by heads): q_b_proj (or q_proj), kv_b_proj and the output gate g_proj by rows (each head's rows are
  contiguous); o_proj by columns. The latent projections q_a / kv_a and their norms are whole on every rank, so
  every rank keeps the whole latent cache (the cache is shared by the heads).
- The dense MLP and the shared experts (by intermediate width): gate/up by rows, down by columns.
- A latent MoE's projections (K3's routed_expert_down_proj [D_e, D] and routed_expert_up_proj [D, D_e]), both by
  input columns: a rank's down projection reads its D / tp columns of the hidden state and gives a partial latent,
  summed over the tp group (`k3.AllReduce`, AR_LATENT_IN) into the latent every rank's experts take; its up
  projection reads its D_e / tp columns of the routed sum and gives a partial output, summed with the shared
  experts' partial output in the layer's one AR_FFN.
- The embedding and the LM head (by vocabulary): rows. A rank looks up the ids in its rows (zero for the others),
  summed over the group (`k3.AllReduce`, AR_EMBED); its head gives its vocabulary's logits, which the runtime
  gathers at the token source (runtime/worker.py, Rank.gathered) to pick the next token, or for greedy decoding
  only each row's argmax of the slice (`slice_argmax`, `join_argmax`).

Everything else (norms, router, the latent norm, AttnRes) is whole on every rank; the routed
experts are split over the stage's ep · tp ranks like expert parallelism. A split block's output (o_proj, down_proj)
is a partial sum: the rank's graph sums it over the tp group with `k3.AllReduce` (part AR_ATTENTION or AR_FFN,
sharding/plan.py, whose check_tp refuses a tp that does not divide a width). A rank's config (`rank_config`) has its
share of the heads and the dense width, so its decode state (KDA conv windows and recurrent states) is its heads'
share.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from k3compile.config import K3Config

# module-relative names -> the dimension split (0: output rows, 1: input columns; 1-d tensors: their only one)
_KDA = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "q_conv1d": 0, "k_conv1d": 0, "v_conv1d": 0, "f_b_proj": 0,
        "dt_bias": 0, "A_log": 0, "b_proj": 0, "g_proj": 0, "g_b_proj": 0, "o_proj": 1}
_MLA = {"q_b_proj": 0, "q_proj": 0, "kv_b_proj": 0, "g_proj": 0, "o_proj": 1}
_MLP = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}
_LATENT = {"routed_expert_down_proj": 1, "routed_expert_up_proj": 1}  # by input columns: partial sums (D, D_e)
_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe\.shared_experts|block_sparse_moe)\."
                   r"(\w+?)(?:\.weight)?$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def split_dim(cfg: K3Config, name: str) -> int | None:
    """The dimension tensor parallelism splits the model tensor `name` along, or None where every rank holds it."""
    if name in _VOCAB:
        return 0
    m = _NAME.match(name)
    if not m:
        return None
    layer, module, leaf = int(m.group(1)), m.group(2), m.group(3)
    if module == "self_attn":
        return (_MLA if cfg.is_mla(layer) else _KDA).get(leaf)
    return (_LATENT if module == "block_sparse_moe" else _MLP).get(leaf)


def vocab_slice(cfg: K3Config, t: int, tp: int) -> tuple[int, int]:
    """The token ids [a, b) whose embedding rows and logits rank t of tp holds (tp divides the vocabulary)."""
    n = cfg.vocab_size // tp
    return t * n, (t + 1) * n


# What each rank of the token source's tensor-parallel group sends it per row for a greedy pick (`slice_argmax`):
# its vocabulary slice's greatest logit, that logit's token id and its count of non-finite logits, as float64 (each
# exact: an fp32 value, an id below 2**53, a count); 24 bytes a row where the slice's logits are 4 V / tp.
ARGMAX_COLUMNS = 3
ARGMAX_BYTES = ARGMAX_COLUMNS * 8


def slice_argmax(logits: Tensor, first: int) -> Tensor:
    """The argmax rows of a vocabulary slice's logits [rows, n] whose first token id is `first` (vocab_slice):
    [rows, ARGMAX_COLUMNS] float64, a row's greatest logit, its id in the whole vocabulary, the slice's non-finite
    count. torch.max gives a row's first greatest logit, as argmax over the whole vocabulary does."""
    x = logits.float()
    value, index = x.max(-1)
    bad = (~torch.isfinite(x)).sum(-1)
    return torch.stack([value.double(), (index + first).double(), bad.double()], dim=-1)


def join_argmax(pieces: list[Tensor]) -> tuple[Tensor, bool]:
    """The greedy tokens [rows] from the tp ranks' `slice_argmax` rows (t order), and whether every logit was finite:
    the greatest value, of equal ones the lowest rank's, so the first greatest of the whole vocabulary as
    torch.argmax picks it (docs/architecture.md, "Tensor parallelism")."""
    rows = torch.stack(pieces)  # [tp, rows, ARGMAX_COLUMNS]
    best = rows[:, :, 0].argmax(0, keepdim=True)  # the first of equal maxima: the lowest t
    tokens = rows[:, :, 1].gather(0, best)[0].long()
    return tokens, not bool(rows[:, :, 2].any())


def rank_config(cfg: K3Config, tp: int) -> K3Config:
    """The config a tensor-parallel rank's modules and decode state are built from: its share of the heads and of
    the dense MLP's width (the shared experts' width: `shared_width`)."""
    if tp == 1:
        return cfg
    return cfg.replace(kda_num_heads=cfg.kda_num_heads // tp, num_attention_heads=cfg.num_attention_heads // tp,
                       intermediate_size=cfg.intermediate_size // tp)


def shared_width(cfg: K3Config, tp: int) -> int:
    """A rank's share of the shared experts' intermediate width."""
    return cfg.num_shared_experts * cfg.moe_intermediate_size // tp


def tp_slice(cfg: K3Config, state: dict[str, Tensor], t: int, tp: int) -> dict[str, Tensor]:
    """Rank t's piece of each split tensor of `state` (model names), the others as they are. A KDA conv weight
    [3 · H · K] is stacked q, k, v in the checkpoint as three tensors: each is split on its own."""
    if tp == 1:
        return state
    out = {}
    for name, x in state.items():
        dim = split_dim(cfg, name)
        if dim is not None:
            dim = min(dim, x.dim() - 1)
            n = x.shape[dim] // tp
            x = x.narrow(dim, t * n, n).contiguous()
        out[name] = x
    return out


def state_piece(cfg: K3Config, layer: int, which: int, x: Tensor, t: int, tp: int) -> Tensor:
    """Rank t's share of a whole decode-state tensor of `layer` (`which`: 0 the KDA conv window [B, 3 H K, W-1] or
    the MLA latent, 1 the KDA recurrent state [B, H, K, K] or the MLA k_rope): a KDA layer's heads t of tp (the
    window's q, k and v channels each), an MLA layer's cache whole."""
    if tp == 1 or cfg.is_mla(layer):
        return x
    if which == 0:
        b, c, w = x.shape
        return x.reshape(b, 3, tp, c // (3 * tp), w)[:, :, t].reshape(b, c // tp, w)
    return x.chunk(tp, dim=1)[t]


def state_join(cfg: K3Config, layer: int, which: int, pieces: list[Tensor]) -> Tensor:
    """The whole decode-state tensor from the tp ranks' pieces (state_piece's inverse; an MLA cache: rank 0's)."""
    tp = len(pieces)
    if tp == 1 or cfg.is_mla(layer):
        return pieces[0]
    if which == 0:
        b, c, w = pieces[0].shape
        return torch.stack([p.reshape(b, 3, c // 3, w) for p in pieces], dim=2).reshape(b, c * tp, w)
    return torch.cat(pieces, dim=1)
