"""hfl3's pretraining step beside nanochat's own, at the same shape, on one GPU, in one run.

Arms (each in a fresh subprocess, so compile caches and peak memory are its own):
- `nanochat`: nanochat's GPT and its MuonAdamW from a checkout you provide (`--nanochat_dir`; not vendored), driven
  as in its scripts/base_train.py: model built on the meta device, `init_weights()`, `torch.compile(model,
  dynamic=False)`, `setup_optimizer()`, then `loss = model(x, y); loss.backward(); optimizer.step();
  model.zero_grad(set_to_none=True)`. Its attention is FA3 when its loader can fetch the kernel from the Hub, else
  its SDPA fallback (the case on an offline machine; the arm reports which).
- `hfl3`: hfl3's real path: `L3GPTTrainer` (HF Trainer) with `MuonAdamW`, the recipe's `PackedCollator`,
  `ThroughputCallback` and `LossPlotCallback`, bf16 on CUDA, `torch_compile` as asked.
- `hfl3_l3`: the same with one L3 layer after layer `depth // 2 - 1` (LZW allocation of the token stream).

Same shape for all: `depth` layers, hidden = depth × 64 rounded up to a multiple of `head_dim`, rows of `seq_len`
tokens, `batch_size` rows per step, vocabulary `vocab_size`, window pattern `window_pattern`, rows attending across
documents (nanochat does: no document mask). Token ids are random, drawn from a Zipf law (rank r ∝ 1/r) so that L3
routes frequent ids to big tables as real text does; nanochat reads `(x, y) = (row[:-1], row[1:])`.

Timing: steps `warmup_steps + 1 … warmup_steps + steps` as one window, CUDA synchronised at both ends (compilation
happens in the warm-up). tok/s = window tokens / window seconds. MFU = tok/s × FLOPs/token / peak bf16 FLOP/s
(`hfl3.callbacks.PEAK_BF16_FLOPS`; H100 SXM 989e12); FLOPs/token from `hfl3.callbacks.flops_per_token` for hfl3 (plus
the L3 lookups) and from nanochat's own `estimate_flops()` for nanochat (both 6 × matmul params + 12·L·H·Q·T, PaLM
appendix B). Peak memory: `torch.cuda.max_memory_allocated()` over the whole arm (build, warm-up and window).

    python benchmarks/vs_nanochat.py --nanochat_dir build/nanochat --json benchmarks/results/vs_nanochat_h100.json
    python benchmarks/vs_nanochat.py --arms hfl3 --compile false       # hfl3 alone, eager
    python benchmarks/vs_nanochat.py                                   # no GPU: tiny shape on CPU, fp32, hfl3 only

Get nanochat with `git clone https://github.com/karpathy/nanochat build/nanochat` (`build/` is git-ignored). Goals
(issue 12): hfl3 dense ≥ 1.1× nanochat's tok/s (≥ 44 % MFU) with peak memory ≤ 1.1× nanochat's; hfl3 with L3 ≥
0.9× hfl3 dense.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import HfArgumentParser, TrainerCallback

ARMS = ("nanochat", "hfl3", "hfl3_l3")
# Sizes when a field is left unset: nanochat's d12 on a GPU, a seconds-long model on CPU.
GPU_SIZES = dict(depth=12, seq_len=2048, batch_size=16, vocab_size=32768, head_dim=128, steps=20, warmup_steps=10)
CPU_SIZES = dict(depth=2, seq_len=128, batch_size=4, vocab_size=2048, head_dim=64, steps=5, warmup_steps=2)
BOS = 0


@dataclass
class VsNanochatArguments:
    nanochat_dir: str | None = field(default=None, metadata={"help": "a nanochat checkout; without it, hfl3 alone"})
    arms: list[str] = field(default_factory=lambda: list(ARMS), metadata={"help": f"any of {ARMS}"})
    depth: int | None = field(default=None, metadata={"help": "decoder layers (default 12 on CUDA, 2 on CPU)"})
    seq_len: int | None = field(default=None, metadata={"help": "row length (default 2048 on CUDA, 128 on CPU)"})
    batch_size: int | None = field(default=None, metadata={"help": "rows per step (default 16 on CUDA, 4 on CPU)"})
    vocab_size: int | None = field(default=None, metadata={"help": "vocabulary (default 32768 on CUDA, 2048 CPU)"})
    head_dim: int | None = field(default=None, metadata={"help": "head width (default 128 on CUDA, 64 on CPU)"})
    window_pattern: str = field(default="L", metadata={"help": "S/L pattern, as nanochat's --window_pattern"})
    compile: bool | None = field(default=None, metadata={"help": "torch.compile every arm (default: on CUDA)"})
    l3_k_max: int = field(default=64, metadata={"help": "most L3 rows per token (hfl3_l3)"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "hfl3's attention: sdpa, flash_attention_2"})
    steps: int | None = field(default=None, metadata={"help": "timed steps (default 20 on CUDA, 5 on CPU)"})
    warmup_steps: int | None = field(default=None, metadata={"help": "untimed steps first (compilation)"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})
    arm: str | None = field(default=None, metadata={"help": "internal: run one arm in this process"})
    result_file: str | None = field(default=None, metadata={"help": "internal: where the one arm writes"})

    def __post_init__(self):
        for name, default in (GPU_SIZES if torch.cuda.is_available() else CPU_SIZES).items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.compile is None:
            self.compile = torch.cuda.is_available()
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"--arms: unknown {sorted(unknown)}; expected some of {ARMS}")
        if "nanochat" in self.arms and not self.nanochat_dir:
            self.arms = [arm for arm in self.arms if arm != "nanochat"]
        if self.nanochat_dir and not (Path(self.nanochat_dir) / "nanochat" / "gpt.py").is_file():
            raise ValueError(f"--nanochat_dir {self.nanochat_dir}: no nanochat/gpt.py there; clone "
                             "https://github.com/karpathy/nanochat into it")

    @property
    def hidden_size(self) -> int:
        """nanochat's sizing: depth × 64 rounded up to a multiple of head_dim (scripts/base_train.py)."""
        return -(-self.depth * 64 // self.head_dim) * self.head_dim


def zipf_rows(args: VsNanochatArguments, rows: int, length: int, seed: int = 0) -> np.ndarray:
    """`(rows, length)` token ids, BOS first, the rest Zipf-distributed over the other ids."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, args.vocab_size)
    ids = rng.choice(ranks, size=(rows, length), p=(1 / ranks) / (1 / ranks).sum())
    ids[:, 0] = BOS
    return ids


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Window:
    """Seconds between the end of step `first` and the end of step `last` (CUDA synchronised at both ends)."""

    def __init__(self, first: int, last: int):
        self.first, self.last, self.start, self.seconds = first, last, None, None

    def tick(self, step: int) -> None:
        if step == self.first:
            synchronize()
            self.start = time.perf_counter()
        elif step == self.last:
            synchronize()
            self.seconds = time.perf_counter() - self.start


class WindowCallback(TrainerCallback):
    def __init__(self, window: Window):
        self.window = window

    def on_step_end(self, args, state, control, **kwargs):
        self.window.tick(state.global_step)


def run_hfl3(args: VsNanochatArguments, with_l3: bool, output_dir: str) -> dict:
    """hfl3's path: `L3GPTTrainer` + `MuonAdamW` + the recipe's collator and callbacks."""
    import datasets

    from hfl3 import L3GPTConfig, L3GPTForCausalLM
    from hfl3.callbacks import LossPlotCallback, ThroughputCallback, flops_per_token, l3_lookup_flops_per_token
    from hfl3.models.l3gpt import lzw_allocation
    from hfl3.trainers.pretrain import L3GPTTrainer, PackedCollator, PretrainConfig

    total = args.warmup_steps + args.steps
    rows = zipf_rows(args, total * args.batch_size, args.seq_len)
    config = L3GPTConfig.from_depth(
        args.depth, vocab_size=args.vocab_size, head_dim=args.head_dim, max_position_embeddings=args.seq_len,
        window_pattern=args.window_pattern, bos_token_id=BOS, attn_implementation=args.attn_implementation,
        l3_after_layers=[max(0, args.depth // 2 - 1)] if with_l3 else [], l3_k_max=args.l3_k_max,
    )
    model = L3GPTForCausalLM(config)
    fpt = flops_per_token(config, args.seq_len)
    if with_l3:
        allocation = lzw_allocation(rows[: max(1, 200_000 // args.seq_len)].tolist(), config.vocab_size,
                                    config.l3_n_emb, config.l3_k_max)
        model.set_l3_allocation(allocation)
        fpt += l3_lookup_flops_per_token(config, float(allocation.numpy()[rows].mean()))
    window = Window(args.warmup_steps, total)
    cuda = torch.cuda.is_available()
    training_args = PretrainConfig(
        output_dir=output_dir, max_steps=total, per_device_train_batch_size=args.batch_size, optim="muon",
        bf16=cuda, torch_compile=args.compile, warmup_steps=2, eval_strategy="no", report_to="none",
        logging_steps=args.steps, disable_tqdm=True, dataloader_num_workers=2 if cuda else 0,
        attend_across_documents=True, save_strategy="no",
    )
    trainer = L3GPTTrainer(
        model=model, args=training_args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
        data_collator=PackedCollator(BOS, attend_across_documents=True),
        callbacks=[WindowCallback(window), ThroughputCallback(fpt, warmup_steps=args.warmup_steps),
                   LossPlotCallback(("loss",))],
    )
    trainer.train()
    tables = sum(p.numel() for n, p in model.named_parameters() if "_table" in n)
    return dict(flops_per_token=fpt, seconds=window.seconds, attention=args.attn_implementation,
                dense_parameters=model.num_parameters() - tables, table_parameters=tables)


def run_nanochat(args: VsNanochatArguments) -> dict:
    """nanochat's GPT + MuonAdamW, the loop of its scripts/base_train.py (no gradient accumulation)."""
    sys.path.insert(0, str(Path(args.nanochat_dir).resolve()))
    from nanochat import flash_attention
    from nanochat.gpt import GPT, GPTConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = GPTConfig(sequence_len=args.seq_len, vocab_size=args.vocab_size, n_layer=args.depth,
                       n_head=args.hidden_size // args.head_dim, n_kv_head=args.hidden_size // args.head_dim,
                       n_embd=args.hidden_size, window_pattern=args.window_pattern)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    fpt = model.estimate_flops()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = model.setup_optimizer()
    if args.compile:
        model = torch.compile(model, dynamic=False)
    total = args.warmup_steps + args.steps
    rows = torch.from_numpy(zipf_rows(args, total * args.batch_size, args.seq_len + 1)).to(device)
    window = Window(args.warmup_steps, total)
    for step in range(total):
        batch = rows[step * args.batch_size : (step + 1) * args.batch_size]
        loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        window.tick(step + 1)
    return dict(flops_per_token=fpt, seconds=window.seconds, dense_parameters=parameters, table_parameters=0,
                attention="fa3" if flash_attention.USE_FA3 else "sdpa (nanochat's fallback)")


def run_arm(args: VsNanochatArguments) -> None:
    """Measure `args.arm` in this process and write its result to `args.result_file`."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as scratch:
        result = run_nanochat(args) if args.arm == "nanochat" else run_hfl3(args, args.arm == "hfl3_l3", scratch)
    from hfl3.callbacks import peak_flops_per_second

    peak = peak_flops_per_second()
    result["tok_per_sec"] = args.steps * args.batch_size * args.seq_len / result["seconds"]
    result["mfu"] = 100 * result["tok_per_sec"] * result["flops_per_token"] / peak if peak else None
    result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    Path(args.result_file).write_text(json.dumps(dict(arm=args.arm, **result)))


def main(args: VsNanochatArguments) -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for arm in args.arms:
            result_file = Path(scratch) / f"{arm}.json"
            fields = {k: v for k, v in asdict(args).items() if v is not None and k not in ("arms", "json")}
            command = [sys.executable, __file__, "--arm", arm, "--result_file", str(result_file)]
            for key, value in fields.items():
                command += [f"--{key}", str(value)]
            started = time.perf_counter()
            subprocess.run(command, check=True)
            results.append(json.loads(result_file.read_text()) | {"wall_seconds": time.perf_counter() - started})
            print(f"{arm}: {results[-1]['tok_per_sec']:.0f} tok/s", flush=True)
    by_arm = {r["arm"]: r for r in results}
    reference = by_arm.get("nanochat") or by_arm.get("hfl3") or results[0]
    print(f"\nPretraining step on {device}: depth {args.depth}, hidden {args.hidden_size}, batch {args.batch_size}×"
          f"{args.seq_len}, vocab {args.vocab_size}, window {args.window_pattern}, compile {args.compile}, "
          f"{args.steps} timed steps after {args.warmup_steps}; ratios against {reference['arm']}")
    print(f"{'arm':<10}{'attention':<28}{'GFLOP/tok':>10}{'ms/step':>9}{'tok/s':>10}{'MFU %':>7}{'peak GB':>8}"
          f"{'tok/s ×':>9}{'memory ×':>9}")
    for r in results:
        memory_ratio = (f"{r['peak_memory_gb'] / reference['peak_memory_gb']:.3f}"
                        if r["peak_memory_gb"] and reference["peak_memory_gb"] else "n/a")
        print(f"{r['arm']:<10}{r['attention']:<28}{r['flops_per_token'] / 1e9:>10.3f}"
              f"{1e3 * r['seconds'] / args.steps:>9.1f}{r['tok_per_sec']:>10.0f}"
              f"{r['mfu'] if r['mfu'] is None else round(r['mfu'], 1)!s:>7}"
              f"{r['peak_memory_gb'] if r['peak_memory_gb'] is None else round(r['peak_memory_gb'], 1)!s:>8}"
              f"{r['tok_per_sec'] / reference['tok_per_sec']:>9.3f}{memory_ratio:>9}")
    if "hfl3" in by_arm and "hfl3_l3" in by_arm:
        print(f"hfl3 with L3 / hfl3 dense: {by_arm['hfl3_l3']['tok_per_sec'] / by_arm['hfl3']['tok_per_sec']:.3f}× "
              "tok/s (goal ≥ 0.9)")
    output = {"args": asdict(args), "device": device, "torch": torch.__version__, "reference": reference["arm"],
              "results": results}
    if args.json:
        from hfl3.provenance import write_json_atomic

        write_json_atomic(Path(args.json), output)
    return output


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parsed = HfArgumentParser(VsNanochatArguments).parse_args_into_dataclasses()[0]
    run_arm(parsed) if parsed.arm else main(parsed)
