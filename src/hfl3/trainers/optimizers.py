"""The optimizer of both recipes' trainers, declared once: `MuonTrainingArguments` (the Muon fields and `--optim
muon`, which `PretrainConfig` and `ChatSFTConfig` inherit) and what the trainers' hooks call
(`hfl3.trainers.hooks.TrainerHooks`): `create_optimizer` (`MuonAdamW` with nanochat's parameter groups or the
Trainer's own optimizer, every group's LR scaled, and a warm start from a saved optimizer state),
`set_schedule_defaults` (the warmup → constant → linear warmdown schedule) and `write_optimizer_state`.

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


def refuse_what_muon_cannot_run_under(args) -> None:
    """With `args.use_muon`, refuse the sharded setups Muon cannot run under (`hfl3.optim.refuse_unsupported_sharding`),
    when the trainer is built: a DeepSpeed config with its own optimizer section never calls `create_optimizer`."""
    if getattr(args, "use_muon", False):
        from hfl3.optim import refuse_unsupported_sharding

        refuse_unsupported_sharding(args)


def create_optimizer(trainer, model, create_default) -> None:
    """Build `trainer.optimizer`, the one place both trainers' optimizers come from.

    With `args.use_muon`: `hfl3.optim.muon_optimizer` with the args' group LRs; otherwise the Trainer's own optimizer
    (`create_default(model)`: `--optim`). Every group's LR is multiplied by `args.batch_lr_scale` (Muon: but the smear
    group's, as nanochat) and, with Muon, by `args.init_lr_frac` when the args have it (nanochat chat SFT's start at a
    fraction of the base LRs). With `trainer.optimizer_state` (a file `hfl3.optim.state_file.save_optimizer_state`
    wrote), the new optimizer is warm-started from it (its momentum buffers and moments; the groups' LRs and step
    counts stay this run's), unless the run resumes from a checkpoint, whose state the Trainer then loads over it."""
    args = trainer.args
    if getattr(args, "use_muon", False):
        from hfl3.optim import muon_optimizer  # the setup was refused when the trainer was built if Muon cannot run

        scale = args.batch_lr_scale * getattr(args, "init_lr_frac", 1.0)
        trainer.optimizer = muon_optimizer(model or trainer.model, args, batch_lr_scale=scale,
                                           num_training_steps=getattr(trainer, "num_training_steps", None))
    else:
        create_default(model)
        for group in trainer.optimizer.param_groups:  # before create_scheduler records the groups' initial_lr
            group["lr"] *= args.batch_lr_scale
    if trainer.optimizer_state is not None and not getattr(trainer, "resume_checkpoint", None):
        loaded = load_optimizer_state(trainer.optimizer, model or trainer.model, trainer.optimizer_state)
        logger.info("optimizer warm-started from the base's optimizer state (%d parameters; this run's LRs)", loaded)


def set_schedule_defaults(args, num_training_steps: int) -> None:
    """For `warmup_stable_decay`: `num_decay_steps` from `warmdown_ratio` and `min_lr_ratio` from `final_lr_frac`
    unless `lr_scheduler_kwargs` sets them (linear decay, as nanochat), written into `args.lr_scheduler_kwargs`."""
    if args.lr_scheduler_type == "warmup_stable_decay":
        kwargs = dict(args.lr_scheduler_kwargs or {})
        kwargs.setdefault("num_decay_steps", round(args.warmdown_ratio * num_training_steps))
        kwargs.setdefault("min_lr_ratio", args.final_lr_frac)
        kwargs.setdefault("decay_type", "linear")
        args.lr_scheduler_kwargs = kwargs


def write_optimizer_state(trainer) -> Path | None:
    """`optimizer/optimizer.safetensors` in `args.output_dir` (inside `finish_output`: the staged final folder),
    written by the main process, for an SFT run's warm start (`hfl3.optim.state_file`). Not under DeepSpeed or FSDP,
    whose optimizers hold shards (a log line says so). Returns the file, or None."""
    if trainer.optimizer is None:
        return None
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        logger.info("%s not written: DeepSpeed and FSDP shard the optimizer state (a fine-tuning of this model starts "
                    "its optimizer fresh)", FILE)
        return None
    path = Path(trainer.args.output_dir) / FILE
    if trainer.args.should_save:
        save_optimizer_state(getattr(trainer.optimizer, "optimizer", trainer.optimizer),
                             trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False), path)
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
