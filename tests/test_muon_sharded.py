"""MuonAdamW's sharded step in one process: setups refused before training (with the reason and the way out) and
accepted ones, DeepSpeed ZeRO-3 parameters grouped by `ds_shape`, flat tensors nobody mapped refused, and a one-rank
FSDP2 group equal to plain tensors. Multi-process equality with DDP: tests/distributed/test_muon_sharded_distributed.py
and the ZeRO recipe runs in tests/distributed/test_recipes_distributed.py."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import TrainingArguments

from hfl3.optim import MuonAdamW, create_muon_optimizer, param_groups_by_kind

CONFIGS = Path(__file__).resolve().parents[1] / "accelerate_configs"
ZERO2 = {"zero_optimization": {"stage": 2}}


def _matrices(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24, bias=False), nn.Linear(24, 16, bias=False), nn.Linear(16, 5, bias=False),
                         nn.LayerNorm(5))


@pytest.fixture
def clean_accelerate_state(monkeypatch):
    from accelerate.state import AcceleratorState

    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    return AcceleratorState._shared_state


REFUSED = [
    # (id, how it is set up, what the error names)
    ("deepspeed-optimizer-block", {"deepspeed": {**ZERO2, "optimizer": {"type": "AdamW"}}}, "'optimizer' block"),
    ("zero-offload-env", {"env": {"ACCELERATE_USE_DEEPSPEED": "true",
                                  "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}}, "offload_optimizer to cpu"),
    ("zero3-offload-param", {"deepspeed": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}},
     "offload_param to nvme"),
    ("stage0-bf16", {"deepspeed": {"zero_optimization": {"stage": 0}, "bf16": {"enabled": "auto"}}, "bf16": True},
     "stage 0 with bf16"),
    ("zero-plus-plus", {"deepspeed": {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}}, "hpZ"),
    ("elastic", {"deepspeed": {"zero_optimization": {"stage": 2, "elastic_checkpoint": True}}}, "elastic"),
    ("fsdp1-env", {"env": {"ACCELERATE_USE_FSDP": "true"}}, "FSDP1.*fsdp2.yaml"),
    ("fsdp1-state", {"fsdp_plugin": SimpleNamespace(fsdp_version=1, cpu_offload=None)}, "FSDP1"),
    ("fsdp2-offload-env", {"env": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}},
     "FSDP2 with CPU offload"),
    ("fsdp-args", {"fsdp": ["full_shard", "offload"]}, "FSDP1"),
]
ACCEPTED = [
    ("zero2-json", {"deepspeed": str(CONFIGS / "deepspeed" / "zero2.json")}),
    ("zero3-env", {"env": {"ACCELERATE_USE_DEEPSPEED": "true",
                           "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(CONFIGS / "deepspeed" / "zero3.json")}}),
    ("fsdp2-env", {"env": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}}),
    ("fsdp2-state", {"fsdp_plugin": SimpleNamespace(fsdp_version=2, cpu_offload=SimpleNamespace())}),
    ("ddp", {}),
]


def _set_up(setting: dict, tmp_path, monkeypatch, shared_state) -> TrainingArguments:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", learning_rate=0.02)
    for name, value in setting.get("env", {}).items():
        monkeypatch.setenv(name, value)
    for name in ("deepspeed", "fsdp", "bf16"):
        if name in setting:
            monkeypatch.setattr(args, name, setting[name])
    if "fsdp_plugin" in setting:
        shared_state["fsdp_plugin"] = setting["fsdp_plugin"]
    return args


@pytest.mark.parametrize("setting, match", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_unsupported_setups_are_refused_with_the_way_out(setting, match, tmp_path, monkeypatch,
                                                         clean_accelerate_state):
    args = _set_up(setting, tmp_path, monkeypatch, clean_accelerate_state)
    with pytest.raises(RuntimeError, match=rf"MuonAdamW cannot run under this setup: .*{match}") as error:
        create_muon_optimizer(_matrices(), args)
    assert any(way in str(error.value) for way in ("Use ", "Remove", "Drop", "Set ")), error.value


@pytest.mark.parametrize("setting", [case[1] for case in ACCEPTED], ids=[case[0] for case in ACCEPTED])
def test_sharded_setups_are_accepted(setting, tmp_path, monkeypatch, clean_accelerate_state):
    args = _set_up(setting, tmp_path, monkeypatch, clean_accelerate_state)
    assert isinstance(create_muon_optimizer(_matrices(), args), MuonAdamW)


def test_a_flat_tensor_that_no_zero_optimizer_mapped_is_refused():
    model = _matrices()
    optimizer = MuonAdamW(param_groups_by_kind(model))
    matrices = optimizer.param_groups[0]
    flat = nn.Parameter(torch.cat([p.detach().flatten() for p in matrices["params"]]))
    flat.grad = torch.ones_like(flat)
    matrices["params"] = [flat]  # what a ZeRO optimizer does, without DeepSpeed's mapping on the matrices
    with pytest.raises(RuntimeError, match="no DeepSpeed ZeRO mapping.*cannot rebuild whole matrices"):
        optimizer.step()


def test_zero3_partitioned_parameters_are_grouped_by_ds_shape():
    """Under zero.Init each weight is an empty 1-D tensor with `ds_shape`: it still goes to Muon (DeepSpeed's own Muon
    put such weights on Adam, deepspeedai/DeepSpeed#8438). Handed to MuonAdamW themselves, not as ZeRO partitions, they are refused."""
    model = _matrices()
    expected = [(group["name"], len(group["params"])) for group in param_groups_by_kind(model)]
    for index, module in enumerate(model):
        for name, param in list(module.named_parameters()):
            partitioned = nn.Parameter(torch.empty(0))
            partitioned.ds_shape, partitioned.ds_id = param.shape, 10 * index + len(name)
            setattr(module, name, partitioned)
    groups = param_groups_by_kind(model)
    assert [(group["name"], len(group["params"])) for group in groups] == expected
    optimizer = MuonAdamW(groups)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    with pytest.raises(RuntimeError, match="ZeRO-3 parameters themselves"):
        optimizer.step()


def test_one_rank_fsdp2_group_equals_plain_tensors(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = [p for p in _matrices().parameters() if p.ndim == 2]
        shards = [nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain]
        settings = {"kind": "muon", "weight_decay": 0.1, "momentum_warmup_steps": 2}
        optimizers = [MuonAdamW([{"params": params, **settings}], num_training_steps=4) for params in (plain, shards)]
        generator = torch.Generator().manual_seed(3)
        for _ in range(3):
            for p, shard in zip(plain, shards):
                p.grad = torch.randn(p.shape, generator=generator)
                shard.grad = distribute_tensor(p.grad.clone(), mesh, [Shard(0)])
            for optimizer in optimizers:
                optimizer.step()
        for p, shard in zip(plain, shards):
            assert torch.equal(shard.full_tensor(), p.detach())
        assert optimizers[1].muon_state_bytes() == optimizers[0].muon_state_bytes() > 0
        replicated = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Replicate()]))
        with pytest.raises(RuntimeError, match=r"Shard\(0\) on one mesh dimension only"):
            MuonAdamW([{"params": [replicated], "kind": "muon"}])
    finally:
        dist.destroy_process_group()
