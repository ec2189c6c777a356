"""FP8 training (hfl3.fp8): numerics vs bf16 nn.Linear, skip rules, bf16 switch-back, checkpoints, short training
runs of a tiny L3GPT (hfl3's Float8Linear and accelerate's torchao backend)."""

import copy
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.fp8 import (
    E4M3,
    E5M2,
    FORMAT_MAX,
    Float8Linear,
    ao_recipe_kwargs,
    check_ao_backend,
    convert_to_float8_training,
    first_and_last_projections,
    float8_disabled,
    quantize,
    select_float8_layers,
)
from hfl3.fp8.linear import _pad_inner

MANTISSA_BITS = {E4M3: 3, E5M2: 2}


def rounding_rms(dtype: torch.dtype) -> float:
    """RMS relative rounding error of a format with p mantissa bits, for values log-uniform within a binade.

    Round-to-nearest leaves an absolute error uniform in ±2^-(p+1)·2^e for a value m·2^e, m ∈ [1, 2): relative
    error δ/m with E[δ²] = 2^-2(p+1)·2^2e/3 and E[1/m²] = 3/(8 ln 2) for log-uniform m, so
    RMS = 2^-(p+1)·sqrt(1 / (8 ln 2)) ≈ 0.0265 for e4m3 (p=3), 0.0531 for e5m2 (p=2).
    """
    return 2.0 ** -(MANTISSA_BITS[dtype] + 1) * math.sqrt(1 / (8 * math.log(2)))


def expected_matmul_error(a: torch.dtype, b: torch.dtype) -> float:
    """Normwise relative error of A·B with independently rounded operands: sqrt(rms_a² + rms_b²) (random-sign
    errors add in quadrature over the K terms of each dot product). Forward (e4m3·e4m3) ≈ 0.0375; backward
    (e5m2·e4m3) ≈ 0.0594. The accumulation and bf16 output (2^-9) are negligible next to these."""
    return math.hypot(rounding_rms(a), rounding_rms(b))


def rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference.double()).norm() / reference.double().norm()).item()


def fp8_and_reference(recipe: str, in_features: int, out_features: int, dtype=torch.bfloat16, seed: int = 0):
    torch.manual_seed(seed)
    reference = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    return Float8Linear.from_linear(copy.deepcopy(reference), recipe), reference


def forward_backward(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad_out)
    return y.detach(), x.grad, layer.weight.grad


def tiny_l3gpt_config(vocab_size: int = 256) -> L3GPTConfig:
    """hidden 128, 2 layers, one L3 layer: every projection has both dims ≥ 128, so the skip rules are exercised."""
    return L3GPTConfig.from_depth(
        2, vocab_size=vocab_size, aspect_ratio=64, head_dim=64, max_position_embeddings=128, window_pattern="L",
        l3_after_layers=[0], l3_n_emb=1024, l3_k_max=16, l3_d_up=128, l3_tie_kv=True,
    )


def float8_layer_names(model: nn.Module) -> list[str]:
    """Names of the FP8 layers (hfl3's `Float8Linear` or torchao's), in `named_modules()` order."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]


def has_float8(model: nn.Module) -> bool:
    return bool(float8_layer_names(model))


# Projections of the tiny L3GPT that hfl3 converts: all but layer 0's q/k/v (read the embedding) and lm_head.
EXPECTED_CONVERTED = [
    "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj",
    "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
    "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj",
    "model.l3_layers.0.up_proj", "model.l3_layers.0.mix_proj",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These matmuls are tiny: on a shared 2-core box, two OpenMP threads per process fight and a step gets ~40×
    slower. Results do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shakespeare_bytes(assets) -> torch.Tensor:
    """UTF-8 bytes of Tiny Shakespeare as token ids (byte-level vocabulary of 256): real, learnable text."""
    return torch.tensor(list((assets / "text" / "tinyshakespeare.txt").read_bytes()[:200_000]), dtype=torch.long)


def test_format_constants_match_torch():
    assert FORMAT_MAX == {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max} == {E4M3: 448.0, E5M2: 57344.0}


@pytest.mark.parametrize("dim", [None, -1, 0])
def test_quantize_power_of_two_scales_in_range(dim):
    torch.manual_seed(0)
    x = torch.randn(48, 80) * torch.logspace(-3, 3, 80)  # columns spanning six decades
    for dtype in (E4M3, E5M2):
        data, scale = quantize(x, dtype, dim)
        assert data.dtype == dtype and scale.dtype == torch.float32
        assert scale.shape == (() if dim is None else (1, 80) if dim == 0 else (48, 1))
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
        assert data.float().abs().max() <= FORMAT_MAX[dtype]
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
        assert torch.all(amax / scale > FORMAT_MAX[dtype] / 2)  # the largest value uses the top binade
        # normal-range values are recovered to within one rounding (2^-(p+1) relative)
        recovered = data.float() * scale
        normal = x.abs() >= torch.finfo(dtype).tiny * scale
        bound = 2.0 ** -(MANTISSA_BITS[dtype] + 1)
        assert torch.all((recovered - x).abs()[normal] <= bound * x.abs()[normal] * (1 + 1e-6))


NUMERICS_CASES = [  # (recipe, input shape, out_features)
    ("tensorwise", (64, 128), 256),
    ("tensorwise", (3, 50, 256), 384),
    ("tensorwise", (257, 512), 128),
    ("rowwise", (64, 128), 256),
    ("rowwise", (3, 50, 256), 384),
    ("rowwise", (257, 512), 128),
]


@pytest.mark.parametrize("recipe,shape,out_features", NUMERICS_CASES)
def test_numerics_vs_bf16_linear(recipe, shape, out_features):
    """Forward and both gradients against a bf16 nn.Linear: within ±25% of the error expected from FP8 rounding
    (so also *not* much smaller: a path that silently skipped quantisation would fail)."""
    fp8, reference = fp8_and_reference(recipe, shape[-1], out_features)
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=torch.bfloat16)
    grad_out = torch.randn(*shape[:-1], out_features, dtype=torch.bfloat16)
    got, want = forward_backward(fp8, x, grad_out), forward_backward(reference, x, grad_out)
    assert got[0].shape == want[0].shape and [t.dtype for t in got] == [torch.bfloat16] * 3
    for name, actual, expected, operands in zip(
        ("output", "grad_input", "grad_weight"), got, want, ((E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3))
    ):
        error, bound = rel_err(actual, expected), expected_matmul_error(*operands)
        assert 0.75 * bound <= error <= 1.25 * bound, f"{recipe} {name}: error {error:.4f}, expected ≈{bound:.4f}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_autocast_and_bias(recipe):
    """fp32 master weights under bf16 autocast: bf16 output, fp32 weight grad, bias added in the compute dtype."""
    torch.manual_seed(0)
    reference = nn.Linear(128, 256)
    fp8 = Float8Linear.from_linear(copy.deepcopy(reference), recipe)
    x, grad_out = torch.randn(2, 32, 128), torch.randn(2, 32, 256, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = forward_backward(fp8, x, grad_out), forward_backward(reference, x, grad_out)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == got[2].dtype == torch.float32
    assert rel_err(got[0], want[0]) <= 1.25 * expected_matmul_error(E4M3, E4M3)
    assert torch.allclose(fp8.bias.grad, reference.bias.grad, rtol=1e-2, atol=1e-2)  # dL/db = Σ g, not quantised


def _cpu_scaled_mm_works() -> bool:
    try:
        one = torch.tensor(1.0)
        torch._scaled_mm(torch.zeros(16, 16, dtype=E4M3), torch.zeros(16, 16, dtype=E4M3).t(), one, one)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _cpu_scaled_mm_works(), reason="this torch build has no CPU torch._scaled_mm")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_path_matches_emulation(recipe):
    """The torch._scaled_mm path (layouts, scale shapes, K padding: 40 tokens is not a multiple of 16) gives the
    emulation's numbers; rowwise differs by the bf16 rounding of the rowwise kernel's output (2^-9)."""
    fp8, _ = fp8_and_reference(recipe, 256, 128, dtype=torch.float32)
    torch.manual_seed(2)
    x, grad_out = torch.randn(5, 8, 256), torch.randn(5, 8, 128)
    fp8.use_scaled_mm = False
    emulated = forward_backward(fp8, x, grad_out)
    fp8.use_scaled_mm = True
    native = forward_backward(fp8, x, grad_out)
    tolerance = 1e-6 if recipe == "tensorwise" else 2.0**-8
    for a, b in zip(native, emulated):
        assert rel_err(a, b) <= tolerance


def test_pad_inner_keeps_scaled_mm_layouts():
    """torch._scaled_mm wants a row-major, b column-major and K % 16 == 0 (grad_weight's K is the token count)."""
    a = quantize(torch.randn(8, 40), E5M2, None)[0]  # (M, K)
    b = quantize(torch.randn(24, 40), E4M3, None)[0].t()  # (K, N), column-major
    padded_a, padded_b = _pad_inner(a, b)
    assert padded_a.shape == (8, 48) and padded_b.shape == (48, 24)
    assert padded_a.is_contiguous() and padded_b.t().is_contiguous()
    assert torch.equal(padded_a[:, :40].float(), a.float()) and not padded_a[:, 40:].float().any()
    assert torch.equal(padded_b[:40].float(), b.float()) and not padded_b[40:].float().any()


def test_rowwise_beats_tensorwise_on_outlier_rows():
    """Four rows 10^5× larger: the tensorwise scale pushes the other rows below e4m3's normal range (its normal
    binades span 448 / 2^-6 ≈ 2.9·10^4, so ratios up to ~10^3 cost tensorwise nothing); rowwise keeps their relative
    error at the FP8 rounding level."""
    torch.manual_seed(3)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    outliers = torch.tensor([5, 40, 77, 100])
    x[outliers] *= 1e5
    normal_rows = torch.ones(128, dtype=torch.bool)
    normal_rows[outliers] = False
    errors = {}
    for recipe in ("tensorwise", "rowwise"):
        fp8, reference = fp8_and_reference(recipe, 256, 256)
        with torch.no_grad():
            errors[recipe] = rel_err(fp8(x)[normal_rows], reference(x)[normal_rows])
    assert errors["rowwise"] <= 1.25 * expected_matmul_error(E4M3, E4M3)
    assert errors["tensorwise"] >= 5 * errors["rowwise"], errors


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype,magnitude", [(torch.bfloat16, 1e15), (torch.float32, 1e17), (torch.float32, 1e-12)])
def test_extreme_magnitudes_stay_finite(recipe, dtype, magnitude):
    """Inputs and gradients far outside the FP8 range (grad_weight ~ magnitude², still representable): the scales
    absorb the magnitude, nothing saturates to inf or flushes to zero."""
    fp8, reference = fp8_and_reference(recipe, 128, 128, dtype=dtype)
    torch.manual_seed(4)
    x, grad_out = torch.randn(32, 128, dtype=dtype) * magnitude, torch.randn(32, 128, dtype=dtype) * magnitude
    for got, want in zip(forward_backward(fp8, x, grad_out), forward_backward(reference, x, grad_out)):
        assert torch.isfinite(want).all() and want.abs().min() > 0  # the case itself is representable
        assert torch.isfinite(got).all()
        assert rel_err(got, want) <= 1.25 * expected_matmul_error(E5M2, E4M3)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_all_zero_input_gives_zero_not_nan(recipe):
    fp8, _ = fp8_and_reference(recipe, 128, 128, dtype=torch.float32)
    y, grad_x, grad_w = forward_backward(fp8, torch.zeros(16, 128), torch.zeros(16, 128))
    assert not y.any() and not grad_x.any() and not grad_w.any()


class Stack(nn.Module):
    """Not a transformers model: first/last are the first and last nn.Linear in registration order."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(128, 256)
        self.body = nn.ModuleDict({
            "big": nn.Linear(256, 256), "odd": nn.Linear(256, 200), "narrow": nn.Linear(256, 64),
            "wide_out": nn.Linear(200, 512), "kept": nn.Linear(512, 128),
        })
        self.head = nn.Linear(128, 256)


FILTER_CASES = [  # (name, reason prefix or None when converted)
    ("stem", "first projection"),
    ("body.big", None),
    ("body.odd", "in_features=256, out_features=200 not both multiples of 16"),
    ("body.narrow", "in_features=256, out_features=64: smaller dim < 128"),
    ("body.wide_out", "in_features=200, out_features=512 not both multiples of 16"),
    ("body.kept", None),
    ("head", "last projection"),
]


def test_skip_rules_table():
    selected, skipped = select_float8_layers(Stack())
    for name, reason in FILTER_CASES:
        if reason is None:
            assert name in selected and name not in skipped
        else:
            assert name not in selected and skipped[name].startswith(reason), (name, skipped.get(name))


def test_l3gpt_first_last_and_converted_names():
    model = L3GPTForCausalLM(tiny_l3gpt_config())
    first, last = first_and_last_projections(model)
    assert first == {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}
    assert last == {"lm_head"}
    assert convert_to_float8_training(model, recipe="rowwise") is model  # like torchao's
    assert float8_layer_names(model) == EXPECTED_CONVERTED
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(EXPECTED_CONVERTED) and has_float8(model)
    assert all(model.get_submodule(n).recipe == "rowwise" for n in converted)
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_module_filter_replaces_policy_but_not_the_multiple_of_16_rule():
    model = Stack()
    convert_to_float8_training(model, module_filter=lambda module, name: name != "body.big")
    # odd/wide_out still skipped (dims % 16)
    assert float8_layer_names(model) == ["stem", "body.narrow", "body.kept", "head"]


def test_conversion_keeps_parameters_and_refuses_a_second_pass():
    model = L3GPTForCausalLM(tiny_l3gpt_config())
    params_before = dict(model.named_parameters())
    convert_to_float8_training(model)
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params_before.items()}
    with pytest.raises(ValueError, match="already has FP8 layers"):
        convert_to_float8_training(model)
    with pytest.raises(ValueError, match="not one of"):
        convert_to_float8_training(Stack(), recipe="blockwise")


def test_refuses_model_converted_by_torchao():
    from torchao.float8 import convert_to_float8_training as torchao_convert

    model = Stack()
    torchao_convert(model, module_filter_fn=lambda module, name: name == "body.big")
    assert has_float8(model)
    with pytest.raises(ValueError, match="torchao"):
        convert_to_float8_training(model)


@pytest.mark.parametrize("autocast", [False, True])
def test_float8_disabled_is_exactly_plain_linear(autocast):
    torch.manual_seed(5)
    plain = nn.Linear(128, 256)
    fp8 = Float8Linear.from_linear(copy.deepcopy(plain), "tensorwise")
    model = nn.Sequential(fp8)
    x = torch.randn(4, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with float8_disabled(model):
            assert torch.equal(model(x), plain(x))
        assert not torch.equal(model(x), plain(x))  # FP8 again after the block
    with pytest.raises(RuntimeError, match="boom"), float8_disabled(model):
        raise RuntimeError("boom")
    assert fp8.fp8_enabled


def test_checkpoint_loads_into_plain_model(tmp_path):
    torch.manual_seed(6)
    model = L3GPTForCausalLM(tiny_l3gpt_config())
    convert_to_float8_training(model, recipe="tensorwise")
    batch = torch.randint(0, 256, (2, 32))
    model(input_ids=batch, labels=batch).loss.backward()
    with torch.no_grad():  # make every projection non-zero (o_proj/down_proj start at zero)
        for param in model.parameters():
            if param.grad is not None:
                param.add_(1e-2 * param.grad.sign())
    model.save_pretrained(tmp_path)
    plain, info = L3GPTForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert not has_float8(plain)
    assert torch.equal(plain.state_dict()["model.layers.1.mlp.up_proj.weight"],
                       model.state_dict()["model.layers.1.mlp.up_proj.weight"])
    fresh = L3GPTForCausalLM(tiny_l3gpt_config())
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad(), float8_disabled(model):
        expected = model(input_ids=batch).logits
        assert torch.equal(plain(input_ids=batch).logits, expected)
        assert torch.equal(fresh(input_ids=batch).logits, expected)


def train_losses(model, data, steps=25, batch_size=8, seq_len=64, lr=3e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        batch = torch.stack([data[s:s + seq_len] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_short_training_run_tracks_fp32(shakespeare_bytes):
    """25 AdamW steps on Shakespeare bytes: FP8 (emulated, fp32 compute) ends within 1% of the fp32 run's loss
    (mean of the last 5 steps), while the fp32 loss itself falls by > 1.5 nats, so 1% is a small fraction of the
    learning signal. Every step stays within 2% (the curves differ only by FP8 rounding)."""
    torch.manual_seed(0)
    base = L3GPTForCausalLM(tiny_l3gpt_config())
    reference = train_losses(copy.deepcopy(base), shakespeare_bytes)
    assert reference[0] - sum(reference[-5:]) / 5 > 1.5
    for recipe in ("tensorwise", "rowwise"):
        model = copy.deepcopy(base)
        convert_to_float8_training(model, recipe=recipe)
        losses = train_losses(model, shakespeare_bytes)
        final, final_ref = sum(losses[-5:]) / 5, sum(reference[-5:]) / 5
        assert abs(final - final_ref) <= 0.01 * final_ref, (recipe, final, final_ref)
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, reference)), recipe


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_ao_recipe_kwargs_apply_hfl3_rules_through_accelerate(shakespeare_bytes, fresh_accelerate_state):
    """accelerate's AO backend, given ao_recipe_kwargs, converts exactly hfl3's selection with torchao's
    Float8Linear (which runs on CPU through torch's CPU _scaled_mm) and steps every converted weight. That training
    through Float8Linear lowers the loss: `test_accelerate_ao_yaml_trains_and_saves_plain_checkpoint` (4 steps; CPU
    _scaled_mm is a reference kernel, ~1 s per 512x128x128, so the steps are taken once in the suite)."""
    from accelerate import Accelerator
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    torch.manual_seed(0)
    model = L3GPTForCausalLM(tiny_l3gpt_config())
    accelerator = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[ao_recipe_kwargs(model)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    converted = {name: m for name, m in model.named_modules() if isinstance(m, TorchaoFloat8Linear)}
    assert list(converted) == EXPECTED_CONVERTED
    before = {name: m.weight.detach().clone() for name, m in converted.items()}
    batch = shakespeare_bytes[:128].view(4, 32)
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    assert math.isfinite(loss.item())
    assert not [name for name, m in converted.items() if torch.equal(m.weight, before[name])]


AO_ENV_CASES = [  # (name, env, TrainingArguments kwargs, expected: None | dict | error regex)
    ("not launched with fp8", {}, {}, None),
    ("yaml launch", {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "AO",
                     "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "False"}, {}, {"backend": "AO"}),
    ("--fp8_backend ao", {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "ao"}, {},
     "only accepts upper-case 'AO'"),
    ("AO without fp8", {"ACCELERATE_FP8_BACKEND": "AO"}, {}, "mixed_precision is not fp8"),
    ("bf16 overrides fp8", {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "AO",
                            "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "False"}, {"bf16": True},
     "--bf16 false"),
    ("all-gather default on", {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "AO"}, {},
     "enable_fsdp_float8_all_gather"),
    ("fp8 without backend picks AO", {"ACCELERATE_MIXED_PRECISION": "fp8",
                                      "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "0"}, {}, {"backend": "AO"}),
    ("TE is not ours", {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "TE"}, {}, None),
]


@pytest.mark.parametrize("name,env,kwargs,expected", AO_ENV_CASES, ids=[c[0] for c in AO_ENV_CASES])
def test_check_ao_backend(name, env, kwargs, expected, monkeypatch, tmp_path, fresh_accelerate_state):
    from transformers import TrainingArguments

    for key in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_FP8_BACKEND", "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            check_ao_backend(args)
    elif expected is None:
        assert check_ao_backend(args) is None
    else:
        assert check_ao_backend(args).items() >= expected.items()


AO_TRAIN_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments
    from torchao.float8.float8_linear import Float8Linear
    from hfl3 import L3GPTConfig, L3GPTForCausalLM
    from hfl3.fp8 import check_ao_backend

    output_dir, text_path = sys.argv[1], sys.argv[2]
    data = list(open(text_path, "rb").read()[:32 * 32])  # 4 x 32 tokens a step: torch's CPU _scaled_mm is slow
    rows = [data[i:i + 32] for i in range(0, len(data), 32)]
    config = L3GPTConfig.from_depth(2, vocab_size=256, aspect_ratio=64, head_dim=64, max_position_embeddings=128,
                                    window_pattern="L", l3_after_layers=[0], l3_n_emb=1024, l3_k_max=16, l3_d_up=128)
    torch.manual_seed(0)
    model = L3GPTForCausalLM(config)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, max_steps=4, learning_rate=6e-3,
                             logging_steps=1, save_strategy="no", report_to=[], bf16=False, disable_tqdm=True)
    ao = check_ao_backend(args, model)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}))
    trainer.train()
    trainer.save_model(output_dir + "/final")
    converted = [n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print("RESULT " + json.dumps({"ao": ao, "converted": converted, "losses": losses, "rows": rows[:8]}))
''')


@pytest.mark.slow
def test_accelerate_ao_yaml_trains_and_saves_plain_checkpoint(tmp_path, repo_root, assets):
    """`accelerate launch --config_file accelerate_configs/fp8_ao.yaml` + HF Trainer on CPU: accelerate accepts the
    file, torchao converts with accelerate's default filter (only the first and last nn.Linear kept: the first is
    L3GPT's smear gate, so layer 0's q/k/v_proj *are* converted — hfl3's own rules keep them), loss falls, and save_model writes a checkpoint a plain L3GPT loads."""
    script = tmp_path / "ao_train.py"
    script.write_text(AO_TRAIN_SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(repo_root / "accelerate_configs" / "fp8_ao.yaml"), str(script), str(tmp_path),
         str(assets / "text" / "tinyshakespeare.txt")],
        capture_output=True, text=True, cwd=repo_root, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["ao"] == {"backend": "AO", "recipe": "tensorwise", "enable_fsdp_float8_all_gather": False,
                            "pad_inner_dim": True}
    accelerate_default = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")] + EXPECTED_CONVERTED
    assert sorted(result["converted"]) == sorted(accelerate_default)
    losses = result["losses"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5, losses
    plain, info = L3GPTForCausalLM.from_pretrained(tmp_path / "final", output_loading_info=True)
    assert not any(info.values()) and not has_float8(plain)
    batch = torch.tensor(result["rows"])
    with torch.no_grad():
        loss = plain(input_ids=batch, labels=batch).loss.item()
    assert loss < losses[0] - 0.5  # the saved weights are the trained ones


def test_no_converted_layer_under_fp8_is_a_warning(caplog):
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(2, vocab_size=512, aspect_ratio=32, head_dim=32))
    with caplog.at_level("WARNING", logger="hfl3.fp8.linear"):
        convert_to_float8_training(model)
    assert "FP8 tensorwise converted no layer of this model, so it trains in high precision" in caplog.text
    assert "use a larger model or drop --fp8" in caplog.text
