"""Overhead of hfl3's training path (the recipe's `PretrainTrainer` from `hfl3.trainers.pretraining.builder`: its
collator, callbacks and MuonAdamW) over an equivalent plain PyTorch loop, on the same tiny L3GPT and the same
batches. Goal: ≤ 1.05×.

The two paths alternate step by step: after each Trainer step, a callback advances the plain loop (a generator) by
one step, so both see the same machine load at the same moments (this box is shared). A Trainer step is the time
between two visits of that callback (its next batch, forward, backward, clipping, optimizer and scheduler step,
zero_grad, logging, the other callbacks); a plain step is the same work written as a loop (next batch from a
`DataLoader` with the same collator, forward, backward, `clip_grad_norm_`, step, scheduler step, zero_grad).
Both start from the same weights, read the same rows in the same order (sequential sampling) and use the same
optimizer and schedule, so their weights must agree at the end: the table reports the largest difference as the
proof of equivalence. The first `warmup_steps` pairs are dropped; medians over `rounds × steps` pairs.

On CUDA both paths run bf16 autocast (the Trainer's `--bf16`; the plain loop's `torch.autocast`), optionally
`torch.compile`d (`--compile`), at nanochat's d12 shape by default (rows repeat when the text is shorter than the
run: timing does not depend on the text), and the device is synchronised at each step boundary, so a step's time
includes the device work it waits for: the Trainer's per-step host syncs show up as lost overlap.

    python benchmarks/trainer_overhead.py
    python benchmarks/trainer_overhead.py --optim adamw_torch --dense   # no L3 layer, AdamW
    OMP_NUM_THREADS=1 python benchmarks/trainer_overhead.py --json benchmarks/results/trainer_overhead_cpu.json
    python benchmarks/trainer_overhead.py --dense --compile true --json benchmarks/results/trainer_overhead_h100.json

On a shared 2-core box use `OMP_NUM_THREADS=1`: two OpenMP threads per process on busy cores stall at barriers.
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import datasets
import torch
from torch.utils.data import DataLoader
from transformers import HfArgumentParser, TrainerCallback, get_scheduler, set_seed

from hfl3 import L3GPTForCausalLM
from hfl3.models.l3gpt.configuration_l3gpt import flops_per_token
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.pretraining.trainer import PackedCollator
from hfl3.trainers.pretraining.config import PretrainConfig
from hfl3.trainers.pretraining.builder import build_model, build_trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import text_corpus as text  # noqa: E402
from common import CPU_SHAPE, GPU_SHAPE, ModelShape, find_asset, shown_path, write_result  # noqa: E402

# A shape flag left unset: nanochat's d12 on a GPU; on a CPU the benchmarks' CPU shape with 8 rows per step.
CPU_DEFAULT_SHAPE = replace(CPU_SHAPE, batch_size=8)


@dataclass
class OverheadArguments:
    text_file: str | None = field(default=None, metadata={"help": "training text (default: tinyshakespeare.txt)"})
    vocab_size: int | None = field(default=None, metadata={"help": "BPE vocabulary (2048 CPU, 32768 CUDA)"})
    seq_len: int | None = field(default=None, metadata={"help": "packed row length, tokens (128 CPU, 2048 CUDA)"})
    batch_size: int | None = field(default=None, metadata={"help": "rows per step (8 CPU, 16 CUDA)"})
    depth: int | None = field(default=None, metadata={"help": "decoder layers (2 CPU, 12 CUDA)"})
    aspect_ratio: int = field(default=64, metadata={"help": "hidden_size = depth * aspect_ratio"})
    head_dim: int | None = field(default=None, metadata={"help": "attention head width (64 CPU, 128 CUDA)"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model in both paths"})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 autocast in both paths (default: on CUDA)"})
    l3_after_layers: list[int] = field(default_factory=lambda: [0], metadata={"help": "L3 layers"})
    dense: bool = field(default=False, metadata={"help": "no L3 layer (ignore l3_after_layers)"})
    optim: str = field(default="muon", metadata={"help": "muon (MuonAdamW) or adamw_torch (PretrainConfig.optim)"})
    steps: int = field(default=40, metadata={"help": "measured step pairs per round"})
    warmup_steps: int = field(default=5, metadata={"help": "step pairs dropped at the start of each round"})
    rounds: int = field(default=2, metadata={"help": "fresh models and Trainer per round"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})

    def __post_init__(self):
        (GPU_SHAPE if torch.cuda.is_available() else CPU_DEFAULT_SHAPE).fill(self)
        if self.bf16 is None:
            self.bf16 = torch.cuda.is_available()
        if self.text_file is None:
            self.text_file = str(find_asset("text/tinyshakespeare.txt"))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_data(args: OverheadArguments):
    """A BPE trained on the text, and the text packed into rows of `seq_len` tokens (hfl3's data path)."""
    corpus, _ = text.load_corpus(args.text_file)
    tokenizer = train_tokenizer(corpus["text"], args.vocab_size)
    tokens = text.tokenize_documents(text.chunk_documents(corpus, 2 * args.seq_len), tokenizer)
    packed, _ = text.pack_best_fit(tokens, args.seq_len)
    needed = (args.warmup_steps + args.steps + 1) * args.batch_size
    if len(packed) < needed:  # timing does not depend on the text: repeat the rows
        packed = datasets.concatenate_datasets([packed] * -(-needed // len(packed)))
    allocation_sample = tokens["input_ids"][:2000]
    return tokenizer, packed, allocation_sample


def make_model(args: OverheadArguments, training_args: PretrainConfig, tokenizer, allocation_sample,
               seed: int) -> L3GPTForCausalLM:
    """The recipe's model (`build_model`) at this benchmark's shape, seeded."""
    config = ModelShape.of(args, vocab_size=len(tokenizer)).config(
        window_pattern="L", l3_after_layers=[] if args.dense else args.l3_after_layers,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    set_seed(seed)
    return build_model(config, training_args, allocation_sample=lambda: allocation_sample)


def plain_loop(model, training_args: PretrainConfig, dataset, collator):
    """The plain PyTorch equivalent of the Trainer's step; a generator that performs one step per `next()`."""
    if training_args.use_muon:
        from hfl3.optim import create_muon_optimizer

        optimizer = create_muon_optimizer(model, training_args, num_training_steps=training_args.max_steps)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": training_args.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=training_args.learning_rate, betas=(training_args.adam_beta1, training_args.adam_beta2),
            eps=training_args.adam_epsilon,
        )
    steps = training_args.max_steps
    scheduler = get_scheduler(
        "warmup_stable_decay", optimizer, num_warmup_steps=training_args.get_warmup_steps(steps),
        num_training_steps=steps, scheduler_specific_kwargs={
            "num_decay_steps": round(training_args.warmdown_ratio * steps),
            "min_lr_ratio": training_args.final_lr_frac, "decay_type": "linear"},
    )
    model.train()
    forward = torch.compile(model) if training_args.torch_compile else model
    autocast = torch.autocast(training_args.device.type, dtype=torch.bfloat16, enabled=training_args.bf16)
    for batch in DataLoader(dataset, batch_size=training_args.per_device_train_batch_size, collate_fn=collator):
        batch = {key: value.to(training_args.device) for key, value in batch.items()}
        num_items_in_batch = batch["labels"][:, 1:].ne(-100).sum()
        with autocast:
            loss = forward(**batch, num_items_in_batch=num_items_in_batch).loss
        loss.backward()
        if training_args.max_grad_norm:  # as the Trainer: 0 (the default with Muon) means no clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), training_args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        model.zero_grad()
        yield loss.item()


class AlternatingSteps(TrainerCallback):
    """After every Trainer step, times one step of the plain loop; records both step times (seconds)."""

    def __init__(self, plain_steps):
        self.plain_steps = plain_steps
        self.trainer_times: list[float] = []
        self.plain_times: list[float] = []
        self.last = None

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        now = time.perf_counter()
        if self.last is not None:
            self.trainer_times.append(now - self.last)
        next(self.plain_steps)
        synchronize()
        self.last = time.perf_counter()
        self.plain_times.append(self.last - now)


def run_round(args: OverheadArguments, tokenizer, packed, allocation_sample, output_dir: str, seed: int) -> dict:
    """One round: fresh identical models, the Trainer driving, the plain loop stepped alongside."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = args.warmup_steps + args.steps + 1  # the first Trainer interval ends at the 2nd step
    training_args = PretrainConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=args.batch_size, max_length=args.seq_len,
        optim=args.optim, warmup_steps=3, eval_strategy="no", train_sampling_strategy="sequential",
        logging_steps=min(10, steps),
        report_to="none", seed=seed, dataloader_num_workers=0, dataloader_pin_memory=False,
        bf16=args.bf16, torch_compile=args.compile, use_cpu=not torch.cuda.is_available(),  # bf16 on a CPU needs it
    )
    trainer_model = make_model(args, training_args, tokenizer, allocation_sample, seed).to(device)
    plain_model = make_model(args, training_args, tokenizer, allocation_sample, seed).to(device)
    alternating = AlternatingSteps(plain_loop(plain_model, training_args, packed, PackedCollator(tokenizer.bos_token_id)))
    trainer = build_trainer(trainer_model, training_args, packed, flops_per_token(trainer_model.config, args.seq_len),
                            tokenizer=tokenizer, callbacks=[alternating])
    trainer.train()
    max_difference = max((a - b).abs().max().item()
                         for a, b in zip(trainer_model.parameters(), plain_model.parameters()))
    return {"trainer": alternating.trainer_times[args.warmup_steps:],
            "plain": alternating.plain_times[args.warmup_steps + 1:],
            "max_abs_param_difference": max_difference}


def main(args: OverheadArguments) -> dict:
    tokenizer, packed, allocation_sample = build_data(args)
    rounds = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            rounds.append(run_round(args, tokenizer, packed, allocation_sample, scratch, seed=index))
    trainer_times = [t for r in rounds for t in r["trainer"]]
    plain_times = [t for r in rounds for t in r["plain"]]
    paired = [a / b for a, b in zip(trainer_times, plain_times)]
    medians = {"trainer": statistics.median(trainer_times), "plain": statistics.median(plain_times)}
    results = {
        "args": asdict(args) | {"text_file": shown_path(args.text_file)}, "torch_threads": torch.get_num_threads(),
        "median_seconds": medians,
        "ratio_of_medians": medians["trainer"] / medians["plain"], "median_of_paired_ratios": statistics.median(paired),
        "ratio_of_means": statistics.mean(trainer_times) / statistics.mean(plain_times),
        "max_abs_param_difference": max(r["max_abs_param_difference"] for r in rounds),
        "trainer_seconds": trainer_times, "plain_seconds": plain_times,
    }
    tokens = args.batch_size * args.seq_len
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    results["device"] = device
    print(f"\nTrainer overhead on {device}: L3GPT depth {args.depth}, L3 after "
          f"{'none' if args.dense else args.l3_after_layers}, {args.optim}, batch {args.batch_size}×{args.seq_len}, "
          f"compile {args.compile}, {'bf16' if args.bf16 else 'fp32'}, {len(paired)} alternating step "
          f"pairs ({args.rounds} rounds)")
    print(f"{'path':<14}{'median ms':>10}{'mean ms':>9}{'p10 ms':>8}{'p90 ms':>8}{'tok/s':>8}")
    for name, times in (("plain loop", plain_times), ("hfl3 Trainer", trainer_times)):
        deciles = statistics.quantiles(times, n=10)
        print(f"{name:<14}{1e3 * statistics.median(times):>10.1f}{1e3 * statistics.mean(times):>9.1f}"
              f"{1e3 * deciles[0]:>8.1f}{1e3 * deciles[-1]:>8.1f}{tokens / statistics.median(times):>8.0f}")
    print(f"Trainer / plain: ratio of medians {results['ratio_of_medians']:.3f}, median of paired ratios "
          f"{results['median_of_paired_ratios']:.3f}, ratio of means {results['ratio_of_means']:.3f} (goal ≤ 1.05); "
          f"max |Δ weight| after the run {results['max_abs_param_difference']:.1e}")
    return write_result(args.json, results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(HfArgumentParser(OverheadArguments).parse_args_into_dataclasses()[0])
