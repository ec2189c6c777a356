"""Does L3 pay off? A dense L3GPT vs the same with L3 layers vs a dense model widened to the L3 model's FLOPs; and
does nanochat master's dense core (value embeddings, smear, backout) pay off against the one without them?

Four arms, trained through hfl3's product path (`PretrainTrainer`, `PackedCollator`, `BitsPerByte`) on the Gutenberg
novels of the assets' text/gutenberg folder (see benchmarks/common.py), validated on one held-out novel, each for
every seed, arms interleaved (seed 0: a, b, c; seed 1: a, b, c) so that load drift on a shared machine hits all arms
alike:

- `dense_legacy` the dense L3GPT without nanochat master's features (`LEGACY_FIELD_VALUES`: the core without
  those features, what a config.json written before them loads as);
- `dense`      (a) the dense L3GPT from `L3GPTConfig.from_depth(depth, ...)` (value embeddings, smear, backout on);
- `l3`         (b) the same with L3 layers after `l3_after_layers` (LZW allocation from the training tokens);
- `dense_wide` (c) dense, `hidden_size` widened (heads kept, `head_dim = hidden_size / heads`) until its training
  FLOPs/token are the closest to (b)'s.

All arms of a seed see the same batches in the same order (`data_seed = seed`) and the same validation rows. Every
`eval_steps` steps the validation bpb is recorded with the cumulative training FLOPs and the training seconds so
far (wall-clock and process CPU time, evaluation excluded). The LR schedule defaults to constant after warmup, so
every point of a curve is an "anytime" result and interpolating a curve at a common FLOPs or time budget does not
catch one arm mid-warmdown.

FLOPs per token, what is counted: `configuration_l3gpt.flops_per_token` (6 × matmul parameters incl. the L3 up/mix
projections + 12·L·H·Q·T attention; embeddings and L3 tables excluded as lookups) plus, for each L3 layer, the
lookup's own multiply-adds: scores `K_t x` (2·d_t·C) and the weighted sum `V_tᵀ p` (2·d_t·C) forward, ×3 for
forward + backward, i.e. `12·d̄·C`, with d̄ the mean number of rows routed per training token under the allocation
(frequent tokens own more rows, so d̄ is measured on the training tokens, not the table average). Softmax,
normalisations and gathers are not counted (nanochat counts no elementwise work either).

Reported: val bpb at equal steps (final), at equal FLOPs (every curve interpolated at the smallest final FLOPs of
all runs) and at equal wall-clock (at the smallest final training time; also at equal process CPU time, which a
shared machine disturbs less); tok/s; peak memory, from a separate `memory_steps`-step run per arm in a fresh
process (CUDA max allocated, or on CPU the growth of peak RSS with glibc's mmap threshold fixed, see `main`);
parameters split into dense and lookup tables (L3 tables and value embeddings: rows gathered by token id).

    OMP_NUM_THREADS=1 python benchmarks/l3_vs_dense.py --max_steps 300 \
        --json benchmarks/results/l3_vs_dense_cpu_300steps.json \
        --plot benchmarks/results/l3_vs_dense_cpu_300steps.png     # ~25 min on a shared 2-core CPU
    python benchmarks/l3_vs_dense.py --max_steps 20 --eval_steps 10 --seeds 0   # plumbing check, ~2 min
"""

import copy
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import HfArgumentParser, TrainerCallback, set_seed

from hfl3 import L3GPTConfig
from hfl3.models.l3gpt.configuration_l3gpt import flops_per_token
from l3_flops import l3_lookup_flops_per_token
import text_corpus as text
from hfl3.models.l3gpt import lzw_allocation
from hfl3.models.l3gpt.configuration_l3gpt import LEGACY_FIELD_VALUES
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.pretraining.compute_optimal import parameter_counts
from hfl3.trainers.pretraining.config import PretrainConfig
from hfl3.trainers.pretraining.builder import build_model, build_trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelShape, find_asset, in_fresh_process, shown_path, write_result  # noqa: E402

ARMS = ("dense_legacy", "dense", "l3", "dense_wide")
COMPARISONS = (("l3", "dense"), ("l3", "dense_wide"), ("dense", "dense_legacy"))  # (arm, reference) pairs printed


@dataclass
class BenchmarkArguments:
    text_dir: str | None = field(default=None, metadata={"help": "folder of *.txt novels (default: the assets')"})
    validation_file: str = field(default="pg11_alice_in_wonderland.txt",
                                 metadata={"help": "novel in text_dir held out for validation"})
    vocab_size: int = field(default=2048, metadata={"help": "BPE vocabulary trained on the training novels"})
    seq_len: int = field(default=128, metadata={"help": "packed row length (tokens)"})
    document_max_chars: int = field(default=256, metadata={"help": "novels are cut into pieces of this many chars"})
    depth: int = field(default=2, metadata={"help": "decoder layers of every arm"})
    aspect_ratio: int = field(default=64, metadata={"help": "hidden_size = depth * aspect_ratio (arms a, b)"})
    head_dim: int = field(default=64, metadata={"help": "head width of arms a, b (c keeps the head count)"})
    window_pattern: str = field(default="L", metadata={"help": "S/L sliding-window pattern"})
    l3_after_layers: list[int] = field(default_factory=lambda: [0], metadata={"help": "L3 layers of arm b"})
    l3_n_emb: int | None = field(default=None, metadata={"help": "L3 table rows (default 4 x vocab)"})
    l3_k_max: int = field(default=64, metadata={"help": "most L3 rows per token"})
    l3_d_up: int | None = field(default=None, metadata={"help": "L3 up-projection width (default 4 x hidden)"})
    l3_sample_tokens: int = field(default=500_000, metadata={"help": "training tokens LZW-scanned for L3"})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "init and data-order seeds"})
    arms: list[str] = field(default_factory=lambda: list(ARMS), metadata={"help": f"subset of {', '.join(ARMS)}"})
    max_steps: int = field(default=600, metadata={"help": "optimizer steps per run"})
    batch_size: int = field(default=8, metadata={"help": "rows per step"})
    learning_rate: float = field(default=3e-3, metadata={"help": "AdamW LR (PretrainConfig default)"})
    optim: str = field(default="adamw_torch", metadata={"help": "adamw_torch or muon (PretrainConfig.optim)"})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "see module docstring"})
    warmup_steps: int = field(default=20, metadata={"help": "LR warmup steps"})
    eval_steps: int = field(default=50, metadata={"help": "evaluate every this many steps"})
    max_eval_rows: int = field(default=32, metadata={"help": "validation rows (seq_len tokens each)"})
    memory_steps: int = field(default=5, metadata={"help": "steps of the separate peak-memory run per arm"})
    json: str | None = field(default=None, metadata={"help": "write all results here (JSON)"})
    plot: str | None = field(default=None, metadata={"help": "write val bpb vs FLOPs and vs seconds here (PNG)"})

    def __post_init__(self):
        if self.text_dir is None:
            self.text_dir = str(find_asset("text/gutenberg"))
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"--arms has {sorted(unknown)}; choose from {list(ARMS)}")
        if "dense_wide" in self.arms and not self.l3_after_layers:
            raise ValueError("dense_wide is widened to the L3 arm's FLOPs: set --l3_after_layers")


def prepare_data(args: BenchmarkArguments):
    """Tokenizer trained on the training novels; packed train and validation rows; the LZW allocation sample."""
    folder = Path(args.text_dir)
    novels = sorted(folder.glob("*.txt"))
    held_out = folder / args.validation_file
    if held_out not in novels:
        raise FileNotFoundError(f"--validation_file {held_out} is not one of the {len(novels)} novels in {folder}")
    train_docs, _ = text.load_corpus(",".join(str(p) for p in novels if p != held_out))
    val_docs, _ = text.load_corpus(str(held_out))
    tokenizer = train_tokenizer(train_docs["text"], args.vocab_size)
    packed, sample = {}, []
    for name, docs in (("train", train_docs), ("validation", val_docs)):
        tokens = text.tokenize_documents(text.chunk_documents(docs, args.document_max_chars), tokenizer)
        if name == "train":
            budget = args.l3_sample_tokens
            for ids in tokens["input_ids"]:
                sample.append(ids)
                budget -= len(ids)
                if budget <= 0:
                    break
        packed[name], report = text.pack_best_fit(tokens, args.seq_len)
        print(f"{name}: {report.rows} rows of {args.seq_len} tokens, cropped {100 * report.cropped_share:.2f}%")
    packed["validation"] = packed["validation"].select(range(min(args.max_eval_rows, len(packed["validation"]))))
    return tokenizer, packed, sample


def make_config(
    args: BenchmarkArguments, tokenizer, with_l3: bool, hidden_size: int | None = None, legacy: bool = False
) -> L3GPTConfig:
    """Arm a (`with_l3=False`), b (`with_l3=True`), c (`hidden_size` given: a widened, heads kept), or `legacy`: a
    without nanochat master's features."""
    common = dict(
        max_position_embeddings=args.seq_len, window_pattern=args.window_pattern,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if legacy:
        common.update(copy.deepcopy(LEGACY_FIELD_VALUES))
    if with_l3:
        common.update(l3_after_layers=args.l3_after_layers, l3_n_emb=args.l3_n_emb, l3_k_max=args.l3_k_max,
                      l3_d_up=args.l3_d_up)
    base = ModelShape.of(args, vocab_size=len(tokenizer)).config(**common)
    if hidden_size is None:
        return base
    heads = base.num_attention_heads
    return L3GPTConfig(vocab_size=base.vocab_size, hidden_size=hidden_size, num_hidden_layers=args.depth,
                       num_attention_heads=heads, head_dim=hidden_size // heads, **common)


def widened_hidden_size(args: BenchmarkArguments, tokenizer, target_flops: float) -> int:
    """The `hidden_size` (a multiple of 2·heads, so head_dim stays even) whose dense FLOPs/token are closest to
    `target_flops`."""
    base = make_config(args, tokenizer, with_l3=False)
    step = 2 * base.num_attention_heads
    candidates = range(base.hidden_size, 4 * base.hidden_size + 1, step)
    return min(candidates, key=lambda h: abs(
        flops_per_token(make_config(args, tokenizer, with_l3=False, hidden_size=h), args.seq_len) - target_flops))


class EvalClock(TrainerCallback):
    """Records, at every evaluation, (step, cumulative training FLOPs, training wall seconds, training CPU seconds,
    eval_bpb); evaluation time is excluded from the seconds. An evaluation before `train()` is step 0."""

    def __init__(self, flops_per_step: float):
        self.flops_per_step = flops_per_step
        self.points: list[dict] = []
        self.start = self.last_step_end = None
        self.eval_wall = self.eval_cpu = 0.0

    @staticmethod
    def _now() -> tuple[float, float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter(), time.process_time()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.last_step_end = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        self.last_step_end = self._now()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.start is None:
            self.points.append(dict(step=0, flops=0.0, seconds=0.0, cpu_seconds=0.0, bpb=metrics["eval_bpb"]))
            return
        (wall, cpu), (now_wall, now_cpu) = self.last_step_end, self._now()
        self.points.append(dict(
            step=state.global_step, flops=state.global_step * self.flops_per_step,
            seconds=wall - self.start[0] - self.eval_wall, cpu_seconds=cpu - self.start[1] - self.eval_cpu,
            bpb=metrics["eval_bpb"],
        ))
        self.eval_wall += now_wall - wall
        self.eval_cpu += now_cpu - cpu


class PeakMemory(TrainerCallback):
    """Peak memory growth over a training run (bytes): CUDA `max_memory_allocated`, or on CPU the peak RSS (/proc
    VmHWM, reset at train begin) minus the RSS at train begin (parameters, data and libraries excluded;
    gradients, optimizer state and activations included)."""

    def __init__(self):
        self.base = self.peak_bytes = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # restart the high-water mark
            self.base = _proc_status_bytes("VmRSS:")

    def on_train_end(self, args, state, control, **kwargs):
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _proc_status_bytes("VmHWM:")
        self.peak_bytes = peak - self.base


def _proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status: CPU peak memory needs Linux")


def make_trainer(args, config, allocation, fpt, tokenizer, packed, seed, output_dir, callbacks, **overrides):
    """A fresh model (seeded) and the recipe's `PretrainTrainer` around it (`hfl3.trainers.pretraining.builder`);
    `overrides` go to `PretrainConfig`."""
    set_seed(seed)
    training_args = PretrainConfig(**dict(
        output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, max_length=args.seq_len, learning_rate=args.learning_rate,
        optim=args.optim, lr_scheduler_type=args.lr_scheduler_type, warmup_steps=args.warmup_steps,
        eval_steps=args.eval_steps, logging_steps=args.eval_steps, seed=seed, data_seed=seed, report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    ) | overrides)
    model = build_model(config, training_args, allocation=allocation if config.l3_after_layers else None)
    return build_trainer(model, training_args, packed["train"], fpt, tokenizer=tokenizer,
                         eval_rows=np.asarray(packed["validation"]["input_ids"]), callbacks=callbacks)


def train_arm(args, arm, config, allocation, fpt, tokenizer, packed, seed, output_dir) -> dict:
    """One timed run; returns its curve, throughput and parameter counts."""
    clock = EvalClock(fpt * args.batch_size * args.seq_len)
    trainer = make_trainer(args, config, allocation, fpt, tokenizer, packed, seed, output_dir, [clock])
    trainer.evaluate()
    trainer.train()
    if clock.points[-1]["step"] != args.max_steps:
        trainer.evaluate()
    final = clock.points[-1]
    counts = parameter_counts(trainer.model)
    tables = counts["l3_table"] + counts["value_embedding"]  # lookups, as the dial counts them
    result = dict(
        arm=arm, seed=seed, hidden_size=config.hidden_size, flops_per_token=fpt, points=clock.points,
        dense_parameters=counts["total"] - tables, table_parameters=tables,
        tok_per_sec=args.max_steps * args.batch_size * args.seq_len / final["seconds"],
        tok_per_cpu_sec=args.max_steps * args.batch_size * args.seq_len / final["cpu_seconds"], final_bpb=final["bpb"],
    )
    print(f"{arm:<13} seed {seed}: bpb {final['bpb']:.4f} after {final['step']} steps, {final['seconds']:.0f} s, "
          f"{result['tok_per_sec']:.0f} tok/s", flush=True)
    return result


def peak_training_memory(args, config, allocation, tokenizer, packed, output_dir) -> float:
    """Peak memory growth (bytes) over `memory_steps` training steps, without evaluation (see `PeakMemory`)."""
    peak = PeakMemory()
    trainer = make_trainer(args, config, allocation, None, tokenizer, packed, args.seeds[0], output_dir, [peak],
                           max_steps=args.memory_steps, eval_strategy="no")
    trainer.train()
    return peak.peak_bytes


def at_budget(points: list[dict], key: str, budget: float) -> float:
    """Val bpb of a curve linearly interpolated at `budget` of `key` (flops, seconds or cpu_seconds)."""
    return float(np.interp(budget, [p[key] for p in points], [p["bpb"] for p in points]))


def summarize(runs: list[dict], arms: list[str], memory: dict[str, float]) -> dict:
    """Per-arm means over seeds and the equal-steps / equal-FLOPs / equal-time bpb comparisons."""
    budgets = {key: min(r["points"][-1][key] for r in runs) for key in ("flops", "seconds", "cpu_seconds")}
    table = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        row = {"seeds": [r["seed"] for r in mine], "flops_per_token": mine[0]["flops_per_token"],
               "hidden_size": mine[0]["hidden_size"], "dense_parameters": mine[0]["dense_parameters"],
               "table_parameters": mine[0]["table_parameters"],
               "tok_per_sec": statistics.mean(r["tok_per_sec"] for r in mine),
               "tok_per_cpu_sec": statistics.mean(r["tok_per_cpu_sec"] for r in mine),
               "peak_memory_mb": memory[arm] / 2**20,
               "bpb_equal_steps": [r["final_bpb"] for r in mine]}
        for key in budgets:
            row[f"bpb_equal_{key}"] = [at_budget(r["points"], key, budgets[key]) for r in mine]
        table[arm] = row
    return {"budgets": budgets, "arms": table}


def print_summary(summary: dict, args: BenchmarkArguments) -> None:
    budgets, table = summary["budgets"], summary["arms"]
    mean = lambda values: statistics.mean(values)  # noqa: E731
    spread = lambda values: (max(values) - min(values)) / 2  # noqa: E731
    print(f"\nL3 vs dense: depth {args.depth}, seq {args.seq_len}, batch {args.batch_size}, {args.max_steps} steps, "
          f"seeds {args.seeds}; equal FLOPs = {budgets['flops']:.3g}, equal time = {budgets['seconds']:.0f} s wall "
          f"({budgets['cpu_seconds']:.0f} s CPU)")
    print(f"{'arm':<13}{'hidden':>7}{'dense M':>9}{'table M':>9}{'MFLOP/tok':>10}{'tok/s':>8}{'tok/CPU s':>10}"
          f"{'peak MB':>8}"
          f"{'bpb@steps':>17}{'bpb@FLOPs':>17}{'bpb@wall':>17}{'bpb@CPU s':>17}")
    for arm, row in table.items():
        cells = "".join(f"{mean(row[k]):>10.4f} ±{spread(row[k]):.3f}" for k in
                        ("bpb_equal_steps", "bpb_equal_flops", "bpb_equal_seconds", "bpb_equal_cpu_seconds"))
        print(f"{arm:<13}{row['hidden_size']:>7}{row['dense_parameters'] / 1e6:>9.2f}"
              f"{row['table_parameters'] / 1e6:>9.2f}{row['flops_per_token'] / 1e6:>10.2f}{row['tok_per_sec']:>8.0f}"
              f"{row['tok_per_cpu_sec']:>10.0f}{row['peak_memory_mb']:>8.0f}{cells}")
    for arm, other in COMPARISONS:
        if arm not in table or other not in table:
            continue
        mine, ref = table[arm], table[other]
        print(f"{arm} / {other}: FLOPs/token ×{mine['flops_per_token'] / ref['flops_per_token']:.3f}, "
              f"tok/s ×{mine['tok_per_sec'] / ref['tok_per_sec']:.3f} (per CPU s ×"
              f"{mine['tok_per_cpu_sec'] / ref['tok_per_cpu_sec']:.3f}), "
              f"peak memory ×{mine['peak_memory_mb'] / max(ref['peak_memory_mb'], 1e-9):.2f}; "
              f"Δbpb ({arm} − {other}, per seed) " + ", ".join(
                  f"{k.removeprefix('bpb_equal_')} {[round(a - b, 4) for a, b in zip(mine[k], ref[k])]}"
                  for k in ("bpb_equal_steps", "bpb_equal_flops", "bpb_equal_seconds", "bpb_equal_cpu_seconds")))


def save_plot(runs: list[dict], path: str) -> None:
    """Val bpb vs training FLOPs and vs training wall-clock seconds, one colour per arm, one line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(ARMS, ("tab:gray", "tab:blue", "tab:red", "tab:green")))
    styles = ("-", "--", ":", "-.")
    seeds = sorted({r["seed"] for r in runs})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for run in runs:
        points = [p for p in run["points"] if p["step"] > 0]
        for ax, key in zip(axes, ("flops", "seconds")):
            ax.plot([p[key] for p in points], [p["bpb"] for p in points], color=colours[run["arm"]],
                    linestyle=styles[seeds.index(run["seed"]) % len(styles)],
                    label=f"{run['arm']} s{run['seed']}")
    for ax, label in zip(axes, ("training FLOPs", "training seconds (wall-clock)")):
        ax.set_xlabel(label)
        ax.set_ylabel("val bpb")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=72)
    plt.close(fig)
    os.replace(tmp, path)


def main(args: BenchmarkArguments) -> dict:
    tokenizer, packed, sample = prepare_data(args)
    l3_config = make_config(args, tokenizer, with_l3=True)
    allocation = lzw_allocation(sample, l3_config.vocab_size, l3_config.l3_n_emb, l3_config.l3_k_max)
    train_ids = np.asarray(packed["train"]["input_ids"]).reshape(-1)
    routed_mean_rows = float(allocation.numpy()[train_ids].mean())
    l3_fpt = flops_per_token(l3_config, args.seq_len) + l3_lookup_flops_per_token(l3_config, routed_mean_rows)
    configs = {"dense_legacy": make_config(args, tokenizer, with_l3=False, legacy=True),
               "dense": make_config(args, tokenizer, with_l3=False), "l3": l3_config}
    configs["dense_wide"] = make_config(args, tokenizer, False, widened_hidden_size(args, tokenizer, l3_fpt))
    fpts = {arm: flops_per_token(c, args.seq_len) for arm, c in configs.items()} | {"l3": l3_fpt}
    print(f"L3 allocation: mean {allocation.float().mean():.1f} rows/token, routed mean {routed_mean_rows:.1f} "
          f"(k_max {l3_config.l3_k_max}); FLOPs/token " + ", ".join(f"{a} {f / 1e6:.2f}M" for a, f in fpts.items()))
    runs, memory = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        for arm in args.arms:
            # glibc's dynamic mmap threshold would let freed blocks linger in the heap and make RSS depend on
            # history; a fixed threshold returns every large tensor to the OS when freed, so RSS tracks live bytes.
            memory[arm] = in_fresh_process(peak_training_memory, args, configs[arm], allocation, tokenizer, packed,
                                           scratch, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
        for seed in args.seeds:
            for arm in args.arms:
                runs.append(in_fresh_process(train_arm, args, arm, configs[arm], allocation, fpts[arm], tokenizer,
                                             packed, seed, scratch))
    summary = summarize(runs, args.arms, memory)
    print_summary(summary, args)
    results = {"args": asdict(args) | {"text_dir": shown_path(args.text_dir)}, "routed_mean_rows": routed_mean_rows,
               "train_tokens": int(train_ids.size), "configs": {a: c.to_dict() for a, c in configs.items()},
               "summary": summary, "runs": runs, "peak_memory_bytes": memory, "torch_threads": torch.get_num_threads()}
    write_result(args.json, results)
    if args.plot:
        save_plot(runs, args.plot)
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses()[0])
