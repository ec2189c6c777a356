"""Launches shared by the distributed suite: each `accelerate launch` runs several recipe invocations
(`recipe_runner.py`) once per session, and the tests read what every rank recorded.

The global batch is the same everywhere: 8 packed rows (pretrain) and 4 chats (SFT) per optimizer step, as
2 processes x 4 (x 2) or 1 process x 4 x 2 accumulation steps (x 4 chats). Pretraining streams its data: DataLoader
worker w of process r reads stream r * W + w of world_size * W (W = max(1, workers)), so 2 processes with 0 or 1
worker each and 1 process with 2 workers read the same 2 streams, and the 1-process run's 2 accumulated batches (one
per worker, in turn) are the 2 processes' batches of the same step. For SFT, the Trainer's sampler draws the same
permutation with the same seed and accelerate deals its per-process batches out in turn.

DeepSpeed compiles its shm_comm op on the first start (30-80 s on an idle CPU); `TORCH_EXTENSIONS_DIR` defaults to
build/torch_extensions so that later sessions and CI runs reuse it.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("recipe_runner.py")
CONFIGS = REPO_ROOT / "accelerate_configs"
LAUNCH_TIMEOUT_S = 900
# --ddp_timeout of every launch: a rank stuck in a collective fails the launch instead of waiting 30 min. Not shorter:
# a rank waits in a collective while another works alone (rank 0 trains the tokenizer, then the others load it), which
# takes seconds on a quiet box and many times that on a busy one; a lost machine is noticed when its connection
# drops (~11 s here), not at this limit
COLLECTIVE_TIMEOUT_S = 300
PRETRAIN_STEPS = 20
PRETRAIN_DEPTH = 3
CHECKPOINT_STEP = 10
SFT_CHATS = 32
CORE_BUNDLE = REPO_ROOT / "tests" / "fixtures" / "core_bundle"

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / "build" / "torch_extensions"))


@dataclass
class Launch:
    """What one launch left: per run name, one record per rank (see recipe_runner.py), and the combined log."""

    config: str
    records: dict[str, list[dict]]
    log: str
    seconds: float
    workdir: Path
    lost: dict | None = None  # launch_machines(lose_machine_1_after=...): machine 0's exit code and time to stop

    def run(self, name: str) -> list[dict]:
        """The records of run `name` in rank order; fails with the log tail when no rank recorded it."""
        records = sorted(self.records.get(name, []), key=lambda record: record["rank"])
        if not records:
            pytest.fail(f"{self.config}: run {name!r} left no record; log tail:\n{self.log[-4000:]}")
        return records

    def rows(self, name: str) -> list[list[list[str]]]:
        """Per rank, per optimizer step: the hashes of the rows run `name` trained on (`record_rows`)."""
        return [[json.loads(line) for line in (self.workdir / f"{name}.rank{record['rank']}.rows.jsonl").open()]
                for record in self.run(name)]

    def metrics(self, name: str) -> dict:
        """Rank 0's metrics of run `name`, after checking that no rank failed."""
        for record in self.run(name):
            assert record["error"] is None, f"{self.config}: {name} failed on rank {record['rank']}: {record['error']}"
        return self.run(name)[0]["metrics"]


def free_port() -> int:
    """A TCP port free on the loopback now, for a launch's rendezvous (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(config: str | None, runs: list[dict], workdir: Path, env: dict | None = None,
           launch_args: tuple[str, ...] = ()) -> Launch:
    """Run `runs` in one `accelerate launch --config_file accelerate_configs/<config> *launch_args` (in one plain
    Python process when `config` is None) from the repository root; fail with the log tail when the launch fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan = workdir / "plan.json"
    plan.write_text(json.dumps({"results_dir": str(workdir), "runs": runs}, indent=1))
    command = [sys.executable, str(RUNNER), str(plan)]
    if config is not None:  # a free rendezvous port: accelerate's default, 29500, may be another launch's on this host
        command[1:1] = ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                        "--main_process_port", str(free_port()), *launch_args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           **(env or {})}
    start = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                               timeout=LAUNCH_TIMEOUT_S)
    seconds = time.perf_counter() - start
    log = completed.stdout + completed.stderr
    (workdir / "launch.log").write_text(log)
    records: dict[str, list[dict]] = {}
    for path in sorted(workdir.glob("*.rank*.json")):
        record = json.loads(path.read_text())
        records.setdefault(record["name"], []).append(record)
    name = config or "single process"
    if completed.returncode != 0:
        errors = {run: [record["error"] for record in found] for run, found in records.items()}
        pytest.fail(f"{name}: launch failed (exit {completed.returncode}, {seconds:.0f} s); errors per run and rank: "
                    f"{errors}\nlog tail:\n{log[-6000:]}")
    print(f"\n[distributed] {name}: {len(runs)} runs in {seconds:.0f} s")
    return Launch(name, records, log, seconds, workdir)


def pretrain_run(name: str, output_dir: Path, per_device_batch: int, *extra: str, continue_on_error=False,
                 record_rows=False, record_gradients=False) -> dict:
    """recipes/pretrain.py on recipes/configs/pretrain_tiny.yaml at depth 3 (at its depth 2 the backout scalar
    subtracts a multiple of the last layer's own output, which the final RMSNorm cancels: its gradient is pure
    round-off): 20 steps, evaluation at steps 0, 10 and 20; `record_rows`: every rank writes the hashes of the rows
    it trains on, `record_gradients`: the first step's gradients are written (recipe_runner.py)."""
    args = ["--config", str(REPO_ROOT / "recipes/configs/pretrain_tiny.yaml"), "--depth", str(PRETRAIN_DEPTH),
            "--output_dir", str(output_dir), "--per_device_train_batch_size", str(per_device_batch),
            "--max_steps", str(PRETRAIN_STEPS), "--eval_steps", "10", "--report_to", "none", "--disable_tqdm", "true",
            "--ddp_timeout", str(COLLECTIVE_TIMEOUT_S), *extra]
    return {"name": name, "recipe": "pretrain", "args": args, "continue_on_error": continue_on_error,
            "record_rows": record_rows, "record_gradients": record_gradients}


def sft_run(name: str, base_model: Path, chats: Path | int, output_dir: Path, per_device_batch: int, *extra: str,
            continue_on_error=False) -> dict:
    """recipes/sft_lora.py on recipes/configs/sft_tiny.yaml: LoRA on q_proj/v_proj of `base_model`, the `chats`
    JSONL (or, for a number, `--stdlib_chats chats`) with a quarter held out, 2 epochs. `--dataloader_drop_last`: 22
    training chats do not fill the last global batch of 4, and accelerate would complete it on 2 processes with chats
    from the start of the epoch (`even_batches`), which one process does not do."""
    data = ["--stdlib_chats", str(chats)] if isinstance(chats, int) else ["--train_file", str(chats)]
    args = ["--config", str(REPO_ROOT / "recipes/configs/sft_tiny.yaml"), "--model_name_or_path", str(base_model),
            *data, "--val_split", "0.25", "--output_dir", str(output_dir),
            "--per_device_train_batch_size", str(per_device_batch), "--per_device_eval_batch_size", "4",
            "--dataloader_drop_last", "true", "--report_to", "none", "--ddp_timeout", str(COLLECTIVE_TIMEOUT_S),
            *extra]
    return {"name": name, "recipe": "sft_lora", "args": args, "continue_on_error": continue_on_error,
            "record_gradients": True}


CHECKPOINTED = ("--save_strategy", "steps", "--save_steps", str(CHECKPOINT_STEP))
# Every weight with MuonAdamW (the chat stage after pretraining); nanochat's schedule, at the AdamW base's LRs
FULL_MUON = ("--use_peft", "false", "--optim", "muon", "--lr_scheduler_type", "warmup_stable_decay")
TWO_STREAMS_ONE_PROCESS = ("--dataloader_num_workers", "2", "--gradient_accumulation_steps", "2")


def resumed_from(uninterrupted_dir: Path) -> tuple[str, ...]:
    """Resume from the step-10 checkpoint that the uninterrupted run left in `uninterrupted_dir`."""
    return "--resume_from_checkpoint", str(uninterrupted_dir / f"checkpoint-{CHECKPOINT_STEP}")


def muon_and_resumed(out: Path, *extra: str) -> list[dict]:
    """Pretrain Muon with a checkpoint at step 10, and its resumption from that checkpoint."""
    return [pretrain_run("pretrain_muon", out / "pretrain_muon", 4, *extra, "--optim", "muon", *CHECKPOINTED,
                         record_gradients=True),
            pretrain_run("pretrain_muon_resumed", out / "pretrain_muon_resumed", 4, *extra, "--optim", "muon",
                         *resumed_from(out / "pretrain_muon"))]


@pytest.fixture(scope="session")
def distributed_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="session")
def sft_chats(distributed_dir) -> Path:
    """32 chats about stdlib functions, written once and read by every SFT run (one file for all launches)."""
    from hfl3.data.chat import write_chat_jsonl
    from hfl3.data.stdlib import stdlib_docstring_chats

    return write_chat_jsonl(stdlib_docstring_chats(SFT_CHATS, seed=0), distributed_dir / "stdlib_chats.jsonl")


@pytest.fixture(scope="session")
def reference(distributed_dir, sft_chats) -> Launch:
    """One process: pretrain with AdamW and with Muon on the global batch (2 workers x 4 rows, accumulated), AdamW on
    half of it (the gradients a rank would step with without the all-reduce), and SFT LoRA on the AdamW model, which
    is the base of every SFT run."""
    out = distributed_dir / "single"
    return launch(None, [
        pretrain_run("pretrain_adamw", out / "pretrain_adamw", 4, *TWO_STREAMS_ONE_PROCESS, record_gradients=True),
        pretrain_run("pretrain_muon", out / "pretrain_muon", 4, *TWO_STREAMS_ONE_PROCESS, "--optim", "muon"),
        pretrain_run("pretrain_half_batch", out / "pretrain_half_batch", 4, record_gradients=True),
        sft_run("sft_lora", out / "pretrain_adamw", sft_chats, out / "sft_lora", 4),
        sft_run("sft_full_muon", out / "pretrain_adamw", sft_chats, out / "sft_full_muon", 4, *FULL_MUON),
    ], out, env={"OMP_NUM_THREADS": "1"})  # as torchrun sets for each rank; 2 threads on a busy 2-core box crawl


@pytest.fixture(scope="session")
def sft_base(reference, distributed_dir) -> Path:
    reference.metrics("pretrain_adamw")
    return distributed_dir / "single" / "pretrain_adamw"


@pytest.fixture(scope="session")
def ddp(distributed_dir, sft_base, sft_chats) -> Launch:
    """accelerate_configs/multi_cpu_ddp.yaml (2 processes, gloo): pretrain AdamW (checkpoint at step 10; the stream
    read in 1 DataLoader worker per process), pretrain Muon, SFT LoRA. The DDP resume is the two-machine launches'
    (`machines_resumed`: the same run, resumed after machine 1 was lost)."""
    out = distributed_dir / "ddp"
    worker = ("--dataloader_num_workers", "1")
    return launch("multi_cpu_ddp.yaml", [
        pretrain_run("pretrain_adamw", out / "pretrain_adamw", 4, "--use_cpu", *worker, *CHECKPOINTED,
                     record_rows=True, record_gradients=True),
        pretrain_run("pretrain_muon", out / "pretrain_muon", 4, "--use_cpu", "--optim", "muon"),
        sft_run("sft_lora", sft_base, sft_chats, out / "sft_lora", 2, "--use_cpu", continue_on_error=True),
        sft_run("sft_full_muon", sft_base, sft_chats, out / "sft_full_muon", 2, "--use_cpu", *FULL_MUON,
                continue_on_error=True),
    ], out)


@pytest.fixture(scope="session")
def ddp_without_use_cpu(distributed_dir) -> Launch:
    """multi_cpu_ddp.yaml without `--use_cpu`: the recipe must stop on both ranks. Its own launch: run after the
    other DDP runs in the same processes, rank 0's accelerate state set up a new process group that rank 1 (already
    failed) never joined, and the launch hung in `init_process_group` (seen twice in CI-like runs)."""
    out = distributed_dir / "ddp_without_use_cpu"
    return launch("multi_cpu_ddp.yaml", [
        pretrain_run("pretrain_without_use_cpu", out / "pretrain_without_use_cpu", 4, continue_on_error=True),
    ], out)


@pytest.fixture(scope="session")
def zero2(distributed_dir, sft_base, sft_chats) -> Launch:
    """accelerate_configs/zero2.yaml on CPU (2 processes, gloo): pretrain AdamW and Muon (checkpoints at step 10), their
    resumptions, SFT LoRA."""
    out = distributed_dir / "zero2"
    gloo = ("--ddp_backend", "gloo")
    return launch("zero2.yaml", [
        pretrain_run("pretrain_adamw", out / "pretrain_adamw", 4, *gloo, *CHECKPOINTED, record_rows=True,
                     record_gradients=True),
        pretrain_run("pretrain_adamw_resumed", out / "pretrain_adamw_resumed", 4, *gloo,
                     *resumed_from(out / "pretrain_adamw"), record_rows=True),
        *muon_and_resumed(out, *gloo),
        sft_run("sft_lora", sft_base, sft_chats, out / "sft_lora", 2, *gloo, continue_on_error=True),
        sft_run("sft_full_muon", sft_base, sft_chats, out / "sft_full_muon", 2, *gloo, *FULL_MUON,
                continue_on_error=True),
    ], out)


@pytest.fixture(scope="session")
def zero3(distributed_dir, sft_base, sft_chats) -> Launch:
    """accelerate_configs/zero3.yaml on CPU (2 processes, gloo): pretrain AdamW, pretrain Muon (checkpoint at step 10)
    and its resumption, SFT LoRA."""
    out = distributed_dir / "zero3"
    gloo = ("--ddp_backend", "gloo")
    return launch("zero3.yaml", [
        pretrain_run("pretrain_adamw", out / "pretrain_adamw", 4, *gloo, record_gradients=True),
        *muon_and_resumed(out, *gloo),
        sft_run("sft_lora", sft_base, sft_chats, out / "sft_lora", 2, *gloo, continue_on_error=True),
        sft_run("sft_full_muon", sft_base, sft_chats, out / "sft_full_muon", 2, *gloo, *FULL_MUON,
                continue_on_error=True),
    ], out)


@pytest.fixture(scope="session")
def fsdp2_gpu(distributed_dir) -> Launch:
    """accelerate_configs/fsdp2.yaml on every CUDA GPU of the machine: pretrain AdamW, pretrain Muon."""
    import torch

    gpus = torch.cuda.device_count()
    out = distributed_dir / "fsdp2"
    per_device = 8 // gpus if 8 % gpus == 0 else 8
    return launch("fsdp2.yaml", [
        pretrain_run("pretrain_adamw", out / "pretrain_adamw", per_device),
        pretrain_run("pretrain_muon", out / "pretrain_muon", per_device, "--optim", "muon"),
    ], out, launch_args=("--num_processes", str(gpus)))


ON_MACHINES = ("--use_cpu", "--dataloader_num_workers", "1", *CHECKPOINTED)
"""The `ddp` launch's pretraining arguments (the same run)."""


def launch_machines(runs: list[dict], workdir: Path, name: str, lose_machine_1_after: str | None = None) -> Launch:
    """Run `runs` (as `launch` does) on two machines stood in for by two launchers on this host: `accelerate launch
    --config_file accelerate_configs/multi_cpu_ddp.yaml --num_machines 2 --num_processes 2 --machine_rank M
    --main_process_ip 127.0.0.1 --main_process_port P`, one process each, each in its own working directory
    `workdir/machine<M>`: a relative path (`--output_dir out`) is on that machine's own disk, an absolute one on a
    filesystem both share. Logs: `workdir/<name>.machine<M>.log`.

    `lose_machine_1_after`: once that path (relative to machine 0's directory) exists, machine 1 is lost: its
    launcher and its rank are killed (SIGKILL). `Launch.lost` holds machine 0's exit code (`exit`) and the seconds
    from the kill to its end (`stop_s`). Without it, both launchers must exit 0.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    plan = workdir / "plan.json"
    plan.write_text(json.dumps({"results_dir": str(workdir), "runs": runs}, indent=1))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    logs = [workdir / f"{name}.machine{machine}.log" for machine in range(2)]
    launchers = []
    for machine, log in enumerate(logs):
        (workdir / f"machine{machine}").mkdir(exist_ok=True)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(CONFIGS / "multi_cpu_ddp.yaml"), "--num_machines", "2", "--num_processes", "2",
                   "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port",
                   str(port), str(RUNNER), str(plan)]
        launchers.append(subprocess.Popen(command, cwd=workdir / f"machine{machine}", env=env, stdout=log.open("w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))

    def kill(machine: int) -> None:  # the launcher's process group, and the rank it started (its own session)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launchers[machine].pid, signal.SIGKILL)
        pid = workdir / f"rank{machine}.pid"
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
            os.kill(int(pid.read_text()), signal.SIGKILL)

    start, lost = time.perf_counter(), None
    try:
        if lose_machine_1_after:
            while not (workdir / "machine0" / lose_machine_1_after).exists():
                if launchers[0].poll() is not None or time.perf_counter() - start > LAUNCH_TIMEOUT_S:
                    pytest.fail(f"{name}: machine 0 ended before {lose_machine_1_after} appeared:\n"
                                f"{logs[0].read_text()[-4000:]}")
                time.sleep(0.05)
            kill(1)
            killed = time.perf_counter()
            lost = {"exit": launchers[0].wait(timeout=LAUNCH_TIMEOUT_S), "stop_s": time.perf_counter() - killed}
        codes = [launcher.wait(timeout=max(1.0, LAUNCH_TIMEOUT_S - (time.perf_counter() - start)))
                 for launcher in launchers]
    finally:
        for machine, launcher in enumerate(launchers):
            if launcher.poll() is None:
                kill(machine)
    seconds = time.perf_counter() - start
    log = "\n".join(f"===== machine {machine}\n{path.read_text()}" for machine, path in enumerate(logs))
    records: dict[str, list[dict]] = {}
    for path in sorted(workdir.glob("*.rank*.json")):
        record = json.loads(path.read_text())
        records.setdefault(record["name"], []).append(record)
    if lost is None and codes != [0, 0]:
        errors = {run: [record["error"] for record in found] for run, found in records.items()}
        pytest.fail(f"{name}: launchers exited {codes} ({seconds:.0f} s); errors per run and rank: {errors}\n"
                    f"log tail:\n{log[-6000:]}")
    print(f"\n[distributed] two machines ({name}): {len(runs)} runs in {seconds:.0f} s")
    return Launch(f"two machines ({name})", records, log, seconds, workdir, lost)


@pytest.fixture(scope="session")
def machines(distributed_dir) -> Launch:
    """Two machines (`launch_machines`), one process each. In a folder both see (absolute `--output_dir`): pretrain
    AdamW as the `ddp` launch does, training its own tokenizer, with a checkpoint at step 10 and the CORE metric every
    10 steps from a bundle only machine 0 has (`--core_bundle_dir core_bundle`, relative); then `python -m
    hfl3.evaluate core` of that model with the same bundle; then, on their own disks (relative `--output_dir`), the
    same pretraining, whose machine 1 is lost once machine 0 committed checkpoint-10."""
    out = distributed_dir / "machines"
    shutil.copytree(CORE_BUNDLE, out / "machine0" / "core_bundle")
    core = ("--core_bundle_dir", "core_bundle")
    return launch_machines([
        pretrain_run("pretrain_shared", out / "shared" / "pretrain", 4, *ON_MACHINES, *core,
                     "--core_metric_every", str(CHECKPOINT_STEP), record_rows=True),
        {"name": "core", "recipe": "core", "args": ["--model_name_or_path", str(out / "shared" / "pretrain"), *core,
                                                    "--use_cpu", "--output_json", str(out / "core.json")]},
        {**pretrain_run("pretrain_lost", Path("pretrain"), 4, *ON_MACHINES, record_rows=True), "as_script": True},
    ], out, "lost", lose_machine_1_after="pretrain/checkpoint-10")


@pytest.fixture(scope="session")
def machines_resumed(machines, sft_base) -> Launch:
    """The lost pretraining continued on both machines with `--resume_from_checkpoint latest` (machine 1's own
    directory holds no checkpoint); then SFT LoRA on their own disks, on stdlib chats that machine 0 writes, the
    epoch-1 adapter kept as the best one (`--greater_is_better true` on the eval loss). SFT comes last: its
    `Trainer.end()` destroys the process group."""
    return launch_machines([
        pretrain_run("pretrain_resumed", Path("pretrain"), 4, *ON_MACHINES, "--resume_from_checkpoint", "latest",
                     record_rows=True),
        sft_run("sft", sft_base, SFT_CHATS, Path("sft"), 2, "--use_cpu",
                "--greater_is_better", "true"),
    ], machines.workdir, "resumed")
