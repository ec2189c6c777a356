"""One pretraining path: what the recipe builds (`build_pretraining`) and what a benchmark arm builds from the same
arguments (`build_model` + `build_trainer`, as benchmarks/vs_nanochat.py, trainer_overhead.py and l3_vs_dense.py do)
train the same; the output folder the arguments' checks resolved is the one the trainer uses, probed once."""

import copy

import pytest
import torch

from hfl3.trainers.pretraining import builder as pretrain_builder
from hfl3.trainers.outputs import folder
from recipe_setup import set_up_recipe
from hfl3.trainers.pretraining.compute_optimal import apply_plan, parameter_counts
from hfl3.trainers.pretraining.builder import build_model, build_pretraining, build_trainer

TINY = ["--max_steps", "2", "--tokenizer_train_chars", "100000", "--l3_sample_tokens", "20000", "--max_eval_rows",
        "4", "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--optim", "muon"]


def parsed(pretrain_recipe, repo_root, output_dir, *extra):
    return set_up_recipe(pretrain_recipe, [
        "--config", str(repo_root / "recipes" / "configs" / "pretrain_tiny.yaml"), "--output_dir", str(output_dir),
        *TINY, *extra])


def optimizer_groups(trainer) -> list[dict]:
    """Each group of the trainer's optimizer without its tensors: its kind, settings and parameter shapes."""
    trainer.create_optimizer()
    return [{key: value for key, value in group.items() if key != "params"} |
            {"shapes": [tuple(p.shape) for p in group["params"]]} for group in trainer.optimizer.param_groups]


@pytest.mark.slow
def test_a_benchmark_arm_built_from_the_recipes_arguments_trains_as_the_recipe(tmp_path, pretrain_recipe, repo_root):
    script, training_args, model_args, setup = parsed(pretrain_recipe, repo_root, tmp_path / "recipe")
    run = build_pretraining(script, training_args, model_args, setup)
    recipe = run.trainer
    # The arm: the recipe's arguments, its plan and stream, a model of the same config with the same weights
    _, arm_args, _, _ = parsed(pretrain_recipe, repo_root, tmp_path / "arm")
    apply_plan(arm_args, run.plan)
    model = build_model(copy.deepcopy(recipe.model.config), arm_args, allocation=recipe.model.model.l3_counts())
    model.load_state_dict(recipe.model.state_dict())
    arm = build_trainer(model, arm_args, run.data.train, run.plan.flops_per_token, tokenizer=recipe.processing_class,
                        eval_rows=run.data.eval_rows)
    assert parameter_counts(arm.model) == parameter_counts(recipe.model)
    assert optimizer_groups(arm) == optimizer_groups(recipe)  # Muon and AdamW groups, LRs scaled by the plan
    batch = next(iter(recipe.get_train_dataloader()))
    batch.pop("data_state")
    assert torch.equal(arm.data_collator([{"input_ids": row} for row in batch["input_ids"].numpy()])["position_ids"],
                       batch["position_ids"])
    for trainer in (recipe, arm):
        trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first step
    losses = [trainer.training_step(trainer.model, dict(batch)) for trainer in (recipe, arm)]
    assert torch.equal(losses[0], losses[1])  # same forward, loss and backward: one path
    for (name, a), b in zip(recipe.model.named_parameters(), arm.model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    # The guard: a trainer built another way (here, the Trainer's own AdamW) is told apart
    _, adamw_args, _, _ = parsed(pretrain_recipe, repo_root, tmp_path / "adamw", "--optim", "adamw_torch",
                                 "--eval_strategy", "no")
    apply_plan(adamw_args, run.plan)
    other = build_trainer(copy.deepcopy(model), adamw_args, run.data.train, None, tokenizer=recipe.processing_class)
    assert optimizer_groups(other) != optimizer_groups(recipe)


@pytest.mark.slow
def test_the_output_folder_is_resolved_once_and_is_what_the_trainer_uses(tmp_path, pretrain_recipe, repo_root,
                                                                         monkeypatch):
    probes = []
    monkeypatch.setattr(folder, "separate_disks", lambda path: probes.append(path) or folder.SeparateDisks())
    script, training_args, model_args, setup = parsed(pretrain_recipe, repo_root, tmp_path / "out", "--max_steps",
                                                      "1", "--eval_strategy", "no")
    assert len(probes) == 1 and setup.output.path == tmp_path / "out"
    run = build_pretraining(script, training_args, model_args, setup)
    assert run.trainer.outputs.folder is setup.output
    run.trainer.train()
    assert len(probes) == 1  # no second probe, resolution or checkpoint lookup in train()
    assert run.trainer.outputs.folder is setup.output and run.trainer.outputs.resume_checkpoint is None


def test_the_builder_refuses_what_muon_cannot_run_under_before_any_data_work(tmp_path, pretrain_recipe, repo_root,
                                                                              monkeypatch):
    """The run's `OptimizerSetup` is built first: a ZeRO-3 config that offloads the parameters, under which Muon's
    sharded step cannot run, is refused before the corpus is opened or a tokenizer trained."""
    script, training_args, model_args, setup = parsed(pretrain_recipe, repo_root, tmp_path / "out")
    monkeypatch.setattr(training_args, "deepspeed", {"zero_optimization": {"stage": 3,
                                                                           "offload_param": {"device": "cpu"}}})
    monkeypatch.setattr(pretrain_builder, "open_data", lambda *args: pytest.fail("the corpus was opened first"))
    with pytest.raises(RuntimeError, match="MuonAdamW cannot run under this setup: ZeRO offload_param to cpu"):
        build_pretraining(script, training_args, model_args, setup)
