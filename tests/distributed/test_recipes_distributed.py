"""Both recipes under accelerate's multi-process configs on a CPU machine: 2-process DDP (multi_cpu_ddp.yaml) and
DeepSpeed ZeRO-2 / ZeRO-3 (zero2.yaml, zero3.yaml), each launched with `accelerate launch --config_file ...`. The
ZeRO-2 cases are extended (`make test-extended`): ZeRO-3 shards what ZeRO-2 shards and the weights too.

What is compared is what is deterministic up to float round-off (as in tests/test_muon_ddp.py), not the weights after
20 Adam steps (Adam's first steps are ~sign(g): a gradient that nearly cancels over the batch turns the round-off of
another reduction order into ±lr, which is how these tests once failed on another CPU):
- DDP against one process on the same global batch runs the same code path: each of the 2 processes and each of the
  one process's 2 accumulated micro-batches computes the same 4-row batch with 1 thread, and DDP's all-reduce of 2
  ranks (each gradient halved, which is exact, then a + b) adds what gradient accumulation adds. So the first step's
  gradients, the weights after 20 steps (AdamW and Muon) and the eval loss are equal bit for bit.
- DeepSpeed ZeRO-2 / ZeRO-3 reduce the gradients in their own bucket order: the first step's gradients (the same
  weights and rows in every setup) are compared with one process's within `gradient_tolerance` (float32 eps, the
  reduction length, the values' magnitude; its derivation is in equivalence.py). The sharded optimizer steps
  fed identical gradients are compared in test_muon_sharded_distributed.py.
- SFT LoRA, 2 processes x 2 chats against 1 process x 4 chats (another batch composition): the first step's adapter
  gradients within `gradient_tolerance`.
Guards: the first step's gradients of half the global batch (what a rank steps with without the all-reduce) lie far
outside the tolerance (`test_gradient_tolerance_can_tell`); the AdamW run of a ZeRO launch (what a silent fallback
from Muon would train) ends far from its Muon run.

Every run is also checked for the world size that its `TrainingArguments` set up on each rank, the tokens it trained
on, a falling loss and a saved model or adapter that loads. Resuming from the step-10 checkpoint continues bit for bit
(the same code path): weights, eval loss and train loss, and the rows trained on (AdamW: row hashes of every rank);
under ZeRO here, under DDP in test_machines.py (two machines, resumed after one was lost).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from equivalence import FLOAT32_EPS, gradient_tolerance

pytestmark = pytest.mark.distributed

MIN_BPB_DROP = 0.25  # 20 steps lower the validation bpb by 0.6 (Muon) to 0.9 (AdamW); round-off is ~1e-4
WORLD_SIZE = 2
PRETRAIN_STEPS, CHECKPOINT_STEP = 20, 10  # as in conftest.py
PRETRAIN_POSITIONS = 8 * 64  # the global batch: 8 packed rows of max_length 64 (pretrain_tiny.yaml)
SFT_POSITIONS = 4 * 128  # at most: 4 chats of max_length 128 (sft_tiny.yaml)


def extended_zero2(*run: str):
    """A ZeRO-2 case: extended (make test-extended), as its launch (~70 s on 2 cores) checks what ZeRO-3's launch
    checks with the optimizer state sharded but not the weights; the AdamW resume's row-for-row check under ZeRO runs
    there, DDP's in test_machines.py."""
    return pytest.param("zero2", *run, marks=pytest.mark.extended)


def hidden_size(folder: Path) -> int:
    """The hidden size of the model a run saved in `folder` (or, for an adapter, of its base)."""
    config = folder / "config.json"
    if not config.exists():
        config = Path(json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"])
        config = (config if config.is_absolute() else folder / config) / "config.json"
    return json.loads(config.read_text())["hidden_size"]


def first_step_gradients(workdir: Path, name: str) -> dict[str, torch.Tensor]:
    """The gradients of run `name`'s first optimizer step (recipe_runner.py `record_gradients`)."""
    return torch.load(workdir / f"{name}.gradients.pt", weights_only=True)


def assert_gradients_close(gradients: dict, reference: dict, positions: int, hidden: int, what: str) -> None:
    """Every tensor within `gradient_tolerance` of the reference's."""
    assert gradients.keys() == reference.keys(), f"{what}: {sorted(gradients.keys() ^ reference.keys())}"
    for name, expected in reference.items():
        tolerance = gradient_tolerance(expected, positions, hidden)
        difference = (gradients[name] - expected).abs().max().item()
        assert difference <= tolerance, f"{what} {name}: differs by {difference:.3g} > {tolerance:.3g}"


def assert_equal_weights(folder: Path, reference_folder: Path, file: str = "model.safetensors") -> None:
    state, reference = load_file(folder / file), load_file(reference_folder / file)
    assert state.keys() == reference.keys(), f"tensor names differ: {sorted(state.keys() ^ reference.keys())}"
    for name, value in reference.items():
        assert torch.equal(state[name], value), f"{folder.name} vs {reference_folder}: {name} differs"


def relative_differences(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """||state - reference|| / ||reference|| per tensor (Frobenius norm, float64); both must have the same keys."""
    assert state.keys() == reference.keys(), f"tensor names differ: {sorted(state.keys() ^ reference.keys())}"
    return {
        name: ((state[name].double() - value.double()).norm() / value.double().norm().clamp(min=1e-12)).item()
        for name, value in reference.items()
    }


def assert_world_size(launch, name: str) -> None:
    records = launch.run(name)
    assert [record["rank"] for record in records] == list(range(WORLD_SIZE)), f"{name}: ranks {records}"
    for record in records:
        assert (record["world_size"], record["torch_world_size"]) == (WORLD_SIZE, WORLD_SIZE), \
            f"{launch.config} {name} rank {record['rank']}: TrainingArguments world size {record['world_size']}, " \
            f"torch.distributed {record['torch_world_size']}"


def assert_loads(folder) -> None:
    """`AutoModelForCausalLM.from_pretrained` finds every weight of the saved L3GPT with its shape."""
    from transformers import AutoModelForCausalLM

    import hfl3  # noqa: F401  (registers L3GPT)

    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info


def assert_trained(launch, run: str, reference: dict) -> dict:
    """Every rank set up the world size, the run trained on the reference's number of tokens and lowered the bpb."""
    assert_world_size(launch, run)
    metrics = launch.metrics(run)
    assert metrics["eval_before_bpb"] - metrics["eval_bpb"] >= MIN_BPB_DROP, metrics
    assert metrics["num_input_tokens_seen"] == reference["num_input_tokens_seen"], "global batch differs"
    return metrics


@pytest.mark.slow
@pytest.mark.parametrize("run", ["pretrain_adamw", "pretrain_muon"])
def test_ddp_pretrain_equals_single_process_bit_for_bit(ddp, reference, distributed_dir, run):
    metrics = assert_trained(ddp, run, reference.metrics(run))
    assert metrics["eval_loss"] == reference.metrics(run)["eval_loss"]
    folder = distributed_dir / "ddp" / run
    assert_loads(folder)
    assert_equal_weights(folder, distributed_dir / "single" / run)
    if run == "pretrain_adamw":
        gradients = first_step_gradients(distributed_dir / "ddp", run)
        expected = first_step_gradients(distributed_dir / "single", run)
        assert gradients.keys() == expected.keys()
        assert all(torch.equal(gradients[name], value) for name, value in expected.items())


@pytest.mark.slow
@pytest.mark.parametrize("config, run", [extended_zero2("pretrain_adamw"), ("zero3", "pretrain_adamw"),
                                         extended_zero2("pretrain_muon"), ("zero3", "pretrain_muon")])
def test_zero_pretrain_first_step_equals_single_process(request, reference, distributed_dir, config, run):
    """The same weights and rows at step 1 in every setup (and in the AdamW and Muon runs): DeepSpeed's averaged
    gradients are one process's up to the reduction order."""
    launch = request.getfixturevalue(config)
    assert_trained(launch, run, reference.metrics(run))
    folder = distributed_dir / config / run
    assert_loads(folder)
    assert_gradients_close(first_step_gradients(distributed_dir / config, run),
                           first_step_gradients(distributed_dir / "single", "pretrain_adamw"),
                           PRETRAIN_POSITIONS, hidden_size(folder), f"{config} {run}")


@pytest.mark.slow
def test_gradient_tolerance_can_tell(reference, distributed_dir):
    """The first step's gradients of half the global batch (4 rows, what a rank without the all-reduce steps with)
    lie far outside the tolerance, in every weight matrix that has a gradient at step 1. The others are exactly zero
    in every setup (the matrices that only reach the loss through a zero-initialised output projection: q/k/v, the
    MLP's up_proj, the L3 key table and up_proj, the value embeddings and gates), which `assert_gradients_close`
    checks with a tolerance of 0; the unit tests (tests/test_muon_ddp.py, test_muon_sharded_distributed.py) start
    from non-zero weights everywhere."""
    reference.metrics("pretrain_half_batch")
    single = distributed_dir / "single"
    half, full = first_step_gradients(single, "pretrain_half_batch"), first_step_gradients(single, "pretrain_adamw")
    hidden = hidden_size(single / "pretrain_adamw")
    checked = set()
    for name, expected in full.items():
        if expected.ndim == 2 and expected.any():
            excess = (half[name] - expected).abs().max().item() / gradient_tolerance(expected, PRETRAIN_POSITIONS,
                                                                                    hidden)
            assert excess > 100, f"{name}: half the batch is only {excess:.3g}× the tolerance away"
            checked.add(name.rsplit(".", 2)[-2])
    assert {"embed_tokens", "o_proj", "down_proj", "mix_proj", "lm_head"} <= checked, checked


@pytest.mark.slow
@pytest.mark.parametrize("config", [extended_zero2(), "zero3"])
def test_sharded_muon_is_not_a_silent_fallback(request, distributed_dir, config):
    """Muon under ZeRO trains with Muon: the AdamW run of the same launch (what a silent fallback would train) ends
    far from it (the sharded step itself equals DDP's: test_muon_sharded_distributed.py)."""
    launch = request.getfixturevalue(config)
    launch.metrics("pretrain_muon"), launch.metrics("pretrain_adamw")
    folder = distributed_dir / config
    fallback = relative_differences(load_file(folder / "pretrain_adamw" / "model.safetensors"),
                                    load_file(folder / "pretrain_muon" / "model.safetensors"))
    assert max(fallback.values()) > 0.5, fallback


@pytest.mark.slow
@pytest.mark.parametrize("config, run", [extended_zero2("pretrain_adamw"), extended_zero2("pretrain_muon"),
                                         ("zero3", "pretrain_muon")])
def test_resume_from_checkpoint_continues_identically(request, distributed_dir, config, run):
    """DDP's resume: tests/distributed/test_machines.py (two machines, after one was lost)."""
    launch = request.getfixturevalue(config)
    assert_world_size(launch, f"{run}_resumed")
    uninterrupted, resumed = launch.metrics(run), launch.metrics(f"{run}_resumed")
    if run == "pretrain_adamw":
        # every rank trains on exactly the rows the uninterrupted run trained on after step 10, read from the
        # stream's saved state, and the chained digest of the consumed rows agrees
        for rank, (all_steps, after_resume) in enumerate(zip(launch.rows(run), launch.rows(f"{run}_resumed"))):
            assert len(all_steps) == PRETRAIN_STEPS and all_steps[:CHECKPOINT_STEP] != all_steps[CHECKPOINT_STEP:]
            assert after_resume == all_steps[CHECKPOINT_STEP:], f"rank {rank}"
        digests = [json.loads((distributed_dir / config / name / "metadata.json").read_text())["data"]
                   for name in (run, f"{run}_resumed")]
        assert digests[0]["train_tokens_sha256"] == digests[1]["train_tokens_sha256"]
    # The checkpoint holds the exact weights, optimizer state and stream position: the same code path from there
    assert resumed["eval_loss"] == uninterrupted["eval_loss"]
    assert_equal_weights(distributed_dir / config / f"{run}_resumed", distributed_dir / config / run)
    # The resumed session trained steps 11-20 with the same per-step losses; its train_loss covers the whole run
    # (the loss of steps 1-10 comes from the checkpoint's hfl3_run.json), as the uninterrupted run's does, but adds
    # the 20 positive float32 step losses in another grouping: within (20 - 1)·eps relative (Higham §4.2)
    assert resumed["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=PRETRAIN_STEPS * FLOAT32_EPS)


@pytest.mark.slow
def test_ddp_ranks_train_on_disjoint_rows(ddp):
    """Each rank reads its own stream (no rank reads the data of another and no batch is dispatched from rank 0):
    the rows of the two ranks never coincide, and each rank trained on a full batch at every step."""
    ranks = ddp.rows("pretrain_adamw")
    assert len(ranks) == WORLD_SIZE and all(len(steps) == PRETRAIN_STEPS for steps in ranks)
    per_rank = [[row for step in steps for row in step] for steps in ranks]
    assert all(len(rows) == PRETRAIN_STEPS * 4 for rows in per_rank)
    assert not set(per_rank[0]) & set(per_rank[1])


@pytest.mark.slow
def test_zero3_saved_model_loads_in_a_fresh_process(zero3, distributed_dir):
    """ZeRO-3 holds each weight in pieces across the ranks; `save_model` on every rank gathers them. A new process
    (no DeepSpeed state) loads the folder: every weight whole (the single-process run's shapes), the saved values,
    and no rank's piece missing (the rows rank 1 held are not left at zero)."""
    zero3.metrics("pretrain_adamw")
    code = (
        "import json, sys, torch, hfl3\n"
        "from safetensors.torch import load_file\n"
        "from transformers import AutoModelForCausalLM\n"
        "model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)\n"
        "saved = load_file(sys.argv[1] + '/model.safetensors')\n"
        "state = model.state_dict()\n"
        "equal = {k: bool(torch.equal(state[k], v)) for k, v in saved.items()}\n"
        "shapes = {k: list(v.shape) for k, v in state.items()}\n"
        "second_halves = {k: bool(v.flatten()[v.numel() // 2:].any()) for k, v in state.items()}\n"
        "print(json.dumps({'info': {k: sorted(map(str, v)) for k, v in info.items()}, 'equal': equal, "
        "'shapes': shapes, 'second_halves': second_halves}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(distributed_dir / "zero3" / "pretrain_adamw")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not any(report["info"].values()), report["info"]
    assert all(report["equal"].values()), report["equal"]
    single = load_file(distributed_dir / "single" / "pretrain_adamw" / "model.safetensors")
    assert {name: list(value.shape) for name, value in single.items()} == \
        {name: report["shapes"][name] for name in single}
    assert all(report["second_halves"][name] for name in single), report["second_halves"]


@pytest.mark.slow
def test_pretrain_stops_when_accelerate_sets_up_world_size_1(ddp_without_use_cpu):
    """Without --use_cpu and without CUDA, accelerate 1.15 gives each of the 2 launched processes world size 1: they
    would train alone and write the same folder. The recipe compares torchrun's WORLD_SIZE and stops, naming the fix."""
    records = ddp_without_use_cpu.run("pretrain_without_use_cpu")
    assert len(records) == WORLD_SIZE
    for record in records:
        assert record["world_size"] == 1, record
        expected = "LaunchError: 2 processes were launched but accelerate set up world size 1"
        assert record["error"].startswith(expected), record["error"]
        assert "--use_cpu" in record["error"] and "multi_cpu_ddp.yaml" in record["error"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", extended_zero2(), "zero3"])
def test_sft_lora_first_step_equals_single_process(request, reference, sft_base, distributed_dir, config):
    """The first step's adapter gradients (2 processes x 2 chats against 1 x 4, the same chats) within the
    tolerance; the run lowers the eval loss and its adapter loads with the saved values."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    launch = request.getfixturevalue(config)
    assert_world_size(launch, "sft_lora")
    metrics = launch.metrics("sft_lora")
    reference.metrics("sft_lora")
    assert metrics["eval_loss"] < metrics["eval_before_loss"], metrics
    assert_gradients_close(first_step_gradients(distributed_dir / config, "sft_lora"),
                           first_step_gradients(distributed_dir / "single", "sft_lora"),
                           SFT_POSITIONS, hidden_size(sft_base), f"{config} sft_lora")
    folder = distributed_dir / config / "sft_lora"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_base), folder)
    saved = load_file(folder / "adapter_model.safetensors")
    lora_b = [name for name in saved if "lora_B" in name]
    assert lora_b and all(saved[name].abs().max() > 0 for name in lora_b), "LoRA B still at its zero init"
    loaded = get_peft_model_state_dict(model)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[name], saved[name]) for name in saved)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", extended_zero2(), "zero3"])
def test_full_sft_with_muon_first_step_equals_single_process(request, reference, sft_base, distributed_dir, config):
    """Every weight trained with MuonAdamW (`--use_peft false --optim muon`): the first step's gradients of every
    parameter (2 processes x 2 chats against 1 x 4) within the tolerance; the run lowers the eval loss and writes a
    whole model folder that loads."""
    launch = request.getfixturevalue(config)
    assert_world_size(launch, "sft_full_muon")
    metrics = launch.metrics("sft_full_muon")
    reference.metrics("sft_full_muon")
    assert metrics["eval_loss"] < metrics["eval_before_loss"], metrics
    assert_gradients_close(first_step_gradients(distributed_dir / config, "sft_full_muon"),
                           first_step_gradients(distributed_dir / "single", "sft_full_muon"),
                           SFT_POSITIONS, hidden_size(sft_base), f"{config} sft_full_muon")
    assert not (distributed_dir / config / "sft_full_muon" / "adapter_config.json").exists()
    assert_loads(distributed_dir / config / "sft_full_muon")


@pytest.mark.gpu
@pytest.mark.slow
def test_fsdp2_pretrain_on_gpus(fsdp2_gpu, distributed_dir):
    """fsdp2.yaml on every CUDA GPU: the recipe trains under FSDP2 with AdamW and with Muon (sharded step), and the
    gathered (FULL_STATE_DICT) models load."""
    world_size = torch.cuda.device_count()
    for run in ("pretrain_adamw", "pretrain_muon"):
        for record in fsdp2_gpu.run(run):
            assert (record["world_size"], record["torch_world_size"]) == (world_size, world_size)
        metrics = fsdp2_gpu.metrics(run)
        assert metrics["eval_before_bpb"] - metrics["eval_bpb"] >= MIN_BPB_DROP, metrics
        assert_loads(distributed_dir / "fsdp2" / run)
