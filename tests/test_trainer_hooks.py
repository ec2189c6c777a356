"""The private Trainer methods hfl3 still overrides, pinned to transformers 5.23's signatures: a release that renames
one or changes its parameters fails here, naming the hfl3 feature that would silently stop working, instead of a run
quietly losing it. Everything else hfl3's trainers change goes through public hooks (callbacks, `training_step`,
`compute_loss`, `create_optimizer`, `get_train_dataloader`, `get_batch_samples`, `log`, `save_model`, `train`)."""

import functools
import inspect

import datasets
import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from trl import SFTTrainer

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.trainers.metrics import NonFiniteTrainingError
from hfl3.trainers.hooks import TrainerHooks
from hfl3.trainers.pretraining.trainer import PackedCollator, PretrainTrainer
from hfl3.trainers.pretraining.config import PretrainConfig
from hfl3.trainers.sft.trainer import ChatSFTTrainer
from hfl3.trainers.sft.config import ChatSFTConfig

EMPTY = inspect.Parameter.empty
PRIVATE_HOOKS = [
    # (method, its parameters and defaults, the hfl3 feature that depends on it)
    ("_save_checkpoint", [("self", EMPTY), ("model", EMPTY), ("trial", EMPTY)],
     "staged checkpoints (TrainerHooks, hfl3.trainers.outputs.RunOutputs): the Trainer's whole checkpoint is written into _hfl3_staging and renamed "
     "to checkpoint-N once complete, hfl3_run.json and the data-stream state included, so a kill never leaves an "
     "incomplete checkpoint-N; no public hook wraps the checkpoint write (on_save runs after it)"),
    ("_get_grad_norm", [("self", EMPTY), ("model", EMPTY), ("grad_norm", None)],
     "the NaN/inf guard (TrainerHooks, hfl3.trainers.metrics.NonFiniteFlags): the pre-clipping gradient norm of every optimizer step, checked on the "
     "device; no public hook receives it (callbacks see it only in the logs, as a host float)"),
    ("_track_num_input_tokens", [("self", EMPTY), ("inputs", EMPTY)],
     "sync-free pretraining steps (PretrainTrainer): input tokens counted on the host and summed across processes only "
     "at logs; the Trainer's own count calls .item() after every micro-batch and no public hook replaces it"),
]


@pytest.mark.parametrize("name, parameters, feature", PRIVATE_HOOKS, ids=[hook[0] for hook in PRIVATE_HOOKS])
def test_each_private_hook_keeps_its_signature(name, parameters, feature):
    method = getattr(Trainer, name, None)
    assert callable(method), f"transformers' Trainer has no {name}; lost: {feature}"
    found = [(p.name, p.default) for p in inspect.signature(method).parameters.values()]
    assert found == parameters, f"Trainer.{name}{inspect.signature(method)} changed; check: {feature}"


def test_the_private_device_setup_keeps_its_shape():
    """`ProcessGroupTimeout` overrides `TrainingArguments._setup_devices`, a `cached_property` taking only `self`
    that `__post_init__` reaches through `self.device`: the feature that depends on it is `--ddp_timeout` acting with
    `--use_cpu` (a lost rank fails within it, not after torch's 30 minutes). And it is the only private name of
    `TrainingArguments` the recipes' arguments override."""
    hook = vars(TrainingArguments).get("_setup_devices")
    assert isinstance(hook, functools.cached_property), "TrainingArguments._setup_devices is gone or changed; lost: " \
        "--ddp_timeout with --use_cpu (hfl3.trainers.cli.launch.ProcessGroupTimeout)"
    assert list(inspect.signature(hook.func).parameters) == ["self"]
    for config in (PretrainConfig, ChatSFTConfig):
        hfl3_classes = [cls for cls in config.__mro__ if cls.__module__.startswith("hfl3.")]
        overridden = {name for cls in hfl3_classes for name in vars(cls) if name.startswith("_") and not
                      name.startswith("__") and hasattr(TrainingArguments, name)}
        assert overridden == {"_setup_devices"}, (config, overridden)
        assert isinstance(inspect.getattr_static(config, "_setup_devices"), functools.cached_property)


@pytest.mark.parametrize("trainer_class, base", [(PretrainTrainer, Trainer), (ChatSFTTrainer, SFTTrainer)])
def test_no_other_private_trainer_method_is_overridden(trainer_class, base):
    hfl3_classes = [cls for cls in trainer_class.__mro__ if cls.__module__.startswith("hfl3.")]
    overridden = {name for cls in hfl3_classes for name in vars(cls)
                  if name.startswith("_") and not name.startswith("__") and callable(getattr(base, name, None))}
    assert overridden <= {hook[0] for hook in PRIVATE_HOOKS}, overridden
    # and the pinned ones are really in use (a stale entry above would pin nothing)
    assert {"_save_checkpoint", "_get_grad_norm"} <= overridden
    assert ("_track_num_input_tokens" in overridden) == (trainer_class is PretrainTrainer)


TRAINERS = [(PretrainTrainer, Trainer), (ChatSFTTrainer, SFTTrainer)]


@pytest.mark.parametrize("trainer_class, base", TRAINERS, ids=["PretrainTrainer", "ChatSFTTrainer"])
def test_each_trainer_method_is_overridden_in_one_place(trainer_class, base):
    """The hfl3 part of each trainer's bases is the trainer and `TrainerHooks`, directly before the library's class:
    no order of bases to choose; and across hfl3 each method of the library's trainer is defined by one class only
    (docs/design.md, decision 19)."""
    hfl3_classes = [cls for cls in trainer_class.__mro__ if cls.__module__.startswith("hfl3.")]
    assert hfl3_classes == [trainer_class, TrainerHooks]
    assert trainer_class.__mro__[2] is base
    defined_by: dict[str, set] = {}
    for cls in {TrainerHooks, *(trainer for trainer, _ in TRAINERS)}:
        for name in vars(cls):
            if callable(getattr(base, name, None)) or isinstance(getattr(base, name, None), property):
                defined_by.setdefault(name, set()).add(cls.__name__)
    assert {name: owners for name, owners in defined_by.items() if len(owners) > 1} == {}
    assert {"__init__", "train", "training_step", "log", "_save_checkpoint"} <= {
        name for name, owners in defined_by.items() if owners == {"TrainerHooks"}}  # the guard: the hooks are seen


def test_the_hooks_together(tmp_path):
    """MuonAdamW is built, a checkpoint is staged and committed, and a NaN at step 2 stops the run before anything of
    that step is saved (docs/design.md, decision 19)."""
    trainer_class = PretrainTrainer
    torch.manual_seed(0)
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(1, vocab_size=64, aspect_ratio=64, head_dim=32,
                                                    max_position_embeddings=16))
    rows = datasets.Dataset.from_dict({"input_ids": torch.randint(1, 64, (16, 16)).tolist()})
    args = PretrainConfig(output_dir=str(tmp_path), optim="muon", max_steps=4, save_steps=1, max_length=16,
                          per_device_train_batch_size=4, logging_steps=1, eval_strategy="no", report_to="none",
                          disable_tqdm=True, dataloader_num_workers=0, use_cpu=True)

    class Poison(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:  # step 2's forward reads a NaN weight
                with torch.no_grad():
                    model.model.embed_tokens.weight.fill_(float("nan"))

    trainer = trainer_class(model=model, args=args, train_dataset=rows, data_collator=PackedCollator(0, True),
                            callbacks=[Poison()])
    with pytest.raises(NonFiniteTrainingError, match="training diverged at step 2"):
        trainer.train()
    assert type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__ \
        == "MuonAdamW"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    assert (tmp_path / "checkpoint-1" / "hfl3_run.json").is_file()


@pytest.mark.parametrize("trainer_class", [PretrainTrainer, ChatSFTTrainer])
def test_both_trainers_refuse_what_muon_cannot_run_under_when_built(trainer_class, tmp_path, assets, monkeypatch):
    """A DeepSpeed config with its own `optimizer` block: DeepSpeed would build that optimizer and never call the
    Trainer's `create_optimizer`, so the trainer's `OptimizerSetup` refuses it at construction, before any step; the
    same trainer without Muon, or with Muon outside DeepSpeed, is built."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(1, vocab_size=len(tokenizer), aspect_ratio=64, head_dim=32,
                                                    max_position_embeddings=16))
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4, "labels": [[1, 2, 3, 4]] * 4})
    config_class = PretrainConfig if trainer_class is PretrainTrainer else ChatSFTConfig
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)

    def build(optim: str, deepspeed: dict | None):
        args = config_class(output_dir=str(tmp_path), optim=optim, max_steps=2, max_length=16, report_to="none",
                            use_cpu=True, eval_strategy="no", save_strategy="no", disable_tqdm=True)
        monkeypatch.setattr(args, "deepspeed", deepspeed)  # as `--deepspeed` gives it, without starting DeepSpeed
        return trainer_class(model=model, args=args, train_dataset=rows, processing_class=tokenizer)

    with pytest.raises(RuntimeError, match="MuonAdamW cannot run under this setup: the DeepSpeed config has an "
                                           "'optimizer' block"):
        build("muon", {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}})
    assert build("muon", None).optimizer_setup.use_muon
    assert not build("adamw_torch", {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
                     ).optimizer_setup.use_muon
