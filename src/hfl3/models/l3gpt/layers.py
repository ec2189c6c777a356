"""Building blocks shared by the modeling file and the L3 layer (`lookup.py`): nanochat's parameter-free RMSNorm and
its init schemes, tagged on the modules that own the weights (`with_init`) and applied by `_init_weights` and to the
rows `resize_token_embeddings` adds (`initialize`).

Self-contained (relative imports only; ships with the modeling file as Hub remote code).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .configuration_l3gpt import L3GPTConfig


class L3GPTRMSNorm(nn.Module):
    """Parameter-free RMSNorm over the last dimension (nanochat: `F.rms_norm(x, (x.size(-1),))`), in the input's dtype
    even under autocast: CUDA's autocast runs `rms_norm` in float32 and returns float32 (ATen's `AT_FORALL_FP32`
    list), which would turn every normed activation of a bf16 stream — each block's input to its projections, the
    query and key norms, the final norm — into a float32 tensor twice the bytes, saved for the backward; nanochat
    norms in bf16 ("this will run in bf16, seems ok"). The reduction accumulates in float32 either way."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden_states.device.type, enabled=False):
            return F.rms_norm(hidden_states, (hidden_states.size(-1),), eps=self.eps)


def with_init(module: nn.Module, scheme: str, scale: float = 0.0) -> nn.Module:
    """Tag a Linear/Embedding with its init (`"uniform"` in ±scale, `"positive_uniform"` in [0, scale], `"normal"`
    with std scale, `"zeros"`), applied by `_init_weights`. The tag lives on the parameter-owning module because
    transformers v5 skips modules without direct parameters when initialising remote-code models."""
    module.hfl3_init = (scheme, scale)
    return module


def initialize(weight: torch.Tensor, scheme: tuple[str, float]) -> None:
    """Fill `weight` (a parameter or rows of one) following a `with_init` scheme, through transformers' `init`
    functions (which skip tensors that loading has already filled)."""
    kind, scale = scheme
    if kind == "uniform":
        init.uniform_(weight, -scale, scale)
    elif kind == "positive_uniform":
        init.uniform_(weight, 0.0, scale)
    elif kind == "normal":
        init.normal_(weight, std=scale)
    else:
        init.zeros_(weight)


def uniform_bound(config: L3GPTConfig) -> float:
    """nanochat's q/k/v init: uniform with std 1/√C, i.e. bound √3/√C (C = hidden_size)."""
    return math.sqrt(3.0 / config.hidden_size)
