"""Both recipes and CORE on two machines, stood in for by two `accelerate launch`es on this host (loopback
rendezvous, one process each, `conftest.launch_machines`): each machine in its own working directory, so that a
relative `--output_dir` is on a disk of its own and an absolute one on a filesystem both share.

What one process computes for all (the trained tokenizer, the plan, the L3 allocation, the validation rows, the CORE
bundle, SFT's generated chats) reaches the other machine through the process group: the two-machine pretraining
equals the one-machine DDP run bit for bit, and uses a CORE bundle machine 1 does not have. A checkpoint is complete
where it is committed: machine 0's holds both ranks' stream and RNG state, and nothing is left on machine 1. A lost
machine stops the other in one line; `--resume_from_checkpoint latest` on both machines, machine 1 without any
checkpoint, continues exactly: the same rows, the same weights as an uninterrupted run.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from equivalence import FLOAT32_EPS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RANK_FILES = {"data_state_rank0.safetensors", "data_state_rank1.safetensors", "rng_state_0.pth", "rng_state_1.pth"}
PRETRAIN_STEPS, CHECKPOINT_STEP = 20, 10  # as in conftest.py
ANSWER_WAIT_S = 5  # hfl3.distributed.ANSWER_WAIT_S
COLLECTIVE_TIMEOUT_S = 300  # as in conftest.py


def assert_equal_weights(folder: Path, reference: Path) -> None:
    state, expected = load_file(folder / "model.safetensors"), load_file(reference / "model.safetensors")
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], value) for name, value in expected.items()), f"{folder} vs {reference}"


def assert_ranks(launch, name: str) -> None:
    records = launch.run(name)
    assert [(r["rank"], r["world_size"], r["torch_world_size"]) for r in records] == [(0, 2, 2), (1, 2, 2)], records
    assert all(record["error"] is None for record in records), [record["error"] for record in records]


def rank_files(checkpoint: Path) -> set[str]:
    return {path.name for path in checkpoint.iterdir() if path.name.startswith(("data_state", "rng_state"))}


def test_pretrain_on_two_machines_sharing_a_folder_equals_one_machine(machines, ddp, distributed_dir):
    """The tokenizer trained on machine 0 reaches machine 1 (it used to die taking the missing folder for a Hub id):
    the run equals the one-machine DDP run (same rows per rank, same weights, same eval loss). Its checkpoints hold
    both ranks' states and no staging folder is left; CORE ran from a bundle that only machine 0 has."""
    assert_ranks(machines, "pretrain_shared")
    metrics, reference = machines.metrics("pretrain_shared"), ddp.metrics("pretrain_adamw")
    folder = distributed_dir / "machines" / "shared" / "pretrain"
    assert_equal_weights(folder, distributed_dir / "ddp" / "pretrain_adamw")
    assert metrics["eval_loss"] == reference["eval_loss"]
    assert machines.rows("pretrain_shared") == ddp.rows("pretrain_adamw")
    for step in (CHECKPOINT_STEP, PRETRAIN_STEPS):
        assert rank_files(folder / f"checkpoint-{step}") == RANK_FILES
    assert not (folder / "_hfl3_staging").exists()
    history = json.loads((folder / f"checkpoint-{PRETRAIN_STEPS}" / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "core_metric" in entry] == [CHECKPOINT_STEP, PRETRAIN_STEPS]


def test_core_command_on_two_machines_reads_the_bundle_on_machine_0_only(machines):
    """`python -m hfl3.evaluate core` on both machines: machine 1 has no bundle and gets machine 0's; both ranks
    return the same results, those of the callback that evaluated the same weights at the end of training."""
    first, second = (record["metrics"] for record in machines.run("core"))
    assert all(record["error"] is None for record in machines.run("core"))
    assert first["results"] == second["results"] and first["settings"]["num_processes"] == 2
    assert first["core_metric"] == machines.metrics("pretrain_shared")["core_metric"]
    assert json.loads((machines.workdir / "core.json").read_text())["core_metric"] == first["core_metric"]


def test_a_lost_machine_stops_the_other_in_one_line(machines):
    """Machine 1's launcher and rank are killed after checkpoint-10: machine 0 stops within the collective timeout,
    with one line naming rank 1 on machine 1 and no traceback of its own; checkpoint-10 holds both ranks' states."""
    assert machines.lost["exit"] != 0
    assert machines.lost["stop_s"] < COLLECTIVE_TIMEOUT_S + ANSWER_WAIT_S, machines.lost
    log = (machines.workdir / "lost.machine0.log").read_text()
    lines = re.findall(r"^.*error: lost rank.*$", log, re.MULTILINE)
    assert len(lines) == 1 and "lost rank 1 (machine 1)" in lines[0], lines
    assert "--resume_from_checkpoint latest" in lines[0]
    assert "recipes/pretrain.py\", line" not in log, log[-3000:]  # no traceback through the recipe
    checkpoint = machines.workdir / "machine0" / "pretrain" / f"checkpoint-{CHECKPOINT_STEP}"
    assert rank_files(checkpoint) == RANK_FILES
    print(f"\n[distributed] machine 0 stopped {machines.lost['stop_s']:.1f} s after machine 1 was lost")


def test_resume_on_both_machines_from_machine_0s_disk_continues_exactly(machines_resumed, machines):
    """`--resume_from_checkpoint latest` on both machines: machine 1 has no checkpoint and reads machine 0's, with
    its own stream and RNG state in it. Each rank trains on exactly the rows of the uninterrupted run after the
    checkpoint, and the weights and the digest of all consumed rows equal the uninterrupted run's."""
    assert_ranks(machines_resumed, "pretrain_resumed")
    folder = machines.workdir / "machine0" / "pretrain"
    uninterrupted = machines.workdir / "shared" / "pretrain"
    assert_equal_weights(folder, uninterrupted)
    resumed, reference = machines_resumed.metrics("pretrain_resumed"), machines.metrics("pretrain_shared")
    assert resumed["eval_loss"] == reference["eval_loss"]
    # train_loss covers the whole run (steps 1-10 from the checkpoint's hfl3_run.json): the same 20 float32 step
    # losses added in another grouping, within (20 - 1)·eps relative (Higham §4.2)
    assert resumed["train_loss"] == pytest.approx(reference["train_loss"], rel=PRETRAIN_STEPS * FLOAT32_EPS)
    data = [json.loads((path / "metadata.json").read_text())["data"] for path in (folder, uninterrupted)]
    assert data[0]["train_tokens_sha256"] == data[1]["train_tokens_sha256"]
    resumed_at = PRETRAIN_STEPS - len(machines_resumed.rows("pretrain_resumed")[0])
    assert resumed_at >= CHECKPOINT_STEP
    for rank, (all_steps, after) in enumerate(zip(machines.rows("pretrain_shared"),
                                                  machines_resumed.rows("pretrain_resumed"))):
        assert after == all_steps[resumed_at:], f"rank {rank}"
    assert rank_files(folder / f"checkpoint-{PRETRAIN_STEPS}") == RANK_FILES
    assert list((machines.workdir / "machine1").iterdir()) == []  # no output, no staging on machine 1


def test_sft_on_two_machines_without_a_shared_filesystem(machines_resumed, machines):
    """SFT with stdlib chats written by machine 0: the adapter and its checkpoints (each with both ranks' RNG
    states) are on machine 0 only, machine 1's folder is gone. The best adapter (epoch 1) was loaded on both
    machines: the final evaluation over both ranks' shares equals epoch 1's."""
    assert_ranks(machines_resumed, "sft")
    metrics = machines_resumed.metrics("sft")
    on_machine_0 = machines.workdir / "machine0" / "sft"
    assert (on_machine_0 / "adapter_model.safetensors").is_file()
    checkpoints = sorted(on_machine_0.glob("checkpoint-*"))
    assert checkpoints and all({"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in c.iterdir()}
                               for c in checkpoints)
    assert not (machines.workdir / "machine1" / "sft").exists()
    history = json.loads((on_machine_0 / "trainer_state.json").read_text())["log_history"]
    epochs = [entry["eval_loss"] for entry in history if "eval_loss" in entry and entry["step"] > 0][:2]
    assert len(epochs) == 2 and epochs[0] != epochs[1], history  # else the best adapter would be the last one
    assert metrics["eval_loss"] == epochs[0], (metrics["eval_loss"], epochs)
