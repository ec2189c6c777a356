"""MuonAdamW: references (float64 SVD polar factor, torch.optim.Muon, torch.optim.AdamW), grouping,
schedules, Trainer integration and resume identity (under DeepSpeed ZeRO / FSDP2: test_muon_sharded.py and
tests/distributed)."""

import logging
import math
from dataclasses import fields

import pytest
import torch
from torch import nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.optim import (
    GroupLearningRates,
    MuonAdamW,
    MuonSettings,
    create_muon_optimizer,
    muon_momentum,
    normuon_rescale,
    orthogonalize,
    param_groups_by_kind,
    weight_decay_factor,
)
from hfl3.optim.settings import ADAMW_DEFAULTS, POLAR_EXPRESS_COEFFICIENTS, POLAR_EXPRESS_NORM_SAFETY

KELLER_JORDAN_COEFFICIENTS = ((DEFAULT_A, DEFAULT_B, DEFAULT_C),) * 5
TORCH_MUON_SETTINGS = dict(  # MuonAdamW as torch.optim.Muon (NorMuon, cautious WD, warm-up, MuonEq, Muon+ off)
    ns_coefficients=KELLER_JORDAN_COEFFICIENTS,
    ns_norm_safety=1.0,
    eps=1e-7,
    orthogonalize_dtype="bfloat16",
    beta2=None,
    cautious_weight_decay=False,
    momentum_warmup_steps=0,
    muon_eq=None,
    muon_plus=False,
)


def tiny_l3gpt(tie_kv: bool = True, seed: int = 0) -> L3GPTForCausalLM:
    torch.manual_seed(seed)
    config = L3GPTConfig.from_depth(
        2, vocab_size=512, aspect_ratio=64, head_dim=64, max_position_embeddings=64, window_pattern="L",
        l3_after_layers=[0], l3_n_emb=1024, l3_k_max=8, l3_d_up=64, l3_tie_kv=tie_kv,
    )  # fmt: skip
    return L3GPTForCausalLM(config)


def tiny_qwen3(tie_word_embeddings: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def polar_express_map(singular_values: torch.Tensor) -> torch.Tensor:
    """The scalar polynomial the iteration applies to each normalised singular value, in float64."""
    x = singular_values.double()
    for a, b, c in POLAR_EXPRESS_COEFFICIENTS:
        x = a * x + b * x**3 + c * x**5
    return x


# ---------------------------------------------------------------------------------------------------------------------
# Orthogonalisation against the float64 SVD polar factor


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (96, 96)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_orthogonalize_is_the_polar_express_image_of_the_svd(shape, dtype, tolerance):
    torch.manual_seed(1)
    matrix = torch.randn(shape)
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    result = orthogonalize(matrix, dtype=dtype).double()
    assert result.dtype == torch.float64 and result.shape == shape

    # same singular vectors as the input, singular values mapped by the Polar Express polynomial
    expected = u @ torch.diag(polar_express_map(s / (POLAR_EXPRESS_NORM_SAFETY * matrix.double().norm()))) @ vh
    assert (result - expected).norm() / expected.norm() < tolerance

    # the band: what the polynomial does to any singular value in [1e-3, 1] of the normalised input
    band = polar_express_map(torch.logspace(-3, 0, 4001, dtype=torch.float64) / POLAR_EXPRESS_NORM_SAFETY)
    assert 0.8 < band.min() < band.max() < 1.2
    result_singular_values = torch.linalg.svdvals(result)
    smallest_ratio = (s.min() / matrix.double().norm()).item()
    if smallest_ratio > 1e-3:
        assert band.min() - tolerance <= result_singular_values.min()
    assert result_singular_values.max() <= band.max() + tolerance
    polar = u @ vh  # close to it: the band is the distance (singular values far below the band drag it further)
    assert (result - polar).norm() / polar.norm() < (0.15 if smallest_ratio > 1e-3 else 0.3)


def test_orthogonalize_with_fixed_coefficients_equals_torch_newton_schulz():
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(2)
    for shape in [(32, 80), (80, 32)]:
        matrix = torch.randn(shape)
        ours = orthogonalize(matrix, KELLER_JORDAN_COEFFICIENTS, norm_safety=1.0, eps=1e-7)
        theirs = _zeropower_via_newtonschulz(matrix, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7)
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", [(16,), (2, 3, 4, 4)])
def test_orthogonalize_rejects_what_is_neither_a_matrix_nor_a_stack(shape):
    with pytest.raises(ValueError, match="2-D matrix or a 3-D stack"):
        orthogonalize(torch.randn(shape))


# ---------------------------------------------------------------------------------------------------------------------
# One optimizer step against torch's own optimizers


@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
@pytest.mark.parametrize("warmup_steps", [0, 2])
def test_muon_steps_match_torch_optim_muon(shape, warmup_steps):
    torch.manual_seed(3)
    ours = nn.Parameter(torch.randn(shape))
    theirs = nn.Parameter(ours.detach().clone())
    settings = {**TORCH_MUON_SETTINGS, "momentum_warmup_steps": warmup_steps}
    optimizer = MuonAdamW([{"params": [ours], "kind": "muon", "lr": 0.05, "weight_decay": 0.1, **settings}])
    reference = torch.optim.Muon([theirs], lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True)
    for step in range(4):
        grad = torch.randn(shape)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        reference.param_groups[0]["momentum"] = muon_momentum(step, 0.95, 0.85, warmup_steps)
        optimizer.step()
        reference.step()
        assert torch.equal(ours, theirs), f"step {step}"
    assert torch.equal(optimizer.state[ours]["momentum_buffer"], reference.state[theirs]["momentum_buffer"])


def test_adamw_part_matches_torch_optim_adamw_exactly():
    torch.manual_seed(4)
    shapes = [(64, 16), (16,), (8, 16)]
    ours = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    hyper = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.05)
    optimizer = MuonAdamW([{"params": ours[:2], "kind": "adamw", **hyper}, {"params": ours[2:], "kind": "adamw"}])
    reference = torch.optim.AdamW([{"params": theirs[:2], **hyper}, {"params": theirs[2:], **ADAMW_DEFAULTS}])
    for _ in range(5):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        optimizer.step()
        reference.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def test_orthogonalize_dtype_auto_is_float32_on_cpu_and_bad_groups_are_refused():
    torch.manual_seed(7)
    start = torch.randn(8, 16)
    params = [nn.Parameter(start.clone()) for _ in range(2)]
    grad = torch.randn(8, 16)
    optimizers = [
        MuonAdamW([{"params": [param], "kind": "muon", "orthogonalize_dtype": dtype}])
        for param, dtype in zip(params, ("auto", "float32"))
    ]
    for param, optimizer in zip(params, optimizers):
        param.grad = grad.clone()
        optimizer.step()
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], start)
    with pytest.raises(ValueError, match="orthogonalize_dtype"):
        MuonAdamW([{"params": [params[0]], "kind": "muon", "orthogonalize_dtype": "float16"}])
    with pytest.raises(ValueError, match="kind='muon' or kind='adamw'"):
        MuonAdamW([{"params": [params[0]]}])
    with pytest.raises(ValueError, match=r"unknown keys \['momentum'\]"):
        MuonAdamW([{"params": [params[0]], "kind": "adamw", "momentum": 0.9}])
    optimizers[0].add_param_group({"params": [nn.Parameter(torch.zeros(3))], "kind": "adamw", "name": "late"})
    late = optimizers[0].param_groups[-1]
    assert (late["betas"], late["step"], late["num_training_steps"]) == ((0.8, 0.95), 0, None)


def test_cautious_weight_decay_only_decays_where_update_and_weight_agree():
    torch.manual_seed(5)
    param = nn.Parameter(torch.randn(16, 32))
    grad = torch.randn(16, 32)
    start = param.detach().clone()
    settings = {**TORCH_MUON_SETTINGS, "cautious_weight_decay": True, "momentum": 0.0, "nesterov": False}
    optimizer = MuonAdamW([{"params": [param], "kind": "muon", "lr": 0.1, "weight_decay": 0.5, **settings}])
    param.grad = grad
    optimizer.step()
    update = orthogonalize(grad, KELLER_JORDAN_COEFFICIENTS, norm_safety=1.0).float()
    agree = (update * start) >= 0
    assert 0.2 < agree.float().mean() < 0.8  # both cases occur
    expected = start - 0.1 * 0.5 * start * agree - 0.1 * update
    torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6)


def test_normuon_rescale_matches_nanochat_formula():
    torch.manual_seed(6)
    for shape in [(24, 8), (8, 24)]:
        second_moment = torch.rand((shape[0], 1) if shape[0] >= shape[1] else (1, shape[1]))
        buffer = second_moment.clone()
        update = torch.randn(shape) * torch.linspace(0.1, 3, shape[0])[:, None]
        ours = normuon_rescale(update, buffer, beta2=0.9)
        # nanochat/optim.py muon_step_fused, written out
        reduce_dim = -1 if shape[0] >= shape[1] else -2
        v_mean = update.square().mean(dim=reduce_dim, keepdim=True)
        size = update.size(reduce_dim)
        v_norm = (v_mean.sum() * size).sqrt()
        second_moment.lerp_(v_mean, 0.1)
        step_size = second_moment.clamp_min(1e-10).rsqrt()
        v_norm_new = ((v_mean * size) * step_size.square()).sum().sqrt()
        expected = update * step_size * (v_norm / v_norm_new)
        torch.testing.assert_close(buffer, second_moment)
        torch.testing.assert_close(ours, expected)
        torch.testing.assert_close(ours.norm(), update.norm())  # the Frobenius norm is kept
        assert not torch.allclose(ours, update)


# ---------------------------------------------------------------------------------------------------------------------
# Schedules


def test_momentum_warmup_and_weight_decay_decay_follow_nanochat():
    assert [muon_momentum(step, 0.95, 0.85, 300) for step in (0, 150, 300, 5000)] == pytest.approx(
        [0.85, 0.90, 0.95, 0.95]
    )
    assert [weight_decay_factor(step, 100) for step in (0, 25, 100, 150)] == [1.0, 0.75, 0.0, 0.0]
    assert weight_decay_factor(10**6, None) == 1.0


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_weight_decay_decays_linearly_with_the_optimizer_step(kind):
    param = nn.Parameter(torch.full((4, 4), 2.0))
    optimizer = MuonAdamW([{"params": [param], "kind": kind, "lr": 0.1, "weight_decay": 0.5}], num_training_steps=4)
    expected = 2.0
    for step in range(6):
        param.grad = torch.zeros_like(param)  # zero update: only the weight decay moves the weight
        optimizer.step()
        expected *= 1 - 0.1 * 0.5 * max(0.0, 1 - step / 4)
        torch.testing.assert_close(param.detach(), torch.full((4, 4), expected))
    assert optimizer.param_groups[0]["step"] == 6


# ---------------------------------------------------------------------------------------------------------------------
# Grouping by module kind and shape


def _expected_l3gpt_groups(model):
    base = model.model
    expected = {id(model.lm_head.weight): "unembedding", id(base.embed_tokens.weight): "embedding"}
    expected[id(base.resid_lambdas)] = "residual_scalar"
    expected[id(base.x0_lambdas)] = "scalar"
    for param in (base.smear.gate.weight, base.smear.smear_lambda, base.backout_lambda):
        expected[id(param)] = "smear"
    for table in base.value_embeddings.values():
        expected[id(table.weight)] = "value_embedding"
    for layer in base.layers:
        for linear in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                       layer.mlp.up_proj, layer.mlp.down_proj):  # fmt: skip
            expected[id(linear.weight)] = "matrix"
        if layer.self_attn.value_embedding_gate is not None:  # nanochat: ve_gate with the Muon matrices
            expected[id(layer.self_attn.value_embedding_gate.weight)] = "matrix"
    for l3 in base.l3_layers.values():
        expected[id(l3.up_proj.weight)] = expected[id(l3.mix_proj.weight)] = "matrix"
        expected[id(l3.key_table.weight)] = "l3_table"
        if l3.value_table is not None:
            expected[id(l3.value_table.weight)] = "l3_table"
    return expected


def _expected_qwen3_groups(model):
    expected = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            expected[id(param)] = "matrix" if isinstance(module, nn.Linear) else "scalar"
    expected[id(model.model.embed_tokens.weight)] = "embedding"
    expected[id(model.lm_head.weight)] = "unembedding"  # tied: the shared weight, once
    return expected


GROUPING_CASES = [
    ("l3gpt_tied_kv", lambda: tiny_l3gpt(tie_kv=True), _expected_l3gpt_groups, 128),
    ("l3gpt_untied_kv", lambda: tiny_l3gpt(tie_kv=False), _expected_l3gpt_groups, 128),
    ("qwen3_untied", lambda: tiny_qwen3(False), _expected_qwen3_groups, 64),
    ("qwen3_tied", lambda: tiny_qwen3(True), _expected_qwen3_groups, 64),
]


@pytest.mark.parametrize(
    "name, build, expected_groups, hidden_size", GROUPING_CASES, ids=[case[0] for case in GROUPING_CASES]
)
def test_param_groups_by_kind(name, build, expected_groups, hidden_size):
    model = build()
    groups = param_groups_by_kind(model)
    placed = {id(p): group["name"] for group in groups for p in group["params"]}
    assert sum(len(group["params"]) for group in groups) == len(placed)  # no parameter twice
    assert placed == expected_groups(model)
    assert len(placed) == len(list(model.parameters()))
    scale = (hidden_size / 768) ** -0.5
    lrs = {group["name"]: group["lr"] for group in groups}
    assert lrs["matrix"] == 0.02 and lrs["unembedding"] == pytest.approx(0.004 * scale)
    assert lrs["scalar"] == 0.5
    if "qwen3_tied" != name:
        assert lrs["embedding"] == pytest.approx(0.3 * scale)
    if name.startswith("l3gpt"):
        assert lrs["l3_table"] == pytest.approx(0.3 * scale) and lrs["residual_scalar"] == pytest.approx(0.005)
        assert lrs["value_embedding"] == pytest.approx(0.15 * scale) and lrs["smear"] == 0.2  # nanochat's
    for group in groups:
        assert group["kind"] == ("muon" if group["name"] == "matrix" else "adamw")
        if group["kind"] == "muon":
            assert all(p.ndim == 2 for p in group["params"])


def test_grouping_leaves_out_frozen_parameters_and_refuses_unknown_matrices():
    model = tiny_qwen3(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    placed = {id(p) for group in param_groups_by_kind(model) for p in group["params"]}
    assert id(model.model.embed_tokens.weight) not in placed
    model.model.add_module("conv", nn.Conv1d(4, 4, 3))
    with pytest.raises(ValueError, match=r"'model\.conv\.weight'.*Conv1d"):
        param_groups_by_kind(model)


# ---------------------------------------------------------------------------------------------------------------------
# create_muon_optimizer and the Trainer


def _args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True, learning_rate=0.02,
        per_device_train_batch_size=4, max_steps=6, logging_steps=1, save_strategy="no", seed=0,
        lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.1,
    )  # fmt: skip
    values.update(overrides)
    return TrainingArguments(**values)


def test_create_muon_optimizer_maps_training_arguments(tmp_path, caplog):
    model = tiny_l3gpt()
    args = _args(tmp_path, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-10, learning_rate=5e-5)
    with caplog.at_level(logging.WARNING, logger="hfl3.optim.groups"):
        optimizer = create_muon_optimizer(model, args, momentum_warmup_steps=10, matrix_lr=0.03)
    assert "learning_rate=5e-05 is not used" in caplog.text
    assert optimizer.compile_update is None  # MuonAdamW's default: compiled on CUDA only
    assert create_muon_optimizer(model, args, compile_update=True).compile_update is True
    for group in optimizer.param_groups:
        assert group["num_training_steps"] == 6  # from args.max_steps
        if group["kind"] == "muon":
            assert (group["lr"], group["weight_decay"], group["momentum_warmup_steps"]) == (0.03, 0.1, 10)
        else:
            assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-10, 0.0)
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        create_muon_optimizer(model, args, momentun=0.9)
    with pytest.raises(ValueError, match="num_training_steps"):
        create_muon_optimizer(model, _args(tmp_path, max_steps=-1, num_train_epochs=1))


def _train_dataset(rows: int = 32, length: int = 32):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 512, (rows, length), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": input_ids, "labels": input_ids})


class _LearningRateRecorder(TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append([group["lr"] for group in optimizer.param_groups])


def _unwrap(optimizer):
    """The optimizer inside accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


def _trainer(tmp_path, model, **overrides):
    args = _args(tmp_path, **overrides)
    optimizer = create_muon_optimizer(model, args, momentum_warmup_steps=4)
    return Trainer(model=model, args=args, train_dataset=_train_dataset(), optimizers=(optimizer, None))


@pytest.mark.slow
def test_trainer_schedules_every_group_and_resume_continues_identically(tmp_path):
    model = tiny_l3gpt()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = _trainer(tmp_path / "full", model, save_strategy="steps", save_steps=3)
    optimizer = trainer.optimizer
    initial_lrs = [group["lr"] for group in optimizer.param_groups]
    recorder = _LearningRateRecorder()
    trainer.add_callback(recorder)
    trainer.train()

    # the Trainer's scheduler was built on MuonAdamW and scaled every group by the same multiplier
    assert isinstance(optimizer, MuonAdamW) and _unwrap(trainer.lr_scheduler.optimizer) is optimizer
    assert len(recorder.lrs) == 6
    for step, lrs in enumerate(recorder.lrs, start=1):
        multiplier = trainer.lr_scheduler.lr_lambdas[0](step)
        assert lrs == pytest.approx([lr * multiplier for lr in initial_lrs])
    assert {round(trainer.lr_scheduler.lr_lambdas[0](step), 6) for step in range(1, 7)} == {1.0, 0.75, 0.5, 0.25, 0}
    assert [group["step"] for group in optimizer.param_groups] == [6] * len(initial_lrs)
    assert all(not torch.equal(p, start[name]) for name, p in model.named_parameters()), "a parameter never moved"

    # resume from step 3 in a fresh model/Trainer/optimizer: same weights and optimizer state as the full run
    saved = torch.load(tmp_path / "full" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert [group["step"] for group in saved["param_groups"]] == [3] * len(initial_lrs)
    resumed_model = tiny_l3gpt()
    resumed = _trainer(tmp_path / "resumed", resumed_model)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    resumed_optimizer = _unwrap(resumed.optimizer)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, resumed_optimizer.state[q][key]), key


def test_lr_scale_uses_the_hidden_size():
    model = tiny_qwen3(False)
    lrs = {g["name"]: g["lr"] for g in param_groups_by_kind(model, hidden_size=3072)}
    assert lrs["embedding"] == pytest.approx(0.3 * math.sqrt(768 / 3072))


def test_each_setting_is_declared_once_and_read_by_config_grouping_and_update(tmp_path):
    from hfl3.trainers.pretraining.config import PretrainConfig

    # the recipe's config inherits the group LRs (default and help), so --help and a bare param_groups_by_kind agree
    declared = {item.name: (item.default, item.metadata["help"]) for item in fields(GroupLearningRates)}
    config = {item.name: (item.default, item.metadata["help"]) for item in fields(PretrainConfig)
              if item.name in declared}
    assert config == declared
    args = PretrainConfig(output_dir=str(tmp_path), optim="muon", scalar_lr=0.25, report_to="none")
    model = tiny_l3gpt()
    lrs = {group["name"]: group["lr"] for group in param_groups_by_kind(model, args)}
    assert lrs == GroupLearningRates(scalar_lr=0.25).learning_rates(model.config.hidden_size)
    assert lrs["residual_scalar"] == pytest.approx(0.25 * GroupLearningRates.RESIDUAL_SCALAR_LR_FACTOR)
    # a Muon group is filled from MuonSettings, which the update then takes whole; a bad value is refused there
    group = MuonAdamW([{"params": [nn.Parameter(torch.zeros(4, 4))], "kind": "muon", "beta2": None}]).param_groups[0]
    assert MuonSettings.from_group(group) == MuonSettings(beta2=None) and group["lr"] == args.matrix_lr
    with pytest.raises(ValueError, match="muon_eq='rows'"):
        create_muon_optimizer(model, args, muon_eq="rows")
