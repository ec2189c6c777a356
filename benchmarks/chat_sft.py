"""The chat stage after pretraining, four ways, side by side in one run: the demo's pretrained L3GPT fine-tuned on the
same chats for the same steps with (a) LoRA + AdamW (the demo's SFT), (b) every weight + AdamW, (c) every weight +
MuonAdamW (nanochat chat SFT's schedule: the base's group LRs × 0.8, warmdown over the last half), (d) the same warm-
started from the base's optimizer state (nanochat's `--load-optimizer 1`). Each arm is the SFT recipe's own path
(`recipes/sft_lora.py`'s parser and `main`, in a fresh process); each is run with two seeds (init of the adapters,
data order).

The base: `recipes/configs/demo.yaml` pretrained with `--optim muon` (so that its folder holds MuonAdamW's state for
arm d; `--save_optimizer` is on by default), once, into `--base_dir` (reused when it is there). The data:
`recipes/configs/sft_demo.yaml`'s (600 stdlib-docstring chats, 10 % held out, rows of 192 tokens). Reported per arm
(mean and spread over the seeds): the held-out chats' loss before and after (`eval_before_loss`, `eval_loss`), the
supervised tokens per second of training (the step-0 evaluation excluded; the final one runs after training), and
the peak RSS (CPU) or CUDA memory. Every arm runs one batch of the demo's 16 rows per step (`--gradient_accumulation_
steps 1`: a full fine-tuning would otherwise take the base's total batch, `hfl3.trainers.sft_inheritance`).

    python benchmarks/chat_sft.py --json benchmarks/results/chat_sft_cpu.json    # CPU: ~14 min on 2 cores (5: the base)
    python benchmarks/chat_sft.py --arms full_muon full_muon_warm --seeds 0 --max_steps 20

On a GPU the same arms run at the shape the arguments give (`make bench-gpu` runs them as the `chat_sft` section).
"""

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, in_fresh_process, shown_path, write_result  # noqa: E402

ARMS = {  # name: the SFT recipe's flags that make the arm
    "lora_adamw": [],
    "full_adamw": ["--use_peft", "false", "--learning_rate", "3e-4"],
    "full_muon": ["--use_peft", "false", "--optim", "muon", "--load_optimizer", "false",
                  "--lr_scheduler_type", "warmup_stable_decay"],
    "full_muon_warm": ["--use_peft", "false", "--optim", "muon", "--load_optimizer", "true",
                       "--lr_scheduler_type", "warmup_stable_decay"],
}


@dataclass
class ChatSFTArguments:
    base_dir: str = field(default="build/chat_sft_base", metadata={"help": "the pretrained base (made once)"})
    pretrain_steps: int = field(default=600, metadata={"help": "steps of the base's pretraining (the demo's 600)"})
    arms: list[str] = field(default_factory=lambda: list(ARMS), metadata={"help": f"any of {list(ARMS)}"})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "one run per arm and seed"})
    max_steps: int = field(default=60, metadata={"help": "optimizer steps of every arm"})
    stdlib_chats: int = field(default=600, metadata={"help": "chats (sft_demo.yaml: 600)"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})

    def __post_init__(self):
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"--arms: unknown {sorted(unknown)}; expected some of {list(ARMS)}")


def pretrain_base(args: ChatSFTArguments) -> Path:
    """The demo's L3GPT pretrained with Muon into `base_dir` (the recipe, launched as `make demo` launches it); kept
    and reused."""
    base = Path(args.base_dir)
    if (base / "model.safetensors").is_file() and (base / "optimizer/optimizer.safetensors").is_file():
        return base
    launch = "single_gpu.yaml" if torch.cuda.is_available() else "cpu.yaml"
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
                    str(REPO_ROOT / "accelerate_configs" / launch), str(REPO_ROOT / "recipes" / "pretrain.py"),
                    "--config", str(REPO_ROOT / "recipes" / "configs" / "demo.yaml"), "--optim", "muon",
                    "--output_dir", str(base), "--max_steps", str(args.pretrain_steps), "--overwrite_output_dir",
                    "--disable_tqdm", "true"], check=True, cwd=REPO_ROOT)
    return base


def run_arm(arm: str, seed: int, base: str, args: ChatSFTArguments, output_dir: str) -> dict:
    """One arm with one seed, through the SFT recipe's parser and `main`; its results and peak memory."""
    sys.path.insert(0, str(REPO_ROOT / "recipes"))
    import sft_lora

    from hfl3.trainers.arguments import parse_recipe_args

    cli = ["--config", str(REPO_ROOT / "recipes" / "configs" / "sft_demo.yaml"), "--model_name_or_path", base,
           "--output_dir", output_dir, "--seed", str(seed), "--max_steps", str(args.max_steps), "--stdlib_chats",
           str(args.stdlib_chats), "--sample_prompts", "What does `len(obj)` do?", "--max_new_tokens", "8",
           "--disable_tqdm", "true", "--save_strategy", "no", "--eval_strategy", "steps", "--eval_steps",
           str(args.max_steps + 1), "--load_best_model_at_end", "false", "--gradient_accumulation_steps", "1",
           *ARMS[arm]]  # evaluated at step 0 and after training; one batch per step in every arm
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    script, model, training, setup = parse_recipe_args(sft_lora.make_parser(), cli)
    started = time.perf_counter()
    results = sft_lora.main(script, training, model, setup)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    training_seconds = results["train_runtime"] - results.get("eval_before_runtime", 0.0)  # the step-0 evaluation out
    return {"arm": arm, "seed": seed, "eval_before_loss": results.get("eval_before_loss"),
            "eval_loss": results.get("eval_loss"), "train_supervised_tokens": results["train_supervised_tokens"],
            "training_seconds": training_seconds, "wall_seconds": time.perf_counter() - started,
            "tokens_per_second": results["train_supervised_tokens"] / training_seconds, "peak_memory_bytes": peak}


def summarize(runs: list[dict], arms: list[str]) -> dict:
    """Per arm: mean and half-spread over the seeds of the eval losses, tokens/s and peak memory."""
    table = {}
    for arm in arms:
        mine = [run for run in runs if run["arm"] == arm]
        row = {}
        for key in ("eval_before_loss", "eval_loss", "tokens_per_second", "peak_memory_bytes"):
            values = [run[key] for run in mine if run.get(key) is not None]
            if values:
                row[key] = {"mean": statistics.mean(values), "spread": (max(values) - min(values)) / 2,
                            "values": values}
        table[arm] = row
    return table


def main(args: ChatSFTArguments) -> dict:
    base = str(pretrain_base(args))
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for arm in args.arms:
                runs.append(in_fresh_process(run_arm, arm, seed, base, args, str(Path(scratch) / f"{arm}_{seed}")))
                print(f"{arm} seed {seed}: eval loss {runs[-1]['eval_before_loss']:.4f} -> {runs[-1]['eval_loss']:.4f}"
                      f", {runs[-1]['tokens_per_second']:.0f} supervised tok/s", flush=True)
    table = summarize(runs, args.arms)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"\nChat SFT of the demo L3GPT ({args.pretrain_steps} Muon pretraining steps), {args.max_steps} steps per arm,"
          f" seeds {args.seeds}, {device}")
    print(f"{'arm':<16}{'eval loss before':>18}{'eval loss after':>20}{'sup. tok/s':>16}{'peak MB':>10}")
    for arm, row in table.items():
        cell = lambda key, fmt: (f"{row[key]['mean']:{fmt}} ±{row[key]['spread']:.3f}" if key in row else "—")  # noqa: E731
        print(f"{arm:<16}{cell('eval_before_loss', '.4f'):>18}{cell('eval_loss', '.4f'):>20}"
              f"{row['tokens_per_second']['mean'] if 'tokens_per_second' in row else 0:>16.0f}"
              f"{row['peak_memory_bytes']['mean'] / 2**20 if 'peak_memory_bytes' in row else 0:>10.0f}")
    return write_result(args.json, {"args": asdict(args) | {"base_dir": shown_path(args.base_dir)},
                                    "device": device, "summary": table, "runs": runs})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(HfArgumentParser(ChatSFTArguments).parse_args_into_dataclasses()[0])
