"""accelerate_configs/*.yaml without a GPU: each file says what it is for and how to launch it, accelerate accepts
it and would start the intended processes with the intended environment, the DeepSpeed JSON's "auto" fields are all
filled from TrainingArguments, and FSDP2 is exercised for real on 2 gloo CPU processes through accelerate's own
`fsdp2_prepare_model`. accelerate 1.15 turns FSDP on only for GPU processes: launched on a CPU machine, fsdp2.yaml
would train plain DDP, and the recipe refuses it (the real launch here; every config: tests/test_launch.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from equivalence import gradient_tolerance, spawn_gloo_ranks

pytestmark = pytest.mark.distributed

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "accelerate_configs"

# (file, distributed_type, processes, use_cpu, flag that picks the launcher) for the configs of the README table
LAUNCH_CASES = [
    ("cpu.yaml", "NO", 1, True, None),
    ("single_gpu.yaml", "NO", 1, False, None),
    ("mps.yaml", "NO", 1, False, None),
    ("multi_gpu.yaml", "MULTI_GPU", 2, False, "multi_gpu"),
    ("multi_cpu_ddp.yaml", "MULTI_GPU", 2, False, "multi_gpu"),
    ("zero2.yaml", "DEEPSPEED", 2, False, "use_deepspeed"),
    ("zero3.yaml", "DEEPSPEED", 2, False, "use_deepspeed"),
    ("fsdp2.yaml", "FSDP", 2, False, "use_fsdp"),
]
LAUNCHER_FLAGS = ("multi_gpu", "use_deepspeed", "use_fsdp")


def validated_launch_args(name: str):
    """What `accelerate launch --config_file accelerate_configs/<name> recipes/pretrain.py` decides before it starts
    anything (accelerate.commands.launch: its parser and `_validate_launch_command`)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / name), "recipes/pretrain.py"])
    return _validate_launch_command(args)


def process_env(name: str) -> dict[str, str]:
    """The environment accelerate's launcher gives each process for a multi-process config (as `launch_command`)."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, mixed_precision_from_config = validated_launch_args(name)
    if not args.use_deepspeed:
        return prepare_multi_gpu_env(args)
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return prepare_deepspeed_cmd_env(args)[1]


@pytest.mark.parametrize("name", [case[0] for case in LAUNCH_CASES])
def test_config_starts_with_its_purpose_and_command(name):
    lines = (CONFIGS / name).read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert len(header) >= 2 and len(header[0]) > 10, f"{name}: no comment saying what the file is for"
    assert any(f"accelerate launch --config_file accelerate_configs/{name}" in line for line in header), \
        f"{name}: the header shows no command using this file"


@pytest.mark.parametrize("name, distributed_type, processes, use_cpu, launcher_flag", LAUNCH_CASES,
                         ids=[case[0] for case in LAUNCH_CASES])
def test_accelerate_accepts_config(name, distributed_type, processes, use_cpu, launcher_flag):
    args, defaults, _ = validated_launch_args(name)
    assert defaults.distributed_type == distributed_type
    assert args.num_processes == processes
    assert bool(args.use_cpu) == use_cpu
    for flag in LAUNCHER_FLAGS:  # which of accelerate's launchers runs (all False: one plain process)
        assert bool(getattr(args, flag, False)) == (flag == launcher_flag), f"{name}: {flag}"


@pytest.mark.parametrize("name, stage", [("zero2.yaml", 2), ("zero3.yaml", 3)])
def test_deepspeed_config_takes_every_auto_value_from_training_arguments(name, stage, monkeypatch, tmp_path):
    """The process environment builds accelerate's DeepSpeedPlugin (it refuses accelerate-side values that the JSON
    owns), and the Trainer's config processing leaves no "auto" in the JSON."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from hfl3 import L3GPTConfig, L3GPTForCausalLM

    # Built before the DeepSpeed environment is set: with it, TrainingArguments would register its DeepSpeed config
    # globally in transformers (zero.Init for every later from_pretrained in this process)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             max_grad_norm=0.5, report_to="none", use_cpu=True)
    monkeypatch.chdir(REPO_ROOT)  # the JSON path in the yaml is relative to the repository root
    env = process_env(name)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage
    assert plugin.zero3_init_flag == (stage == 3)

    config = HfTrainerDeepSpeedConfig(json.loads(Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text()))
    config.trainer_config_process(args)
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(1, vocab_size=128, aspect_ratio=64, head_dim=64,
                                                    max_position_embeddings=32, window_pattern="L"))
    config.trainer_config_finalize(args, model, num_training_steps=10)

    def leaves(node, prefix=""):
        for key, value in node.items():
            yield from leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]

    filled = dict(leaves(config.config))
    assert [key for key, value in filled.items() if value == "auto"] == []
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (3, 2)
    assert filled["train_batch_size"] == 3 * 2 * args.world_size
    assert filled["gradient_clipping"] == 0.5
    assert (filled["bf16.enabled"], filled["fp16.enabled"]) == (False, False)
    assert filled["zero_optimization.stage"] == stage
    if stage == 3:
        assert filled["zero_optimization.stage3_gather_16bit_weights_on_model_save"] is True  # save_model gathers


def _tiny_l3gpt():
    """Depth 3: at depth 2 the backout scalar's gradient is pure round-off (equivalence.gradient_tolerance)."""
    from hfl3 import L3GPTConfig, L3GPTForCausalLM

    torch.manual_seed(0)
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(
        3, vocab_size=256, aspect_ratio=32, head_dim=64, max_position_embeddings=32, window_pattern="L",
        l3_after_layers=[0], l3_n_emb=512, l3_k_max=8, l3_d_up=64,
    ))  # fmt: skip
    with torch.no_grad():  # zero-initialised output projections would leave most gradients exactly zero
        for param in model.parameters():
            if param.ndim == 2 and not param.any():
                param.normal_(0.0, 0.02)
    return model


ROWS_PER_RANK, SEQ_LEN = 4, 16


def _rows(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (ROWS_PER_RANK, SEQ_LEN), generator=torch.Generator().manual_seed(rank))


def _fsdp2_worker(rank: int, env: dict, result_path: str) -> None:
    """One rank: accelerate's FSDP2 preparation of an L3GPT from fsdp2.yaml's plugin, a forward/backward on this
    rank's rows, and the full state dict gathered as FULL_STATE_DICT saving does (MuonAdamW under FSDP2:
    test_muon_sharded_distributed.py)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    os.environ.update(env)
    plugin = FullyShardedDataParallelPlugin()
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                  is_main_process=rank == 0, device=torch.device("cpu"))
    model = fsdp2_prepare_model(accelerator, _tiny_l3gpt())
    units = sorted({type(module).__name__.removeprefix("FSDP") for module in model.modules()
                    if isinstance(module, FSDPModule)})  # fully_shard swaps in a class named FSDP<name>
    local_shapes = {name: list(param.to_local().shape) for name, param in model.named_parameters()}
    model(input_ids=_rows(rank), labels=_rows(rank)).loss.backward()
    gradients = {name: param.grad.full_tensor() for name, param in model.named_parameters()}
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"plugin": {"version": plugin.fsdp_version, "reshard": plugin.reshard_after_forward,
                               "state_dict_type": str(plugin.state_dict_type)},
                    "units": units, "local_shapes": local_shapes, "gradients": gradients,
                    "full_state": full_state}, result_path)


@pytest.mark.slow
def test_fsdp2_config_shards_l3gpt_on_two_cpu_processes(tmp_path):
    """fsdp2.yaml's plugin and accelerate's `fsdp2_prepare_model` on 2 gloo ranks, each with its own 4 rows: every
    decoder layer and L3 layer is an FSDP unit, each rank holds half of each weight, the averaged gradients equal
    the unsharded model's on all 8 rows (within `gradient_tolerance`: float32, the reduction length, the values'
    magnitude), and the gathered full state dict equals the weights."""
    env = {key: value for key, value in process_env("fsdp2.yaml").items() if key.startswith(("ACCELERATE_", "FSDP_"))}
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    result_path = tmp_path / "rank0.pt"
    spawn_gloo_ranks(_fsdp2_worker, 2, tmp_path / "store", env, str(result_path))
    result = torch.load(result_path, weights_only=False)

    assert result["plugin"] == {"version": 2, "reshard": True, "state_dict_type": "StateDictType.FULL_STATE_DICT"}
    assert {"L3GPTDecoderLayer", "LargeLookupLayer", "L3GPTForCausalLM"} <= set(result["units"]), result["units"]
    reference = _tiny_l3gpt()
    rows = torch.cat([_rows(0), _rows(1)])  # same length and no padding: the mean of the ranks' means is the mean
    reference(input_ids=rows, labels=rows).loss.backward()
    for name, param in reference.named_parameters():
        assert result["local_shapes"][name][0] == (param.shape[0] + 1) // 2, f"{name} is not sharded in two"
        tolerance = gradient_tolerance(param.grad, rows.numel(), reference.config.hidden_size)
        difference = (result["gradients"][name] - param.grad).abs().max().item()
        assert difference <= tolerance, f"{name}: gradient differs by {difference:.3g} > {tolerance:.3g}"
        torch.testing.assert_close(result["full_state"][name], param.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine fsdp2.yaml really shards")
def test_fsdp2_config_is_refused_on_a_cpu_machine(tmp_path):
    """`accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/pretrain.py ... --use_cpu` on a machine
    without CUDA would train plain DDP (accelerate 1.15 turns FSDP on only for GPU processes): the recipe stops before
    any data or model work with one line naming multi_cpu_ddp.yaml, exit status 2 (table of every config:
    tests/test_launch.py)."""
    output_dir = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp2.yaml"),
               "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", "--use_cpu",
               "--output_dir", str(output_dir), "--report_to", "none"]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert run.returncode != 0
    expected = ("pretrain.py: error: FSDP (accelerate_configs/fsdp2.yaml) was launched but accelerate set up plain DDP "
                "(distributed type MULTI_CPU): accelerate 1.15 shards with FSDP only on GPUs; on a CPU machine use "
                "accelerate_configs/multi_cpu_ddp.yaml with --use_cpu (DDP over gloo), or run fsdp2.yaml on a CUDA "
                "machine")
    lines = run.stderr.splitlines()
    assert expected in lines, run.stderr[-4000:]
    assert "exitcode  : 2" in run.stderr  # torchrun's report of the rank that stopped
    # before any work: no tokenizer trained, no model built, no recipe traceback, nothing written
    work = ("tokenizer", "L3 allocation", "parameters", 'recipes/pretrain.py", line')
    assert not any(word in run.stderr for word in work), run.stderr[-4000:]
    assert not output_dir.exists()
