"""MuonAdamW's batched step: same-shape matrices orthogonalised as one stack, a kernel count that does
not grow with depth, equality with the per-matrix update, skipped parameters, exact state round trips, the compiled
stack update, and the fused AdamW path on CUDA."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.optim import MuonAdamW, orthogonalize, param_groups_by_kind

aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
EVERY_FEATURE = dict(weight_decay=0.2, momentum_warmup_steps=3)  # with NorMuon, cautious WD, Nesterov (defaults)


class OperationCounter(TorchDispatchMode):
    """Counts the aten operations dispatched, and the matrix multiplications among them."""

    def __init__(self):
        super().__init__()
        self.operations = 0
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        self.matmuls += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


def l3gpt_of_depth(depth: int) -> L3GPTForCausalLM:
    """hidden 64 at every depth up to 8 (aspect ratio 8, one head of 64): deeper means more same-shape layers. One
    value-embedding table at every depth: torch's CPU foreach AdamW reads each parameter's step with `.item()`, so
    its operations grow with the number of AdamW tensors, which is not what the tests here measure."""
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(
        depth, vocab_size=256, aspect_ratio=8, head_dim=64, max_position_embeddings=32, window_pattern="L",
        l3_after_layers=[0], l3_n_emb=512, l3_k_max=8, l3_d_up=32, value_embedding_layers=[0],
    )  # fmt: skip
    return L3GPTForCausalLM(config)


def random_gradients(params, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in params]


def test_matmuls_and_operations_per_step_do_not_grow_with_depth():
    counts = {}
    for depth in (2, 6):
        model = l3gpt_of_depth(depth)
        optimizer = MuonAdamW(param_groups_by_kind(model))
        params = list(model.parameters())
        for step in range(2):  # the first step also lays out the state
            for param, grad in zip(params, random_gradients(params, step)):
                param.grad = grad
            with OperationCounter() as counter:
                optimizer.step()
        matrices = optimizer.param_groups[0]["params"]
        counts[depth] = (counter.matmuls, counter.operations, len(matrices), {tuple(p.shape) for p in matrices})
    (matmuls_2, operations_2, matrices_2, shapes_2), (matmuls_6, operations_6, matrices_6, shapes_6) = counts.values()
    assert matrices_6 == matrices_2 + 4 * 6 and shapes_6 == shapes_2  # the guard: 24 more same-shape matrices
    assert matmuls_6 == matmuls_2 == 3 * 5 * len(shapes_2)  # per shape: 5 Polar Express steps × 3 matmuls
    assert operations_6 == operations_2


@pytest.mark.parametrize("shape", [(5, 24, 40), (5, 40, 24), (3, 32, 32)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_orthogonalizing_a_stack_equals_each_matrix_alone(shape, dtype, tolerance):
    torch.manual_seed(1)
    stack = torch.randn(shape) * torch.logspace(-2, 1, shape[0])[:, None, None]  # norms over three decades
    batched = orthogonalize(stack, dtype=dtype)
    one_by_one = torch.stack([orthogonalize(matrix, dtype=dtype) for matrix in stack])
    assert batched.dtype == dtype and batched.shape == shape
    torch.testing.assert_close(batched, one_by_one, rtol=0, atol=tolerance)


def _muon_group(params, **settings):
    return [{"params": params, "kind": "muon", "lr": 0.03, **EVERY_FEATURE, **settings}]


def test_a_stacked_group_equals_each_matrix_in_its_own_optimizer():
    torch.manual_seed(2)
    shapes = [(16, 48)] * 3 + [(48, 16)] * 2 + [(32, 32)]
    start = [torch.randn(shape) for shape in shapes]
    stacked = [nn.Parameter(tensor.clone()) for tensor in start]
    alone = [nn.Parameter(tensor.clone()) for tensor in start]
    optimizer = MuonAdamW(_muon_group(stacked), num_training_steps=6)
    singles = [MuonAdamW(_muon_group([param]), num_training_steps=6) for param in alone]
    for step in range(4):
        for a, b, grad in zip(stacked, alone, random_gradients(stacked, step)):
            a.grad, b.grad = grad, grad.clone()
        optimizer.step()
        for single in singles:
            single.step()
    for a, b, single in zip(stacked, alone, singles):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for key in ("momentum_buffer", "second_moment"):
            torch.testing.assert_close(optimizer.state[a][key], single.state[b][key], rtol=0, atol=1e-6)
    assert all(not torch.equal(a, s) for a, s in zip(stacked, start))


def test_parameters_without_a_gradient_are_skipped():
    torch.manual_seed(3)
    matrices = [nn.Parameter(torch.randn(16, 32)) for _ in range(3)]
    vectors = [nn.Parameter(torch.randn(8)) for _ in range(2)]
    reference = [nn.Parameter(p.detach().clone()) for p in matrices]
    never_updated = {id(matrices[2]): matrices[2].detach().clone(), id(vectors[1]): vectors[1].detach().clone()}
    groups = _muon_group(matrices) + [{"params": vectors, "kind": "adamw", "weight_decay": 0.1}]
    optimizer = MuonAdamW(groups, num_training_steps=10)
    reference_optimizer = MuonAdamW(_muon_group(reference[:2]), num_training_steps=10)
    torch_adamw = torch.optim.AdamW([nn.Parameter(vectors[0].detach().clone())], lr=1e-3, betas=(0.8, 0.95),
                                    eps=1e-10, weight_decay=0.1)  # fmt: skip
    for step in range(3):
        grads = random_gradients(matrices, step)
        for index, (param, grad) in enumerate(zip(matrices, grads)):
            param.grad = grad if index < 2 else None  # the third matrix never gets a gradient
            if index < 2:
                reference[index].grad = grad.clone()
        vectors[0].grad = torch.full((8,), 0.5 * (step + 1))
        vectors[1].grad = None
        torch_adamw.param_groups[0]["params"][0].grad = vectors[0].grad.clone()
        torch_adamw.param_groups[0]["weight_decay"] = 0.1 * (1 - step / 10)  # MuonAdamW's decay schedule
        optimizer.step()
        reference_optimizer.step()
        torch_adamw.step()
    for param, expected in zip(matrices[:2], reference[:2]):
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-6)
    assert torch.equal(vectors[0], torch_adamw.param_groups[0]["params"][0])
    for param in (matrices[2], vectors[1]):
        assert torch.equal(param, never_updated[id(param)])  # weight decay did not touch them either
        assert optimizer.state[param] and all(not value.any() for value in optimizer.state[param].values())
    assert not torch.equal(optimizer.state[matrices[0]]["momentum_buffer"], torch.zeros(16, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_bit_identically(dtype):
    def build(seed):
        torch.manual_seed(seed)
        params = [nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in [(16, 32)] * 3 + [(32, 16), (12,)]]
        groups = _muon_group(params[:4]) + [{"params": params[4:], "kind": "adamw"}]
        return params, MuonAdamW(groups, num_training_steps=8)

    def train(params, optimizer, steps):
        for step in steps:
            for param, grad in zip(params, random_gradients(params, step)):
                param.grad = grad.to(dtype)
            optimizer.step()

    params, optimizer = build(0)
    train(params, optimizer, range(3))
    buffer = io.BytesIO()
    torch.save({"weights": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    train(params, optimizer, range(3, 6))

    resumed_params, resumed = build(1)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    with torch.no_grad():
        for param, weight in zip(resumed_params, saved["weights"]):
            param.copy_(weight)
    resumed.load_state_dict(saved["optimizer"])
    assert resumed.state[resumed_params[0]]["second_moment"].dtype == torch.float32
    train(resumed_params, resumed, range(3, 6))
    for a, b in zip(params, resumed_params):
        assert torch.equal(a, b)
        for key, value in optimizer.state[a].items():
            assert torch.equal(value, resumed.state[b][key]), key
    assert [g["step"] for g in resumed.param_groups] == [6, 6]


def test_deepcopy_gives_an_optimizer_that_steps_like_the_original():
    torch.manual_seed(4)
    params = [nn.Parameter(torch.randn(16, 32)) for _ in range(2)]
    optimizer = MuonAdamW(_muon_group(params), num_training_steps=8, compile_update=False)
    for param, grad in zip(params, random_gradients(params, 0)):
        param.grad = grad
    optimizer.step()
    twin = copy.deepcopy(optimizer)
    assert (twin.num_training_steps, twin.compile_update) == (8, False)
    twin_params = twin.param_groups[0]["params"]
    for a, b, grad in zip(params, twin_params, random_gradients(params, 1)):
        a.grad, b.grad = grad, grad.clone()
    optimizer.step()
    twin.step()
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_compiled_stack_update_equals_eager_without_recompiles_and_stops_at_the_recompile_limit(caplog):
    from hfl3.optim import muon

    torch.manual_seed(5)
    start = [torch.randn(24, 40) for _ in range(3)] + [torch.randn(40, 24) for _ in range(2)]
    eager = [nn.Parameter(t.clone()) for t in start]
    compiled = [nn.Parameter(t.clone()) for t in start]
    optimizers = [
        MuonAdamW(_muon_group(eager), num_training_steps=4, compile_update=False),
        MuonAdamW(_muon_group(compiled), num_training_steps=4, compile_update=True),
    ]
    # room for one more graph only: the (24, 40) stack is compiled, the (40, 24) one must run eagerly, not fail
    with torch._dynamo.config.patch(recompile_limit=len(muon._COMPILED_SIGNATURES) + 1), caplog.at_level("WARNING"):
        for step in range(4):  # the LR, momentum (warm-up) and weight decay (decay) change at every step
            for optimizer in optimizers:
                optimizer.param_groups[0]["lr"] = 0.03 * (1 - step / 8)
            for a, b, grad in zip(eager, compiled, random_gradients(eager, step)):
                a.grad, b.grad = grad, grad.clone()
            optimizers[0].step()
            with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
                optimizers[1].step()
    assert "the 40×24 stack runs eagerly" in caplog.text
    assert {signature[0] for signature in muon._COMPILED_SIGNATURES} >= {(24, 40)}
    for a, b, first in zip(eager[:3], compiled[:3], start):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert not torch.equal(a, first)
    for a, b in zip(eager[3:], compiled[3:]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_adamw_groups_are_fused_and_equal_torch_fused_adamw_and_compiled_muon_equals_eager():
    torch.manual_seed(6)
    device = torch.device("cuda")
    vectors = [nn.Parameter(torch.randn(shape, device=device)) for shape in [(4096, 64), (64,)]]
    reference = [nn.Parameter(p.detach().clone()) for p in vectors]
    start = [torch.randn(64, 128, device=device) for _ in range(4)]
    matrices = {mode: [nn.Parameter(t.clone()) for t in start] for mode in ("eager", "compiled")}
    # fp32 Polar Express and no weight decay: round-off only (a cautious-decay mask flip would dominate a comparison;
    # the compiled decay itself is checked on the CPU)
    settings = dict(orthogonalize_dtype="float32", weight_decay=0.0)
    adamw = {"params": vectors, "kind": "adamw", "weight_decay": 0.1}
    optimizer = MuonAdamW(_muon_group(matrices["compiled"], **settings) + [adamw], num_training_steps=8)
    eager = MuonAdamW(_muon_group(matrices["eager"], **settings), num_training_steps=8, compile_update=False)
    torch_fused = torch.optim.AdamW(reference, lr=1e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1, fused=True)
    for step in range(3):
        for a, b in zip(vectors, reference):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        for a, b in zip(*matrices.values()):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        torch_fused.param_groups[0]["weight_decay"] = 0.1 * (1 - step / 8)
        optimizer.step()
        eager.step()
        torch_fused.step()
    assert optimizer._layouts[1].parts[0].fused and optimizer._layouts[0].parts[0].compiled
    assert optimizer.state[vectors[0]]["step"].device.type == "cuda"
    for a, b in zip(vectors, reference):
        assert torch.equal(a, b)
    for a, b, first in zip(*matrices.values(), start):
        assert (b - a).norm() < 1e-4 * (a - first).norm()


def test_step_benchmark_runs_tiny_on_cpu(repo_root, tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU arms")
    monkeypatch.syspath_prepend(str(repo_root / "benchmarks"))
    import muon_step

    args = muon_step.StepArguments(depth=2, aspect_ratio=32, vocab_size=256, steps=1, warmup_steps=1, compiled=False,
                                   json=str(tmp_path / "step.json"))  # fmt: skip
    results = muon_step.main(args)
    arms = results["arms"]
    assert list(arms) == ["adamw", "muon_eager", "per_parameter"] and (tmp_path / "step.json").exists()
    # the baseline is the per-matrix loop (15 matmuls per matrix), MuonAdamW 15 per shape; the same update on CPU
    assert arms["per_parameter"]["matmuls"] == 15 * results["muon_matrices"] > arms["muon_eager"]["matmuls"] > 0
    assert results["relative_update_difference_vs_per_parameter"]["muon_eager"] < 1e-6
    assert arms["adamw"]["x_adamw"] == 1.0 and arms["adamw"]["matmuls"] == 0
