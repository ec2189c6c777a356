"""Optimizers for hfl3: `MuonAdamW` (Muon for hidden matrices + AdamW for the rest), its parameter grouping, its
one-line construction for the HF Trainer (`create_muon_optimizer`), the launch it reads to refuse what it cannot run
under (`Launch`, `refuse_unsupported_sharding`) and its settings, each declared once (`GroupLearningRates`,
`MuonSettings`)."""

from .groups import create_muon_optimizer, param_groups_by_kind
from .launch import Launch, refuse_unsupported_sharding
from .muon import MuonAdamW
from .settings import GroupLearningRates, MuonSettings
from .update import muon_momentum, normuon_rescale, orthogonalize, weight_decay_factor

__all__ = [
    "GroupLearningRates",
    "Launch",
    "MuonAdamW",
    "MuonSettings",
    "create_muon_optimizer",
    "muon_momentum",
    "normuon_rescale",
    "orthogonalize",
    "param_groups_by_kind",
    "refuse_unsupported_sharding",
    "weight_decay_factor",
]
