"""The chat stage after pretraining, four ways, side by side in one run: the demo's pretrained L3GPT fine-tuned on the
same chats for the same steps with (a) LoRA + AdamW (the demo's SFT), (b) every weight + AdamW, (c) every weight +
MuonAdamW (nanochat chat SFT's schedule: the base's group LRs × 0.8, warmdown over the last half), (d) the same warm-
started from the base's optimizer state (nanochat's `--load-optimizer 1`). Each arm is the SFT recipe's own path
(`recipes/sft_lora.py`'s parser and `main`, in a fresh process); each is run with two seeds (init of the adapters,
data order).

The base (`--base`): `l3gpt_muon`, `recipes/configs/demo.yaml` pretrained with `--optim muon` (so that its folder
holds MuonAdamW's state for arm d; `--save_optimizer` is on by default); or `llama_adamw`, a base hfl3's pretraining
did not write: a Llama of SmolLM2's architecture (tied embeddings, grouped-query attention, SiLU MLP; `LLAMA_BASE`,
smaller) pretrained with AdamW by the plain HF Trainer on the same stdlib text with the demo's tokenizer, saved without
hfl3's metadata. There arm c takes fine-tuning-scale group LRs derived from `--learning_rate`
(`GroupLearningRates.for_fine_tuning`), and arm `full_muon_pretraining_lrs` runs Muon at nanochat's pretraining group
LRs, what arm c ran at on such a base before that rule (the "4.15 → 8.01" of a SmolLM2 SFT). Made once into
`--base_dir` (reused when it is there). The data:
`recipes/configs/sft_demo.yaml`'s (600 stdlib-docstring chats, 10 % held out, rows of 192 tokens). Reported per arm
(mean and spread over the seeds): the held-out chats' loss before and after (`eval_before_loss`, `eval_loss`), the
supervised tokens per second of training (the step-0 evaluation excluded; the final one runs after training), and
the peak RSS (CPU) or CUDA memory; on the Llama base also what the model still knows of its pretraining text, before
and after (`text_loss`: the mean loss on 32 rows of the stdlib text it was pretrained on), which a fine-tuning that
wrecks the base raises. Every arm runs one batch of the demo's 16 rows per step (`--gradient_accumulation_steps 1`: a
full fine-tuning would otherwise take the base's total batch, `hfl3.trainers.sft.inheritance`).

    python benchmarks/chat_sft.py --json benchmarks/results/chat_sft_cpu.json    # CPU: ~14 min on 2 cores (5: the base)
    python benchmarks/chat_sft.py --arms full_muon full_muon_warm --seeds 0 --max_steps 20
    python benchmarks/chat_sft.py --base llama_adamw --base_dir build/chat_sft_llama \
        --arms full_adamw full_muon full_muon_pretraining_lrs --json benchmarks/results/chat_sft_llama_cpu.json

On a GPU the same arms run at the shape the arguments give (`make bench-gpu` runs them as the `chat_sft` section).
"""

import os
import resource
import shutil
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

ARMS = {  # name: the SFT recipe's flags that make the arm (`{lr}`: --learning_rate)
    "lora_adamw": [],
    "full_adamw": ["--use_peft", "false", "--learning_rate", "{lr}"],
    "full_muon": ["--use_peft", "false", "--optim", "muon", "--load_optimizer", "false",
                  "--lr_scheduler_type", "warmup_stable_decay", "--learning_rate", "{lr}"],
    "full_muon_warm": ["--use_peft", "false", "--optim", "muon", "--load_optimizer", "true",
                       "--lr_scheduler_type", "warmup_stable_decay"],
    "full_muon_pretraining_lrs": ["--use_peft", "false", "--optim", "muon", "--load_optimizer", "false",
                                  "--lr_scheduler_type", "warmup_stable_decay", "--matrix_lr", "0.02",
                                  "--embedding_lr", "0.3", "--unembedding_lr", "0.004", "--scalar_lr", "0.5",
                                  "--smear_lr", "0.2"],
}
BASES = ("l3gpt_muon", "llama_adamw")
LLAMA_BASE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True,
                  rope_theta=10000.0)
"""SmolLM2-135M's architecture (LlamaForCausalLM: tied embeddings, 3 query heads per key-value head, SiLU MLP) at
a size a CPU pretrains in minutes (SmolLM2-135M: hidden 576, 30 layers, 9 heads)."""


@dataclass
class ChatSFTArguments:
    base: str = field(default="l3gpt_muon", metadata={"help": f"one of {BASES} (module docstring)"})
    base_dir: str = field(default="build/chat_sft_base", metadata={"help": "the pretrained base (made once)"})
    pretrain_steps: int = field(default=600, metadata={"help": "steps of the base's pretraining (the demo's 600)"})
    learning_rate: float = field(default=3e-4, metadata={"help": "--learning_rate of the full_adamw and full_muon "
                                                         "arms (full_muon: used on a base not pretrained with Muon)"})
    arms: list[str] = field(default_factory=lambda: list(ARMS), metadata={"help": f"any of {list(ARMS)}"})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "one run per arm and seed"})
    max_steps: int = field(default=60, metadata={"help": "optimizer steps of every arm"})
    stdlib_chats: int = field(default=600, metadata={"help": "chats (sft_demo.yaml: 600)"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})

    def __post_init__(self):
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"--arms: unknown {sorted(unknown)}; expected some of {list(ARMS)}")
        if self.base not in BASES:
            raise ValueError(f"--base {self.base}: expected one of {BASES}")


def pretrain_base(args: ChatSFTArguments) -> Path:
    """The demo's L3GPT pretrained with Muon into `base_dir` (the recipe, launched as `make demo` launches it), or
    the Llama of `pretrain_llama_base`; kept and reused."""
    base = Path(args.base_dir)
    if args.base == "llama_adamw":
        if not (base / "model.safetensors").is_file():
            in_fresh_process(pretrain_llama_base, str(base), args.pretrain_steps)
        return base
    if (base / "model.safetensors").is_file() and (base / "optimizer/optimizer.safetensors").is_file():
        return base
    launch = "single_gpu.yaml" if torch.cuda.is_available() else "cpu.yaml"
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
                    str(REPO_ROOT / "accelerate_configs" / launch), str(REPO_ROOT / "recipes" / "pretrain.py"),
                    "--config", str(REPO_ROOT / "recipes" / "configs" / "demo.yaml"), "--optim", "muon",
                    "--output_dir", str(base), "--max_steps", str(args.pretrain_steps), "--overwrite_output_dir",
                    "--disable_tqdm", "true"], check=True, cwd=REPO_ROOT)
    return base


def pretrain_llama_base(folder: str, steps: int) -> None:
    """A base hfl3's pretraining did not write: the demo's tokenizer (`hfl3.tokenization.train_tokenizer` on the first
    3 M characters of the stdlib's sources, 4096 tokens, ChatML template) and a `LLAMA_BASE` Llama pretrained on the same sources by the
    plain HF Trainer with AdamW (lr 3e-3, 20 warmup steps, cosine, weight decay 0.1, rows of 256 tokens, batch 8,
    seed 0), saved with `save_pretrained` only (no metadata.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

    from hfl3.data.stdlib import stdlib_files
    from hfl3.tokenization import train_tokenizer

    set_seed(0)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_files()]
    sample, chars = [], 0  # the demo's --tokenizer_train_chars 3000000
    for text in texts:
        sample, chars = sample + [text], chars + len(text)
        if chars >= 3_000_000:
            break
    tokenizer = train_tokenizer(iter(sample), vocab_size=4096)
    ids = [token for text in texts for token in [tokenizer.bos_token_id, *tokenizer(text)["input_ids"]]]
    length = LLAMA_BASE["max_position_embeddings"]
    rows = [{"input_ids": ids[i:i + length], "labels": ids[i:i + length]}
            for i in range(0, len(ids) - length, length)]
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                         **LLAMA_BASE))
    scratch = tempfile.mkdtemp(prefix="llama-base-")
    training = TrainingArguments(output_dir=scratch, max_steps=steps, learning_rate=3e-3,
                                 warmup_steps=20, lr_scheduler_type="cosine", weight_decay=0.1,
                                 per_device_train_batch_size=8, logging_steps=50, save_strategy="no",
                                 report_to="none", seed=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    Trainer(model=model, args=training, train_dataset=rows).train()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shutil.rmtree(scratch, ignore_errors=True)


TEXT_ROWS = 32
"""Rows of 256 tokens of `text_loss`: the last of the stdlib text the Llama base was pretrained on."""


def text_loss(folder: str) -> float:
    """What a model still knows of the base's pretraining text: its mean loss on the last `TEXT_ROWS` rows of 256
    tokens of the stdlib sources, cut as `pretrain_llama_base` cut them (the base trained on a random 14 % of its
    rows, once). A fine-tuning that wrecks the base raises it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfl3.data.stdlib import stdlib_files

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    length, ids = LLAMA_BASE["max_position_embeddings"], []
    for path in reversed(stdlib_files()):
        ids = [tokenizer.bos_token_id, *tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"],
               *ids]
        if len(ids) >= (TEXT_ROWS + 1) * length:
            break
    rows = torch.tensor(ids[-TEXT_ROWS * length:]).view(TEXT_ROWS, length)
    with torch.no_grad():
        return sum(model(input_ids=row[None], labels=row[None]).loss.item() for row in rows) / TEXT_ROWS


def run_arm(arm: str, seed: int, base: str, args: ChatSFTArguments, output_dir: str) -> dict:
    """One arm with one seed, through the SFT recipe's parser and `main`; its results and peak memory."""
    sys.path.insert(0, str(REPO_ROOT / "recipes"))
    import sft_lora

    from hfl3.trainers.cli.arguments import parse_recipe_args

    cli = ["--config", str(REPO_ROOT / "recipes" / "configs" / "sft_demo.yaml"), "--model_name_or_path", base,
           "--output_dir", output_dir, "--seed", str(seed), "--max_steps", str(args.max_steps), "--stdlib_chats",
           str(args.stdlib_chats), "--sample_prompts", "What does `len(obj)` do?", "--max_new_tokens", "8",
           "--disable_tqdm", "true", "--save_strategy", "no", "--eval_strategy", "steps", "--eval_steps",
           str(args.max_steps + 1), "--load_best_model_at_end", "false", "--gradient_accumulation_steps", "1",
           *[flag.format(lr=args.learning_rate) for flag in ARMS[arm]]]  # evaluated at step 0 and after training;
    # one batch per step in every arm
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    parser = sft_lora.make_parser()
    script, training, model = parse_recipe_args(parser, cli)
    started = time.perf_counter()
    results = sft_lora.main(script, training, model, parser.given_arguments(cli))
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    training_seconds = results["train_runtime"] - results.get("eval_before_runtime", 0.0)  # the step-0 evaluation out
    kept = {"text_loss_before": text_loss(base), "text_loss": text_loss(output_dir)} \
        if args.base == "llama_adamw" and arm != "lora_adamw" else {}
    return {"arm": arm, "seed": seed, "eval_before_loss": results.get("eval_before_loss"),
            "eval_loss": results.get("eval_loss"), **kept, "train_supervised_tokens": results["train_supervised_tokens"],
            "training_seconds": training_seconds, "wall_seconds": time.perf_counter() - started,
            "tokens_per_second": results["train_supervised_tokens"] / training_seconds, "peak_memory_bytes": peak}


def summarize(runs: list[dict], arms: list[str]) -> dict:
    """Per arm: mean and half-spread over the seeds of the eval losses, tokens/s and peak memory."""
    table = {}
    for arm in arms:
        mine = [run for run in runs if run["arm"] == arm]
        row = {}
        for key in ("eval_before_loss", "eval_loss", "text_loss_before", "text_loss", "tokens_per_second",
                    "peak_memory_bytes"):
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
    described = "the demo L3GPT" if args.base == "l3gpt_muon" else "a SmolLM2-architecture Llama"
    how = "Muon" if args.base == "l3gpt_muon" else "AdamW"
    print(f"\nChat SFT of {described} ({args.pretrain_steps} {how} pretraining steps), {args.max_steps} steps per arm,"
          f" seeds {args.seeds}, --learning_rate {args.learning_rate:g}, {device}")
    print(f"{'arm':<26}{'eval loss before':>18}{'eval loss after':>20}{'text loss before':>18}{'text loss after':>20}"
          f"{'sup. tok/s':>12}{'peak MB':>10}")
    for arm, row in table.items():
        cell = lambda key, fmt: (f"{row[key]['mean']:{fmt}} ±{row[key]['spread']:.3f}" if key in row else "—")  # noqa: E731
        print(f"{arm:<26}{cell('eval_before_loss', '.4f'):>18}{cell('eval_loss', '.4f'):>20}"
              f"{cell('text_loss_before', '.4f'):>18}{cell('text_loss', '.4f'):>20}"
              f"{row['tokens_per_second']['mean'] if 'tokens_per_second' in row else 0:>12.0f}"
              f"{row['peak_memory_bytes']['mean'] / 2**20 if 'peak_memory_bytes' in row else 0:>10.0f}")
    return write_result(args.json, {"args": asdict(args) | {"base_dir": shown_path(args.base_dir)},
                                    "device": device, "summary": table, "runs": runs})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(HfArgumentParser(ChatSFTArguments).parse_args_into_dataclasses()[0])
