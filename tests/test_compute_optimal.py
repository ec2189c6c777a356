"""nanochat's compute-optimal dial (`hfl3.trainers.pretraining.compute_optimal`): equal to what nanochat master's own
`scripts/base_train.py` computes, the formulas, the gradient-accumulation derivation and its errors, and the plan
reaching the optimizer through `PretrainConfig` and `PretrainTrainer`."""

import json
import math

import pytest

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.trainers.pretraining.compute_optimal import (
    REFERENCE_TOTAL_BATCH_SIZE,
    apply_plan,
    auto_total_batch_size,
    compute_optimal_plan,
    derive_gradient_accumulation_steps,
)
from hfl3.trainers.pretraining.trainer import PretrainTrainer
from hfl3.trainers.pretraining.config import PretrainConfig

# nanochat master (karpathy/nanochat 92d63d4) run on its own code, up to its training loop, on the meta device:
#   python dev/nanochat_dial_reference.py --nanochat_dir PATH/TO/nanochat --depth D --world_size W [-- EXTRA]
# (vocab 32768, seq 2048, aspect ratio 64, head dim 128, SSSL, device batch 32 unless EXTRA says otherwise; output
# in dev/LOG.md 2026-11-24). Per case: EXTRA, then depth, world size, nanochat's param_counts (wte, value_embeds,
# lm_head, transformer_matrices, scalars, total), num_flops_per_token, target_tokens, D_REF, total_batch_size,
# num_iterations, grad_accum_steps, batch_lr_scale, weight_decay_scaled, and its optimizer groups' LRs.
D12 = dict(counts=(25165824, 150994944, 25165824, 84935088, 50, 286261730), flops=759696048)
D20 = dict(counts=(41943040, 419430400, 41943040, 393217200, 66, 896533746), flops=2886212784,
           target_tokens=5221922880, reference_tokens=1321210944, batch=1048576, lr_scale=1.4142135623730951,
           weight_decay=0.1001877764255601,
           lrs=dict(lm_head=0.00876356092008266, wte=0.3286335345030997, value_embeds=0.16431676725154984,
                    resid_lambdas=0.007071067811865476, x0_lambdas=0.7071067811865476, smear=0.2,
                    muon=0.028284271247461905))
D12_DEFAULT = dict(**D12, target_tokens=1321210944, reference_tokens=1321210944, batch=524288, steps=2520,
                   lr_scale=1.0, weight_decay=0.28,
                   lrs=dict(lm_head=0.008, wte=0.3, value_embeds=0.15, resid_lambdas=0.005, x0_lambdas=0.5,
                            smear=0.2, muon=0.02))
NANOCHAT = [
    dict(extra={}, depth=12, world_size=1, accumulation=8, **D12_DEFAULT),
    dict(extra={}, depth=12, world_size=8, accumulation=1, **D12_DEFAULT),
    dict(extra={}, depth=20, world_size=1, steps=4980, accumulation=16, **D20),
    dict(extra={}, depth=20, world_size=8, steps=4980, accumulation=2, **D20),
    # -- --target-flops 1e19
    dict(extra=dict(target_flops=1e19), depth=20, world_size=8, steps=3304, accumulation=2, **D20),
    # -- --num-iterations 500 --device-batch-size 16 (nanochat's total batch stays auto: hfl3 --total_batch_size -1)
    dict(extra=dict(max_steps=500, per_device_train_batch_size=16, total_batch_size=-1), depth=20, world_size=8,
         steps=500, accumulation=4, **D20),
    # -- --total-batch-size 262144 --target-param-data-ratio 20
    dict(extra=dict(total_batch_size=262144, target_param_data_ratio=20), depth=12, world_size=1, **D12,
         target_tokens=2202018240, reference_tokens=2202018240, batch=262144, steps=8400, accumulation=4,
         lr_scale=0.7071067811865476, weight_decay=0.19798989873223333,
         lrs=dict(lm_head=0.005656854249492381, wte=0.21213203435596426, value_embeds=0.10606601717798213,
                  resid_lambdas=0.003535533905932738, x0_lambdas=0.3535533905932738, smear=0.2,
                  muon=0.014142135623730952)),
    # -- --target-param-data-ratio 8.25 --device-batch-size 16
    dict(extra=dict(target_param_data_ratio=8.25, per_device_train_batch_size=16), depth=26, world_size=8,
         counts=(54525952, 708837376, 54525952, 863897580, 78, 1681786938), flops=5991051288,
         target_tokens=7576994139, reference_tokens=908332524.0, batch=1048576, steps=7225, accumulation=4,
         lr_scale=1.4142135623730951, weight_decay=0.04747018702740847,
         lrs=dict(lm_head=0.007686151382644183, wte=0.2882306768491568, value_embeds=0.1441153384245784,
                  resid_lambdas=0.007071067811865476, x0_lambdas=0.7071067811865476, smear=0.2,
                  muon=0.028284271247461905)),
]
# nanochat's optimizer group → hfl3's MuonAdamW group
GROUP_NAMES = dict(lm_head="unembedding", wte="embedding", value_embeds="value_embedding",
                   resid_lambdas="residual_scalar", x0_lambdas="scalar", smear="smear", muon="matrix")
# A few float64 products in another order than nanochat's (e.g. lr·b·s vs lr·(s·b)): <= 4 ulps ≈ 1e-15 relative
FLOAT64_ORDER = 1e-12


def nanochat_configs(depth: int, vocab_size: int = 32768, max_length: int = 2048) -> tuple[L3GPTConfig, L3GPTConfig]:
    """The model and its d12 reference as nanochat's `build_model_meta` builds them (n_kv_head = n_head)."""
    sizing = dict(vocab_size=vocab_size, aspect_ratio=64, head_dim=128, max_position_embeddings=max_length,
                  window_pattern="SSSL")
    return L3GPTConfig.from_depth(depth, **sizing), L3GPTConfig.from_depth(12, **sizing)


def nanochat_args(tmp_path, **changes) -> PretrainConfig:
    """nanochat master's base_train defaults as PretrainConfig fields."""
    defaults = dict(output_dir=str(tmp_path), optim="muon", max_length=2048, per_device_train_batch_size=32,
                    matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.008, scalar_lr=0.5, weight_decay=0.28,
                    eval_strategy="no", report_to="none")
    return PretrainConfig(**{**defaults, **changes})


@pytest.mark.parametrize("case", NANOCHAT, ids=lambda c: f"d{c['depth']}-ws{c['world_size']}-{c['extra']}")
def test_plan_equals_nanochat_base_train(tmp_path, case):
    config, reference = nanochat_configs(case["depth"])
    args = nanochat_args(tmp_path, **case["extra"])
    plan = compute_optimal_plan(config, reference, args, world_size=case["world_size"])
    counts = plan.parameter_counts
    assert (counts["embedding"], counts["value_embedding"], counts["unembedding"], counts["matrix"],
            counts["scalar"], counts["total"]) == case["counts"]
    assert counts["l3_table"] == 0 and counts["scaling"] == case["counts"][2] + case["counts"][3]
    assert plan.flops_per_token == case["flops"]
    assert plan.target_tokens == case["target_tokens"]
    assert plan.reference_tokens == pytest.approx(case["reference_tokens"], rel=FLOAT64_ORDER)
    assert (plan.total_batch_size, plan.max_steps, plan.gradient_accumulation_steps) == (
        case["batch"], case["steps"], case["accumulation"])
    assert plan.lr_scale == pytest.approx(case["lr_scale"], rel=FLOAT64_ORDER)
    assert plan.weight_decay == pytest.approx(case["weight_decay"], rel=FLOAT64_ORDER)
    expected = {GROUP_NAMES[name]: lr for name, lr in case["lrs"].items()}
    assert plan.learning_rates == pytest.approx(expected, rel=FLOAT64_ORDER)


def test_the_formulas(tmp_path):
    """B = 2^round(log2(2^19 · (D/D_ref)^0.383)), steps by precedence max_steps > target_flops > ratio, LR scale
    √(B/2^19), λ = λ_ref · √(B/2^19) · D_ref/D — recomputed here from the plan's own N, D and F."""
    assert auto_total_batch_size(1.0, 1.0) == 2**19
    assert auto_total_batch_size(2 ** (0.49 / 0.383), 1.0) == 2**19  # log2 B = 19.49 rounds down
    assert auto_total_batch_size(2 ** (0.51 / 0.383), 1.0) == 2**20  # 19.51 rounds up
    assert auto_total_batch_size(1.0, 2 ** (1.51 / 0.383)) == 2**17  # smaller models: smaller batches
    config, reference = nanochat_configs(6, vocab_size=50304, max_length=1024)
    plans = {name: compute_optimal_plan(config, reference, nanochat_args(tmp_path, max_length=1024, **changes),
                                        world_size=2)
             for name, changes in [("ratio", dict(target_param_data_ratio=20)),
                                   ("flops", dict(target_param_data_ratio=20, target_flops=3e17)),
                                   ("steps", dict(target_param_data_ratio=20, target_flops=3e17, max_steps=77,
                                                  total_batch_size=-1))]}
    ratio = plans["ratio"]
    n, n_ref = ratio.parameter_counts["scaling"], ratio.reference_scaling_parameters
    d, d_ref = int(20 * n), 20 * n_ref
    batch = 2 ** round(math.log2(2**19 * (d / d_ref) ** 0.383))
    assert n < n_ref and batch == 2**18  # d6 is below the d12 reference: log2 B = 18.22
    for plan in plans.values():  # the ratio's D sets the batch and the weight decay whatever sets the steps
        assert (plan.target_tokens, plan.total_batch_size) == (d, batch)
        assert plan.gradient_accumulation_steps == batch // (32 * 1024 * 2)
        assert plan.lr_scale == pytest.approx(math.sqrt(batch / 2**19), rel=FLOAT64_ORDER)
        assert plan.weight_decay == pytest.approx(0.28 * math.sqrt(batch / 2**19) * d_ref / d, rel=FLOAT64_ORDER)
    assert (ratio.horizon, ratio.max_steps) == ("target_param_data_ratio", d // batch)
    assert plans["flops"].horizon == "target_flops"
    assert plans["flops"].max_steps == round(3e17 / (ratio.flops_per_token * batch)) != d // batch
    assert (plans["steps"].horizon, plans["steps"].max_steps) == ("max_steps", 77)
    json.dumps(ratio.as_dict())  # metadata.json section
    assert ratio.as_dict()["training_tokens"] == d // batch * batch


def test_l3_tables_are_lookups_and_its_projections_matrices(tmp_path):
    dense, reference = nanochat_configs(12)
    l3 = L3GPTConfig.from_depth(12, vocab_size=32768, max_position_embeddings=2048, window_pattern="SSSL",
                                l3_after_layers=[5], l3_n_emb=4 * 32768, l3_d_up=3072)
    args = nanochat_args(tmp_path)
    dense_plan, l3_plan = (compute_optimal_plan(c, reference, args, world_size=8) for c in (dense, l3))
    assert l3_plan.parameter_counts["l3_table"] == 4 * 32768 * 768
    projections = 768 * 3072 + (3072 + 768) * 768  # up (d_up x C) and mix (C x (d_up + C))
    assert l3_plan.parameter_counts["scaling"] == dense_plan.parameter_counts["scaling"] + projections
    assert l3_plan.reference_scaling_parameters == dense_plan.reference_scaling_parameters  # dense d12
    assert l3_plan.learning_rates["l3_table"] == pytest.approx(0.3 * l3_plan.lr_scale, rel=FLOAT64_ORDER)


def test_sized_by_hand_rescales_nothing(tmp_path):
    config, reference = nanochat_configs(12)
    args = nanochat_args(tmp_path, max_steps=100, gradient_accumulation_steps=3, per_device_train_batch_size=4)
    plan = compute_optimal_plan(config, reference, args, world_size=2)
    assert not plan.sized_by_dial and plan.batch_size_rule == "trainer"
    assert (plan.total_batch_size, plan.gradient_accumulation_steps, plan.max_steps) == (4 * 2048 * 2 * 3, 3, 100)
    assert (plan.lr_scale, plan.weight_decay) == (1.0, 0.28)
    assert plan.learning_rates["matrix"] == 0.02
    assert "sized by hand" in plan.table()


def test_accumulation_is_derived_and_refused_when_it_does_not_divide(tmp_path):
    assert derive_gradient_accumulation_steps(2**19, 32, 2048, 8) == 1
    assert derive_gradient_accumulation_steps(2**19, 32, 2048, 1) == 8
    assert derive_gradient_accumulation_steps(2**20, 16, 2048, 8) == 4
    with pytest.raises(ValueError, match=r"total_batch_size=524,288 tokens is not a multiple of "
                                         r"per_device_train_batch_size × max_length × world size = 24 × 2048 × 8"):
        derive_gradient_accumulation_steps(2**19, 24, 2048, 8)
    with pytest.raises(ValueError, match="is not a multiple of"):  # at parse time for a given batch
        nanochat_args(tmp_path, total_batch_size=100_000)
    config, reference = nanochat_configs(12)
    with pytest.raises(ValueError, match="is not a multiple of"):  # the auto batch, once the model is known
        compute_optimal_plan(config, reference, nanochat_args(tmp_path, per_device_train_batch_size=24), world_size=8)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 contradicts total_batch_size=524,288"):
        compute_optimal_plan(config, reference, nanochat_args(tmp_path, gradient_accumulation_steps=4), world_size=1)
    with pytest.raises(ValueError, match="less than one step"):
        compute_optimal_plan(config, reference, nanochat_args(tmp_path, target_flops=1e9), world_size=1)


@pytest.mark.parametrize("changes, match", [
    (dict(total_batch_size=0), "total_batch_size=0"),
    (dict(total_batch_size=-2), "total_batch_size=-2"),
    (dict(target_flops=-1.0), "target_flops=-1.0 must be positive"),
    (dict(target_param_data_ratio=0.0), "target_param_data_ratio=0.0 must be positive"),
])
def test_bad_dial_arguments(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        nanochat_args(tmp_path, **changes)


@pytest.mark.parametrize("max_steps", [0, -5])
def test_max_steps_zero_names_pretrainings_own_sizing_rule(tmp_path, max_steps):
    with pytest.raises(ValueError) as error:
        PretrainConfig(output_dir=str(tmp_path), max_steps=max_steps, report_to="none")
    assert str(error.value) == (
        f"max_steps={max_steps}: expected a positive number of optimizer steps, or -1 (the default) to size the run by "
        "the compute-optimal dial: --target_flops, else --target_param_data_ratio tokens per scaling parameter "
        "(pretraining streams its data: it takes no --num_train_epochs)")


def tiny_model() -> L3GPTForCausalLM:
    return L3GPTForCausalLM(L3GPTConfig.from_depth(2, vocab_size=512, aspect_ratio=32, head_dim=32,
                                                   max_position_embeddings=64, window_pattern="SL"))


@pytest.mark.parametrize("optim", ["muon", "adamw_torch"])
def test_the_plan_reaches_the_trainer_and_its_optimizer(tmp_path, optim):
    """`apply_plan` sets the steps, the accumulation and λ, and the optimizer's groups get the plan's
    LRs (√(512 / 2^19) = 1/32 here: every group but Muon's smear scaled)."""
    model = tiny_model()
    config = model.config
    args = PretrainConfig(output_dir=str(tmp_path), optim=optim, max_length=64, per_device_train_batch_size=4,
                          total_batch_size=512, target_param_data_ratio=500, weight_decay=0.28,
                          learning_rate=0.01, eval_strategy="no", report_to="none")
    reference = L3GPTConfig.from_depth(12, vocab_size=512, aspect_ratio=32, head_dim=32, max_position_embeddings=64,
                                       window_pattern="SL")
    plan = compute_optimal_plan(config, reference, args)
    assert plan.lr_scale == 1 / 32 and plan.gradient_accumulation_steps == 2
    apply_plan(args, plan)
    assert (args.max_steps, args.gradient_accumulation_steps) == (plan.max_steps, 2) and plan.max_steps > 0
    assert args.weight_decay == plan.weight_decay != 0.28
    assert "batch_lr_scale" not in args.to_dict()  # derived, not an argument
    with pytest.raises(RuntimeError, match="already applied"):
        apply_plan(args, plan)
    trainer = PretrainTrainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(args.max_steps)
    if optim == "muon":
        lrs = {group["name"]: group["lr"] for group in trainer.optimizer.param_groups}
        assert lrs == pytest.approx(plan.learning_rates, rel=FLOAT64_ORDER)
        assert lrs["smear"] == 0.2 and lrs["matrix"] == pytest.approx(0.02 / 32, rel=FLOAT64_ORDER)
        assert {group["weight_decay"] for group in trainer.optimizer.param_groups if group["kind"] == "muon"} == {
            plan.weight_decay}
    else:
        assert [group["lr"] for group in trainer.optimizer.param_groups] == pytest.approx([0.01 / 32] * 2)
        assert trainer.optimizer.param_groups[0]["weight_decay"] == plan.weight_decay
    assert trainer.lr_scheduler.base_lrs == [group["lr"] for group in trainer.optimizer.param_groups]


@pytest.mark.parametrize("name, depth, steps, batch, accumulation", [
    ("fineweb_d12", 12, 2520, 2**19, 8), ("fineweb_d20", 20, 4980, 2**20, 32)])
def test_recipe_configs_use_the_dial(tmp_path, pretrain_recipe, repo_root, name, depth, steps, batch, accumulation):
    """The FineWeb configs set no max_steps: a dry run (no data read, vocabulary --vocab_size 32768, one process)
    plans nanochat master's run for their depth."""
    from recipe_setup import recipe_main

    plan, (script_args, training_args, model_args) = recipe_main(pretrain_recipe, [
        "--config", str(repo_root / "recipes" / "configs" / f"{name}.yaml"), "--dry_run", "--use_cpu",
        "--output_dir", str(tmp_path / "never_written")])
    assert model_args.depth == depth and training_args.max_steps == -1  # nothing applied by a dry run
    assert (plan["max_steps"], plan["total_batch_size"], plan["gradient_accumulation_steps"]) == (
        steps, batch, accumulation)
    assert plan["learning_rates"]["unembedding"] == pytest.approx(
        0.008 * (64 * depth / 768) ** -0.5 * math.sqrt(batch / REFERENCE_TOTAL_BATCH_SIZE), rel=FLOAT64_ORDER)
    assert not (tmp_path / "never_written").exists()
