"""A loss for causal LMs scored only at the supervised positions: `add_supervised_nll` patches a model's forward so
that it returns the summed next-token NLL of the positions whose label is not -100 (chunked linear + cross-entropy),
without building `(batch, seq, vocab)` logits. `ChatSFTTrainer` uses it off CUDA/XPU."""

import functools
import types
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from hfl3.models.l3gpt.linear_cross_entropy import linear_cross_entropy, register_zero3_owner


@dataclass
class SupervisedNLL(ModelOutput):
    """Output of a model patched by `add_supervised_nll` and called with `supervised_nll=True`.

    Args:
        nll_sum (`torch.FloatTensor`, scalar): summed next-token NLL (nats) over the K supervised positions.
        predictions (`torch.LongTensor` of shape `(K,)`): argmax token at each supervised position.
        targets (`torch.LongTensor` of shape `(K,)`): the supervised next tokens.
    """

    nll_sum: torch.Tensor | None = None
    predictions: torch.Tensor | None = None
    targets: torch.Tensor | None = None


LOGIT_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
"""Config fields that rescale a model's logits (TRL's `add_fused_lm_head` reads them); `add_supervised_nll` does not
apply them, so a model that sets one keeps TRL's loss."""


def add_supervised_nll(model, owner: torch.nn.Module | None = None) -> None:
    """Patch `model.forward` (as TRL's `add_fused_lm_head` does, and on top of it) so that
    `model(..., labels=labels, supervised_nll=True)` returns a `SupervisedNLL` instead of logits: the backbone
    (`model.base_model`) runs, the hidden states at the K positions whose next-token label is not -100 are kept, and
    `linear_cross_entropy` (chunked) scores them against `get_output_embeddings().weight` with the text config's
    `final_logit_softcapping` — no `(batch, seq, vocab)` logits, and none at unsupervised positions. Without
    `supervised_nll` the forward is the previous one. Patch the model before PEFT wraps it or its base model after:
    the call must go through the wrappers (DDP, PEFT) so that their hooks run. `owner` is the outermost model (the
    PEFT model) whose forward runs this one: under ZeRO-3 the output embedding is gathered for its forward (PEFT
    calls the base model's `forward` directly, so the base model's own ZeRO hooks do not run)."""
    previous_forward = model.forward
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    @functools.wraps(type(model).forward)
    def forward(self, *args, supervised_nll=False, **kwargs):
        if not supervised_nll:
            return previous_forward(*args, **kwargs)
        weight = self.get_output_embeddings().weight
        register_zero3_owner(owner if owner is not None else self, weight)
        labels = kwargs.pop("labels")
        kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]  # (B, T-1, C)
        targets = labels[:, 1:].to(hidden.device)  # (B, T-1)
        supervised = targets != -100
        nll_sum, predictions = linear_cross_entropy(
            hidden[supervised], weight, targets[supervised], softcap,
            return_predictions=True, backend="chunked",
        )  # (), (K,)
        return SupervisedNLL(nll_sum=nll_sum, predictions=predictions, targets=targets[supervised])

    model.forward = types.MethodType(forward, model)
