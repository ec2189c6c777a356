"""The optimizer of both recipes' trainers, declared once: its config section, `MuonTrainingArguments` (the Muon
fields and `--optim muon`, which `PretrainConfig` and `ChatSFTConfig` inherit), and the component built from it,
`OptimizerSetup`, which each trainer holds (`trainer.optimizer_setup`) and its hooks hand the optimizer's work to
(`hfl3.trainers.hooks.TrainerHooks`): `MuonAdamW` with nanochat's parameter groups or the Trainer's own optimizer,
every group's LR scaled, a warm start from a saved optimizer state, the warmup → constant → linear warmdown
schedule, the saved optimizer state and the `optimizer` block of `metadata.json`.

transformers 5.23 has no way to register an optimizer name: `TrainingArguments.__post_init__` converts `optim` to its
closed enum `OptimizerNames` (unknown names raise), and the Trainer builds only those (`get_optimizer_cls_and_kwargs`,
a private table); an optimizer of one's own reaches the Trainer through its public `optimizers` /
`optimizer_cls_and_kwargs` arguments or a `create_optimizer` override, which is the hooks'. So "muon" is taken
out of `optim` before transformers validates it (`MuonTrainingArguments.take_muon_out_of_optim`): `optim="muon"`
becomes `use_muon=True` with `optim` "adamw_torch", what runs MuonAdamW's AdamW groups (torch's AdamW), and
`to_dict()` records both (docs/design.md, decision 2).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hfl3.optim import create_muon_optimizer, param_groups_by_kind, refuse_unsupported_sharding
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
    `learning_rate`, `hfl3.trainers.sft.inheritance`). Call `take_muon_out_of_optim` first in `__post_init__`."""

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
                `hfl3.trainers.cli.arguments.check_training_arguments`).
        """
        if self.optim == MUON:
            self.use_muon, self.optim = True, "adamw_torch"
        elif self.use_muon and self.optim != "adamw_torch":
            raise ValueError(f"use_muon=True with optim={self.optim}: MuonAdamW replaces the Trainer's optimizer (its "
                             "AdamW groups run torch's AdamW, optim adamw_torch); drop --optim or --use_muon")


class OptimizerSetup:
    """The optimizer of one run, built from its arguments (their `MuonTrainingArguments` fields and the Trainer's
    `optim`, `learning_rate`, `weight_decay`, betas, `lr_scheduler_type`) and the file to warm-start from; what a
    trainer's optimizer hooks delegate to. Built by the builders (`build_sft_trainer`: with the base's optimizer
    state) or, when a trainer is given none, by `TrainerHooks.__init__` from its arguments.

    Args:
        args: the run's `TrainingArguments` with the `MuonTrainingArguments` fields (`PretrainConfig`,
            `ChatSFTConfig`); the trainer that holds the setup replaces them by its own `args` (the same values, in a
            copy where `ChatSFTTrainer.hand_over_arguments` hands TRL others), which its scheduler reads.
        optimizer_state: a file `hfl3.optim.state_file.save_optimizer_state` wrote, to warm-start the optimizer from,
            or None.

    Attributes:
        num_training_steps: the steps the Trainer plans (`create_optimizer_and_scheduler`), the horizon of Muon's
            weight decay; None until then (then `args.max_steps`).

    Raises:
        RuntimeError: with `args.use_muon`, a distributed setup Muon cannot run under
            (`hfl3.optim.refuse_unsupported_sharding`), here, when the trainer is built: a DeepSpeed config with its
            own optimizer section never calls `create_optimizer`.
    """

    def __init__(self, args, optimizer_state: str | os.PathLike | None = None):
        self.args = args
        self.optimizer_state = optimizer_state
        self.num_training_steps: int | None = None
        if self.use_muon:
            refuse_unsupported_sharding(args)

    @property
    def use_muon(self) -> bool:
        return getattr(self.args, "use_muon", False)

    @property
    def lr_scale(self) -> float:
        """What multiplies every group's LR: `batch_lr_scale` and, with Muon, `init_lr_frac` when the args have it
        (nanochat chat SFT's start at a fraction of the base LRs)."""
        return self.args.batch_lr_scale * (getattr(self.args, "init_lr_frac", 1.0) if self.use_muon else 1.0)

    def create_optimizer(self, model, create_default: Callable[[], torch.optim.Optimizer],
                         resume_checkpoint: str | None = None) -> torch.optim.Optimizer:
        """The optimizer of `model`, the one place both trainers' optimizers come from.

        With `args.use_muon`: `hfl3.optim.create_muon_optimizer` with the args' group LRs; otherwise the Trainer's own
        optimizer (`create_default()`: `--optim`). Every group's LR is multiplied by `lr_scale` (Muon: but the smear
        group's, as nanochat). With `optimizer_state`, the new optimizer is warm-started from it (its momentum buffers
        and moments; the groups' LRs and step counts stay this run's), unless the run resumes from
        `resume_checkpoint`, whose state the Trainer then loads over it."""
        if self.use_muon:
            optimizer = create_muon_optimizer(model, self.args, batch_lr_scale=self.lr_scale,
                                              num_training_steps=self.num_training_steps)
        else:
            optimizer = create_default()
            for group in optimizer.param_groups:  # before create_scheduler records the groups' initial_lr
                group["lr"] *= self.lr_scale
        if self.optimizer_state is not None and not resume_checkpoint:
            loaded = load_optimizer_state(optimizer, model, self.optimizer_state)
            logger.info("optimizer warm-started from the base's optimizer state (%d parameters; this run's LRs)",
                        loaded)
        return optimizer

    def set_schedule_defaults(self, num_training_steps: int) -> None:
        """For `warmup_stable_decay`: `num_decay_steps` from `warmdown_ratio` and `min_lr_ratio` from `final_lr_frac`
        unless `lr_scheduler_kwargs` sets them (linear decay, as nanochat), written into `args.lr_scheduler_kwargs`."""
        args = self.args
        if args.lr_scheduler_type == "warmup_stable_decay":
            kwargs = dict(args.lr_scheduler_kwargs or {})
            kwargs.setdefault("num_decay_steps", round(args.warmdown_ratio * num_training_steps))
            kwargs.setdefault("min_lr_ratio", args.final_lr_frac)
            kwargs.setdefault("decay_type", "linear")
            args.lr_scheduler_kwargs = kwargs

    def save_state(self, trainer) -> Path | None:
        """`optimizer/optimizer.safetensors` in `args.output_dir` (inside `finish_output`: the staged final folder),
        `trainer.optimizer`'s state written by the main process, for an SFT run's warm start
        (`hfl3.optim.state_file`). Not under DeepSpeed or FSDP, whose optimizers hold shards (a log line says so).
        Returns the file, or None."""
        if trainer.optimizer is None:
            return None
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            logger.info("%s not written: DeepSpeed and FSDP shard the optimizer state (a fine-tuning of this model "
                        "starts its optimizer fresh)", FILE)
            return None
        path = Path(self.args.output_dir) / FILE
        if self.args.should_save:
            save_optimizer_state(getattr(trainer.optimizer, "optimizer", trainer.optimizer),
                                 trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False), path)
        return path

    def metadata(self, model) -> dict:
        """What trains `model`, for an output's `metadata.json` (`optimizer`) and `python -m hfl3.provenance show`:
        MuonAdamW's group LRs at their peak (the groups `create_optimizer` builds: `param_groups_by_kind` with
        `lr_scale`), the Muon weight decay and, where SFT derived them, the learning rate they came from
        (`GroupLearningRates.for_fine_tuning`); else the Trainer's optimizer and its learning rate."""
        args = self.args
        optim = getattr(args.optim, "value", args.optim)
        if not self.use_muon:
            return {"name": optim, "learning_rate": args.learning_rate, "weight_decay": args.weight_decay}
        groups = param_groups_by_kind(model, args, batch_lr_scale=self.lr_scale)
        derived = {"from_learning_rate": args.learning_rate} if args.group_lrs_from_learning_rate else {}
        return {"name": "MuonAdamW", "learning_rates": {group["name"]: group["lr"] for group in groups},
                "weight_decay": args.weight_decay, **derived}
