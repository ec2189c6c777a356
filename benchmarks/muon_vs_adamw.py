"""Muon (hfl3.optim.MuonAdamW) vs AdamW on a tiny L3GPT: val bpb curves, steps-to-target, optimizer share of a step.

Every run trains the same model (same init, same L3 allocation) through the HF `Trainer`, on the same packed rows in
the same order (the Trainer's sampler, same seed), for the same number of steps, with the same schedule (linear
warm-up then constant: the curve at step k is what a k-step budget reaches before any decay) and the same gradient
clipping. Arms:
  adamw          `optim="adamw_torch"`, one LR for every parameter, betas (0.9, 0.95): what a Trainer user gets;
                 tuned over `--adamw_lrs`.
  muon           `create_muon_optimizer`: Muon on the matrices at `--muon_lrs`, nanochat's AdamW groups/LRs for the
                 rest (embedding 0.3, unembedding 0.004, scalars 0.5, scaled by (hidden/768)^-0.5).
  adamw_grouped  optional (`--grouped_adamw_lrs`): the same groups and LRs as `muon` but AdamW on the matrices too,
                 to separate what the orthogonalisation brings from what nanochat's per-group LRs bring.
Validation bpb = summed cross-entropy (nats) / (ln 2 · UTF-8 bytes) over the targets of held-out documents (targets
with 0 bytes, i.e. BOS, excluded), as nanochat's `evaluate_bpb`.

Reported: each arm's best final bpb, the first step (linearly interpolated between evaluations) at which the best Muon
run reaches the best AdamW final bpb and its ratio to the total steps (goal <= 0.7), and the optimizer step's share of
the training step time (goal <= 10% on CPU), timed by Trainer callbacks around `optimizer.step()` (first 5 steps and
evaluations excluded).

    .venv/bin/python benchmarks/muon_vs_adamw.py                       # 6 runs of 200 steps, ~10 min of one idle core
    .venv/bin/python benchmarks/muon_vs_adamw.py --grouped_adamw_lrs 3e-3,1e-2 --json > muon_vs_adamw.json
    .venv/bin/python benchmarks/muon_vs_adamw.py --steps 6 --eval_every 3 --adamw_lrs 3e-3 --muon_lrs 0.02  # smoke
"""

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from hfl3 import L3GPTForCausalLM
from hfl3.data.sft import split_indices
from text_corpus import chunk_documents, load_corpus, pack_best_fit, tokenize_documents
from hfl3.models.l3gpt.allocation import lzw_allocation
from hfl3.optim import MuonAdamW, create_muon_optimizer, param_groups_by_kind
from hfl3.tokenization import token_bytes, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from common import ModelShape, find_asset  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default=None, help="folder with tinyshakespeare.txt and gutenberg/ (default: the "
                        "assets', see benchmarks/common.py)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (steadier timings on a shared box)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--l3_n_emb", type=int, default=16384)
    parser.add_argument("--val_rows", type=int, default=96)
    parser.add_argument("--adamw_lrs", default="1e-3,3e-3,1e-2")
    parser.add_argument("--muon_lrs", default="0.01,0.02,0.04")
    parser.add_argument(
        "--grouped_adamw_lrs",
        default="",
        help="also run AdamW with MuonAdamW's groups and LRs but AdamW on the matrices too, at these matrix LRs: "
        "isolates what the orthogonalisation itself brings",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", default=str(REPO_ROOT / "benchmarks" / "results" / "muon_vs_adamw.png"))
    return parser.parse_args(argv)


def build_data(args):
    """Packed train rows, validation rows and token byte lengths from Tiny Shakespeare + the Gutenberg novels."""
    text = Path(args.text) if args.text else find_asset("text/tinyshakespeare.txt").parent
    corpus, _ = load_corpus(f"{text / 'tinyshakespeare.txt'},{text / 'gutenberg'}")
    train_docs, val_docs = (corpus.select(i) for i in split_indices(len(corpus), val_split=0.1, seed=args.seed))
    # pieces of ~3 characters per token of context, so that packing seldom has to crop a document
    train_docs, val_docs = chunk_documents(train_docs, 3 * args.seq_len), chunk_documents(val_docs, 3 * args.seq_len)
    tokenizer = train_tokenizer(iter(train_docs["text"]), vocab_size=args.vocab_size)
    train_rows, _ = pack_best_fit(tokenize_documents(train_docs, tokenizer), args.seq_len)
    val_rows, _ = pack_best_fit(tokenize_documents(val_docs, tokenizer), args.seq_len)
    if len(val_rows) < args.val_rows or len(train_rows) < args.steps * args.batch_size:
        raise ValueError(
            f"corpus too small: {len(train_rows)} train rows (need {args.steps * args.batch_size}), "
            f"{len(val_rows)} val rows (need {args.val_rows}); lower --steps/--batch_size/--val_rows"
        )
    train_rows = train_rows.map(lambda batch: {"labels": batch["input_ids"]}, batched=True)
    val_ids = torch.tensor(val_rows["input_ids"][: args.val_rows])
    return tokenizer, train_rows, val_ids


def build_model(args, tokenizer, train_rows) -> L3GPTForCausalLM:
    torch.manual_seed(args.seed)
    config = ModelShape.of(args, vocab_size=len(tokenizer), head_dim=64).config(
        window_pattern="L", l3_after_layers=[args.depth // 2 - 1 if args.depth > 1 else 0], l3_n_emb=args.l3_n_emb,
        l3_k_max=32, l3_d_up=64 * args.depth, l3_tie_kv=True,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = L3GPTForCausalLM(config)
    sample = train_rows.select(range(min(2000, len(train_rows))))["input_ids"]
    model.set_l3_allocation(lzw_allocation(sample, config.vocab_size, config.l3_n_emb, config.l3_k_max))
    return model


@torch.no_grad()
def validation_bpb(model, val_ids: torch.Tensor, bytes_per_token: torch.Tensor, batch_size: int) -> float:
    """Bits per UTF-8 byte of the validation targets (0-byte targets such as BOS excluded)."""
    was_training = model.training
    model.eval()
    nats, num_bytes = 0.0, 0
    for rows in val_ids.split(batch_size):
        logits = model(input_ids=rows).logits[:, :-1].float()  # (B, T-1, V)
        targets = rows[:, 1:]
        target_bytes = bytes_per_token[targets]
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        nats += losses[target_bytes.flatten() > 0].sum().item()
        num_bytes += target_bytes.sum().item()
    model.train(was_training)
    return nats / (math.log(2) * num_bytes)


class Probe(TrainerCallback):
    """Times each training step and its optimizer step (after `skip` warm-up steps), evaluates val bpb."""

    def __init__(self, model, val_ids, bytes_per_token, eval_every: int, batch_size: int, skip: int = 5):
        self.model, self.val_ids, self.bytes_per_token = model, val_ids, bytes_per_token
        self.eval_every, self.batch_size, self.skip = eval_every, batch_size, skip
        self.curve: list[tuple[int, float]] = []
        self.step_seconds, self.optimizer_seconds = 0.0, 0.0
        self.timed_steps = 0

    def _evaluate(self, step: int) -> None:
        self.curve.append((step, validation_bpb(self.model, self.val_ids, self.bytes_per_token, self.batch_size)))

    def on_train_begin(self, args, state, control, **kwargs):
        self._evaluate(0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_end = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.skip:
            self.step_seconds += time.perf_counter() - self._step_start
            self.optimizer_seconds += self._optimizer_end - self._optimizer_start
            self.timed_steps += 1
        if state.global_step % self.eval_every == 0 or state.global_step == state.max_steps:
            self._evaluate(state.global_step)


def train_one(args, optimizer_name: str, lr: float, tokenizer, train_rows, val_ids, bytes_per_token) -> dict:
    model = build_model(args, tokenizer, train_rows)
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no",
            logging_strategy="no", max_steps=args.steps, per_device_train_batch_size=args.batch_size, seed=args.seed,
            learning_rate=lr, lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup_steps,
            weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
            adam_beta1=0.9 if optimizer_name == "adamw" else 0.8, adam_beta2=0.95,
            adam_epsilon=1e-8 if optimizer_name == "adamw" else 1e-10,
        )  # fmt: skip
        optimizers = (None, None)
        if optimizer_name == "muon":
            optimizers = (create_muon_optimizer(model, training_args, args.steps, matrix_lr=lr), None)
        elif optimizer_name == "adamw_grouped":
            groups = param_groups_by_kind(model)
            for group in groups:
                group.update(kind="adamw", betas=(0.8, 0.95), eps=1e-10)
                if group["name"] == "matrix":
                    group["lr"] = lr
            optimizers = (MuonAdamW(groups), None)
        probe = Probe(model, val_ids, bytes_per_token, args.eval_every, args.batch_size)
        trainer = Trainer(
            model=model, args=training_args, train_dataset=train_rows, optimizers=optimizers, callbacks=[probe]
        )
        trainer.remove_callback(PrinterCallback)  # keeps stdout for the table / JSON
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    return {
        "optimizer": optimizer_name,
        "lr": lr,
        "curve": probe.curve,
        "final_bpb": probe.curve[-1][1],
        "step_ms": 1e3 * probe.step_seconds / max(1, probe.timed_steps),
        "optimizer_step_ms": 1e3 * probe.optimizer_seconds / max(1, probe.timed_steps),
        "optimizer_share": probe.optimizer_seconds / max(probe.step_seconds, 1e-9),
        "wall_s": wall,
    }


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First step at which the curve reaches `target`, interpolated linearly between evaluations; None if never."""
    for (step_a, bpb_a), (step_b, bpb_b) in zip(curve, curve[1:]):
        if bpb_b <= target:
            return step_b if bpb_a == bpb_b else step_a + (bpb_a - target) / (bpb_a - bpb_b) * (step_b - step_a)
    return None


def plot(runs: list[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        steps, bpb = zip(*run["curve"][1:])
        style = {"muon": "-", "adamw": "--", "adamw_grouped": ":"}[run["optimizer"]]
        axis.plot(steps, bpb, style, marker="o", markersize=3, label=f"{run['optimizer']} lr={run['lr']:g}")
    axis.axhline(target, color="grey", linewidth=0.8, label=f"best adamw final {target:.3f}")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("validation bpb")
    axis.set_title("Tiny L3GPT: MuonAdamW vs AdamW (same data, steps, schedule)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp.png")
    figure.savefig(partial, dpi=120, bbox_inches="tight")
    os.replace(partial, path)  # atomic: a reader never sees a half-written PNG
    plt.close(figure)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # with --json, stdout carries the JSON only: libraries' chatter (e.g. DeepSpeed's import banner) goes to stderr
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        summary = run_all(args)
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return summary


def run_all(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tokenizer, train_rows, val_ids = build_data(args)
    bytes_per_token = token_bytes(tokenizer)
    arms = {"adamw": args.adamw_lrs, "muon": args.muon_lrs, "adamw_grouped": args.grouped_adamw_lrs}
    runs = []
    for optimizer_name, lrs in arms.items():
        for lr in [float(value) for value in lrs.split(",") if value]:
            run = train_one(args, optimizer_name, lr, tokenizer, train_rows, val_ids, bytes_per_token)
            runs.append(run)
            print(f"  {optimizer_name:13s} lr={lr:<8g} final bpb {run['final_bpb']:.4f}  ({run['wall_s']:.0f} s)")
    best = {
        name: min((r for r in runs if r["optimizer"] == name), key=lambda r: r["final_bpb"])
        for name in arms
        if any(r["optimizer"] == name for r in runs)
    }
    target = best["adamw"]["final_bpb"]
    reach = steps_to_reach(best["muon"]["curve"], target)
    summary = {
        "setup": {**vars(args), "train_tokens_per_step": args.batch_size * args.seq_len},
        "runs": runs,
        "best": {name: {"lr": run["lr"], "final_bpb": run["final_bpb"]} for name, run in best.items()},
        "muon_steps_to_adamw_final": reach,
        "muon_steps_ratio": None if reach is None else reach / args.steps,
    }
    if "adamw_grouped" in best:
        grouped_reach = steps_to_reach(best["muon"]["curve"], best["adamw_grouped"]["final_bpb"])
        summary["muon_steps_to_adamw_grouped_final"] = grouped_reach
    if args.plot:
        plot(runs, target, Path(args.plot))
        summary["plot"] = args.plot
    return summary


def format_table(summary: dict) -> str:
    lines = [
        "| optimizer | lr | final val bpb | step ms | optimizer step ms | optimizer share |",
        "|---|---|---|---|---|---|",
    ]
    for run in summary["runs"]:
        lines.append(
            f"| {run['optimizer']} | {run['lr']:g} | {run['final_bpb']:.4f} | {run['step_ms']:.0f} | "
            f"{run['optimizer_step_ms']:.1f} | {100 * run['optimizer_share']:.1f}% |"
        )
    reach, ratio, best = summary["muon_steps_to_adamw_final"], summary["muon_steps_ratio"], summary["best"]
    lines.append("")
    lines.extend(f"best {name} (lr {run['lr']:g}): final bpb {run['final_bpb']:.4f}" for name, run in best.items())
    steps = summary["setup"]["steps"]
    lines.append(
        f"Muon reaches the best AdamW final bpb at step {reach:.0f} of {steps} ({ratio:.2f}x, goal <= 0.7x)"
        if reach is not None
        else "Muon never reaches the best AdamW final bpb"
    )
    if "muon_steps_to_adamw_grouped_final" in summary:
        grouped = summary["muon_steps_to_adamw_grouped_final"]
        lines.append(
            f"Muon reaches the best grouped-AdamW final bpb at step {grouped:.0f} of {steps} ({grouped / steps:.2f}x)"
            if grouped is not None
            else "Muon never reaches the best grouped-AdamW final bpb"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
