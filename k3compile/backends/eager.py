"""The PyTorch model behind the step protocol, in the forms the caller chooses (eager default or exported)."""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.interface import Past, check_step
from k3compile.model.k3 import K3ForCausalLM
from k3compile.modes import EAGER, Forms


class EagerBackend:
    name = "eager"
    computes_with_torch = True  # threads.glue_threads leaves torch its threads

    def __init__(self, model: K3ForCausalLM, forms: Forms = EAGER) -> None:
        self.model = model.eval()
        self.config = model.config
        self.forms = forms

    def init_past(self, batch: int) -> Past:
        return self.model.init_past(batch)

    @torch.no_grad()
    def step(self, input_ids: Tensor, attention_mask: Tensor, past: Past) -> tuple[Tensor, Past]:
        check_step(self.config, input_ids, attention_mask, past)
        return self.model(input_ids, attention_mask, past, forms=self.forms)
