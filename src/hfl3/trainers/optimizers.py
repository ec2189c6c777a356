"""The optimizer of both recipes' trainers, declared once: `MuonTrainingArguments` (the Muon fields and `--optim
muon`, which `PretrainConfig` and `ChatSFTConfig` inherit) and `OptimizerMixin` (`MuonAdamW` with nanochat's
parameter groups or the Trainer's own optimizer, every group's LR scaled, the warmup → constant → linear warmdown
schedule, and a warm start from a saved optimizer state), which `PretrainTrainer` and `ChatSFTTrainer` inherit.

transformers 5.23 has no way to register an optimizer name: `TrainingArguments.__post_init__` converts `optim` to its
closed enum `OptimizerNames` (unknown names raise), and the Trainer builds only those (`get_optimizer_cls_and_kwargs`,
a private table); an optimizer of one's own reaches the Trainer through its public `optimizers` /
`optimizer_cls_and_kwargs` arguments or a `create_optimizer` override, which is `OptimizerMixin`'s. So "muon" is taken
out of `optim` before transformers validates it (`MuonTrainingArguments.take_muon_out_of_optim`): `optim="muon"`
becomes `use_muon=True` with `optim` "adamw_torch", what runs MuonAdamW's AdamW groups (torch's AdamW), and
`to_dict()` records both (docs/design.md, decision 2).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from hfl3.optim.settings import GroupLearningRates
from hfl3.optim.state_file import FILE, load_optimizer_state, save_optimizer_state

logger = logging.getLogger(__name__)

MUON = "muon"
"""`--optim muon`: hfl3's spelling of `use_muon=True` (not one of transformers' `OptimizerNames`)."""


@dataclass
class MuonTrainingArguments(GroupLearningRates):
    """The optimizer fields a recipe's `TrainingArguments` adds: `use_muon` (`--optim muon`), the Muon group LRs
    (`GroupLearningRates`: `matrix_lr`, `embedding_lr`, ... declared there once, with their nanochat sources), the
    warmdown of the `warmup_stable_decay` schedule, `batch_lr_scale` (set by the compute-optimal plan, or inherited by
    SFT from its base) and `group_lrs_from_learning_rate` (set by SFT when it derives the group LRs from
    `learning_rate`, `hfl3.trainers.sft_inheritance`). Call `take_muon_out_of_optim` first in `__post_init__`."""

    use_muon: bool = field(default=False, metadata={"help": "train with hfl3's MuonAdamW (Muon for the hidden "
                                                    "matrices, AdamW for the rest; group LRs *_lr) instead of the "
                                                    "Trainer's optimizer"})
    warmdown_ratio: float = field(default=0.2, metadata={"help": "share of steps in the final linear warmdown "
                                                         "(lr_scheduler_type warmup_stable_decay)"})
    final_lr_frac: float = field(default=0.0, metadata={"help": "LR at the end of the warmdown, as a fraction"})
    batch_lr_scale: float = field(default=1.0, init=False, metadata={
        "help": "√(total_batch_size / 2^19), set by the compute-optimal plan; multiplies every group's LR"})
    group_lrs_from_learning_rate: bool = field(default=False, init=False, metadata={
        "help": "the group LRs were derived from learning_rate (SFT on a base Muon did not pretrain: "
                "GroupLearningRates.for_fine_tuning)"})

    def take_muon_out_of_optim(self) -> None:
        """`optim="muon"` → `use_muon=True`, `optim="adamw_torch"` (module docstring).

        Raises:
            ValueError: `use_muon` with another `optim` (the ranges of the Muon fields:
                `hfl3.trainers.arguments.check_training_arguments`).
        """
        if self.optim == MUON:
            self.use_muon, self.optim = True, "adamw_torch"
        elif self.use_muon and self.optim != "adamw_torch":
            raise ValueError(f"use_muon=True with optim={self.optim}: MuonAdamW replaces the Trainer's optimizer (its "
                             "AdamW groups run torch's AdamW, optim adamw_torch); drop --optim or --use_muon")


class OptimizerMixin:
    """Trainer mixin (before `Trainer` in the bases) that builds the optimizer in one place: `create_optimizer`.

    With `args.use_muon`: `hfl3.optim.muon_optimizer` with the args' group LRs (what Muon cannot run under is
    refused in `__init__`, before training: `hfl3.optim.refuse_unsupported_sharding`); otherwise the Trainer's own
    optimizer (`--optim`). Every group's LR is multiplied by `args.batch_lr_scale` (Muon: but the smear group's, as
    nanochat) and, with Muon, by `args.init_lr_frac` when the args have it (nanochat chat SFT's start at a fraction of
    the base LRs). With
    `optimizer_state` (a file `hfl3.optim.state_file.save_optimizer_state` wrote), the new optimizer is warm-started
    from it (its momentum buffers and moments; the groups' LRs and step counts stay this run's), unless the run
    resumes from a checkpoint, whose state the Trainer then loads over it.

    `create_scheduler`: for `warmup_stable_decay`, `num_decay_steps` from `warmdown_ratio` and `min_lr_ratio` from
    `final_lr_frac` unless `lr_scheduler_kwargs` sets them (linear decay, as nanochat)."""

    optimizer_state: str | os.PathLike | None = None

    def __init__(self, *args, optimizer_state: str | os.PathLike | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer_state = optimizer_state
        if getattr(self.args, "use_muon", False):
            from hfl3.optim import refuse_unsupported_sharding

            # Here, not in create_optimizer: a DeepSpeed config with its own optimizer section skips that.
            refuse_unsupported_sharding(self.args)

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._num_training_steps = num_training_steps
        super().create_optimizer_and_scheduler(num_training_steps)

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return super().create_optimizer(model)
        if getattr(self.args, "use_muon", False):
            from hfl3.optim import muon_optimizer  # the setup was refused in __init__ if Muon cannot run under it

            scale = self.args.batch_lr_scale * getattr(self.args, "init_lr_frac", 1.0)
            self.optimizer = muon_optimizer(model or self.model, self.args, batch_lr_scale=scale,
                                            num_training_steps=getattr(self, "_num_training_steps", None))
        else:
            super().create_optimizer(model)
            for group in self.optimizer.param_groups:  # before create_scheduler records the groups' initial_lr
                group["lr"] *= self.args.batch_lr_scale
        if self.optimizer_state is not None and not getattr(self, "resume_checkpoint", None):
            loaded = load_optimizer_state(self.optimizer, model or self.model, self.optimizer_state)
            logger.info("optimizer warm-started from the base's optimizer state (%d parameters; this run's LRs)",
                        loaded)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.args.lr_scheduler_type == "warmup_stable_decay":
            kwargs = dict(self.args.lr_scheduler_kwargs or {})
            kwargs.setdefault("num_decay_steps", round(self.args.warmdown_ratio * num_training_steps))
            kwargs.setdefault("min_lr_ratio", self.args.final_lr_frac)
            kwargs.setdefault("decay_type", "linear")
            self.args.lr_scheduler_kwargs = kwargs
        return super().create_scheduler(num_training_steps, optimizer)

    def save_optimizer_state(self) -> Path | None:
        """`optimizer/optimizer.safetensors` in `args.output_dir` (inside `finish_output`: the staged final folder),
        written by the main process, for an SFT run's warm start (`hfl3.optim.state_file`). Not under DeepSpeed or
        FSDP, whose optimizers hold shards (a log line says so). Returns the file, or None."""
        if self.optimizer is None:
            return None
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            logger.info("%s not written: DeepSpeed and FSDP shard the optimizer state (a fine-tuning of this model "
                        "starts its optimizer fresh)", FILE)
            return None
        path = Path(self.args.output_dir) / FILE
        if self.args.should_save:
            save_optimizer_state(getattr(self.optimizer, "optimizer", self.optimizer),
                                 self.accelerator.unwrap_model(self.model, keep_torch_compile=False), path)
        return path


def optimizer_metadata(args, model) -> dict:
    """What trains `model` with `args`, for an output's `metadata.json` (`optimizer`) and `python -m hfl3.provenance
    show`: MuonAdamW's group LRs at their peak (the groups `create_optimizer` builds: `param_groups_by_kind` with the
    batch LR scale and SFT's `init_lr_frac`), the Muon weight decay and, where SFT derived them, the learning rate
    they came from (`GroupLearningRates.for_fine_tuning`); else the Trainer's optimizer and its learning rate."""
    optim = getattr(args.optim, "value", args.optim)
    if not getattr(args, "use_muon", False):
        return {"name": optim, "learning_rate": args.learning_rate, "weight_decay": args.weight_decay}
    from hfl3.optim import param_groups_by_kind

    scale = args.batch_lr_scale * getattr(args, "init_lr_frac", 1.0)
    groups = param_groups_by_kind(model, args, batch_lr_scale=scale)
    derived = {"from_learning_rate": args.learning_rate} if args.group_lrs_from_learning_rate else {}
    return {"name": "MuonAdamW", "learning_rates": {group["name"]: group["lr"] for group in groups},
            "weight_decay": args.weight_decay, **derived}
