"""The whole decoder: embedding, KDA/MLA mixers with dense or MoE FFNs, plain or Block Attention Residuals, head.

`K3ForCausalLM.forward(input_ids [B, T], attention_mask [B, P+T] | None, past) -> (logits [B, T, V], present)`
serves prefill (empty past) and decode alike. Parameter names follow the Kimi-Linear checkpoint layout
(`model.layers.N.self_attn.*`, `model.layers.N.block_sparse_moe.*`, `model.layers.N.mlp.*`, `lm_head`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3compile.config import K3Config
from k3compile.model.attnres import attn_res_mix
from k3compile.model.cache import Past, init_past, past_length
from k3compile.model.kda import KimiDeltaAttention
from k3compile.model.mla import GatedMLA
from k3compile.model.mlp import GatedMLP
from k3compile.model.moe import MoE
from k3compile.model.norms import RMSNorm
from k3compile.modes import EAGER, Forms


@dataclass(frozen=True)
class Carry:
    """What flows from one decoder stage to the next: the residual stream (with Block AttnRes, the running sum of
    the current block) and, with Block AttnRes, the bank of closed blocks' summaries (the embedding first)."""

    hidden: Tensor
    bank: tuple[Tensor, ...] = ()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, index: int, experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.is_mla = cfg.is_mla(index)
        self.self_attn = GatedMLA(cfg) if self.is_mla else KimiDeltaAttention(cfg)
        if cfg.is_moe(index):
            self.block_sparse_moe = MoE(cfg, experts)
        else:
            self.mlp = GatedMLP(cfg, d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if cfg.attn_res_block_size:
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)

    def attention(self, x: Tensor, state, valid_new: Tensor | None, valid_all: Tensor | None, forms: Forms = EAGER):
        """The mixer on the normalized input. valid_new [B, T] (KDA), valid_all [B, P+T] (MLA keys)."""
        h = self.input_layernorm(x)
        if self.is_mla:
            return self.self_attn(h, state, valid_all, forms.mla)
        return self.self_attn(h, state, valid_new)

    def ffn(self, x: Tensor, forms: Forms = EAGER) -> Tensor:
        h = self.post_attention_layernorm(x)
        return self.block_sparse_moe(h, forms.act_quant) if hasattr(self, "block_sparse_moe") else self.mlp(h)


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config, experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, experts) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size:
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class K3ForCausalLM(nn.Module):
    """`experts` = (a, b): every MoE layer holds the routed experts [a, b) only (one rank of expert parallelism)."""

    def __init__(self, cfg: K3Config, experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = K3Model(cfg, experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_past(self, batch: int) -> Past:
        return init_past(self.config, batch, dtype=self.lm_head.weight.dtype, device=self.lm_head.weight.device)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, past: Past | None = None, forms: Forms = EAGER,
    ) -> tuple[Tensor, Past]:
        """The whole decoder: embed -> every layer -> head. `forms` chooses how (not what) it computes."""
        cfg = self.config
        b, t = input_ids.shape
        if past is None:
            past = self.init_past(b)
        if len(past) != cfg.num_hidden_layers:
            raise ValueError(f"past has {len(past)} layer states for {cfg.num_hidden_layers} layers")
        if attention_mask is not None:
            want = past_length(cfg, past) + t  # exact whenever the model has an MLA layer (every family member)
            rows, cols = attention_mask.shape
            if rows != b or cols < t or (cfg.full_attn_layers and cols != want):
                raise ValueError(f"attention_mask must be [B, past + new] = [{b}, {want}], got "
                                 f"{list(attention_mask.shape)}")
        carry, present = self.run_layers(self.embed(input_ids), 0, cfg.num_hidden_layers, past, attention_mask, forms)
        return self.head(carry), present

    # ---- the decoder cut into stages (a pipeline stage runs embed?, layers [a, b), head?) ------------------------
    def embed(self, input_ids: Tensor) -> Carry:
        return Carry(self.model.embed_tokens(input_ids))

    def run_layers(
        self, carry: Carry, start: int, stop: int, past: Past, attention_mask: Tensor | None = None,
        forms: Forms = EAGER,
    ) -> tuple[Carry, Past]:
        """Layers [start, stop) on `carry`, with `past` the decode state of exactly those layers; returns the new
        carry and their `present`. Running [0, k) then [k, n) equals running [0, n) (docs/architecture.md)."""
        cfg = self.config
        if not 0 <= start <= stop <= cfg.num_hidden_layers or len(past) != stop - start:
            raise ValueError(f"layers [{start}, {stop}) of {cfg.num_hidden_layers} with {len(past)} layer states")
        valid_all = valid_new = None
        if attention_mask is not None:
            valid_all = attention_mask.bool()
            valid_new = valid_all[:, valid_all.shape[1] - carry.hidden.shape[1]:]
        present: Past = []
        layers = self.model.layers
        if not cfg.attn_res_block_size:
            h = carry.hidden
            for layer, state in zip(layers[start:stop], past):
                a, st = layer.attention(h, state, valid_new, valid_all, forms)
                present.append(st)
                h = h + a
                h = h + layer.ffn(h, forms)
            return Carry(h), present
        bank, prefix = list(carry.bank), carry.hidden
        for i, layer, state in zip(range(start, stop), layers[start:stop], past):
            x = attn_res_mix(bank, prefix, layer.self_attention_res_proj, layer.self_attention_res_norm) \
                if bank else prefix
            if i % cfg.attn_res_block_size == 0:  # close the block: its running sum becomes a summary
                bank.append(prefix)
                prefix = None
            a, st = layer.attention(x, state, valid_new, valid_all, forms)
            present.append(st)
            prefix = a if prefix is None else prefix + a
            x = attn_res_mix(bank, prefix, layer.mlp_res_proj, layer.mlp_res_norm)
            prefix = prefix + layer.ffn(x, forms)
        return Carry(prefix, tuple(bank)), present

    def head(self, carry: Carry) -> Tensor:
        h = carry.hidden
        if self.config.attn_res_block_size:
            h = attn_res_mix(list(carry.bank), h, self.model.output_attn_res_proj, self.model.output_attn_res_norm)
        return self.lm_head(self.model.norm(h))


@torch.no_grad()
def init_weights(model: K3ForCausalLM, seed: int = 0, std: float = 0.02) -> K3ForCausalLM:
    """Seeded random init (deterministic across runs and machines): normal(std) matrices, unit norms, the KDA
    gate parameters as FLA initializes them, MXFP4 experts quantized from a normal(std) float draw. Every float
    parameter holds a bf16 value, as K3's checkpoints ship (docs/model.md, "Presets"): the draw is rounded to bf16
    (round to nearest even), kept in fp32."""
    from k3compile.quant.mx import quantize_mxfp4  # quant is a leaf package; no export code enters the model

    gen = torch.Generator().manual_seed(seed)

    def normal(shape, s=std):
        return torch.randn(shape, generator=gen) * s

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or ".o_norm." in name:
            p.fill_(1.0)
        elif leaf == "A_log":
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
        elif leaf == "dt_bias":
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            dt = dt.clamp_min(1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        else:
            p.copy_(normal(p.shape))
        p.copy_(p.to(torch.bfloat16))
    for mod in model.modules():
        experts = getattr(mod, "experts", None)
        if experts is not None and getattr(experts, "mxfp4", False):
            for w in ("w13", "w2"):
                packed = getattr(experts, f"{w}_packed")
                shape = (*packed.shape[:-1], packed.shape[-1] * 2)
                pk, sc = quantize_mxfp4(normal(shape))
                packed.copy_(pk)
                getattr(experts, f"{w}_scale").copy_(sc)
    return model
