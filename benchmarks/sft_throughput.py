"""LoRA SFT throughput: hfl3's recipe vs plain TRL `SFTTrainer` + PEFT, same model, data, batch size and steps.

```bash
python benchmarks/sft_throughput.py                       # GSM8K chats, tiny Qwen3 with the real Qwen3 tokenizer
python benchmarks/sft_throughput.py --max_steps 40 --json benchmarks/results/sft_throughput_cpu.json
python benchmarks/sft_throughput.py --save_model outputs/tiny_qwen3   # only write the model (for sft_gsm8k.yaml)
```

Rows (each in a fresh process, so peak memory is its own):
- `trl_default`: `SFTTrainer` on the conversational records with `SFTConfig` defaults (activation checkpointing on,
  bf16 on, no packing, loss on every token: TRL cannot mask the stock Qwen3 template) and `LoraConfig` q/v r=16;
  on a CPU `use_cpu=True` is added, without which the default bf16 refuses to start.
- `trl_matched`: the same with the recipe's precision and checkpointing (bf16 on a bf16 CUDA GPU, else fp32; no
  activation checkpointing).
- `trl_liger`: `trl_matched` with `use_liger_kernel=True` (Liger's fused linear cross-entropy and kernels for the
  model; needs liger-kernel and a CUDA GPU).
- `hfl3`: the recipe's `build_sft_trainer` from `recipes/configs/sft_gsm8k.yaml` (assistant-only masks; off GPU the loss is
  a chunked linear + cross-entropy over the supervised positions, `add_supervised_nll`).
- `hfl3_packed`: the same with `--packing` (TRL's best-fit decreasing, padding-free).

Measured over the steps after `--timing_warmup`: `tokens/s` counts non-padding tokens through the model (TRL's
`num_tokens`, the same counter in both trainers), `supervised/s` the tokens that carry loss; peak memory is the
process's max RSS on CPU, `torch.cuda.max_memory_allocated` on a GPU. Ratios are against `--reference` (default
`trl_default`). On a
shared machine use `--repeats 2` or more: the rows then run in turn and each keeps its fastest run. There, also
compare `tokens/CPU s` (non-padding tokens per second of the process's CPU time) under `OMP_NUM_THREADS=1`: with one
thread it hardly moves with the other jobs' load, where wall-clock tokens/s moved 3× between two identical runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import find_asset, in_fresh_process, shown_path, write_result  # noqa: E402

ROWS = ("trl_default", "trl_matched", "trl_liger", "hfl3", "hfl3_packed")


def save_tiny_qwen3(folder: Path, hidden: int, layers: int, heads: int = 4) -> Path:
    """A randomly initialised Qwen3 (tied embeddings, GQA with `heads` query and `heads / 2` key/value heads of
    width `hidden / heads`) with the real Qwen3 tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(find_asset("tokenizers/qwen3"))
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=hidden // heads,
        max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Timer:
    """TrainerCallback recording (wall time, process CPU time, non-padding tokens so far) at every training log
    (`logging_steps=1`: every optimizer step), the tokens as TRL's `SFTTrainer` and hfl3's trainer both log them
    (`num_tokens`)."""

    def __init__(self):
        from transformers import TrainerCallback

        self.marks: list[tuple[float, float, int]] = []
        timer = self

        class _Callback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    timer.marks.append((time.perf_counter(), time.process_time(), logs["num_tokens"]))

        self.callback = _Callback()


def supervised_fraction(dataset) -> float:
    """Share of a prepared dataset's tokens whose next-token label counts (labels shifted by one)."""
    supervised = total = 0
    for labels in dataset["labels"]:
        supervised += sum(label != -100 for label in labels[1:])
        total += len(labels)
    return supervised / total


def worker(row: str, args) -> dict:
    """Train `row` in this process (call it in a fresh one: the peak memory is the process's own)."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hfl3.data.chat import read_chat_jsonl

    records = read_chat_jsonl(args.data)[: args.n_train]
    subset = Path(args.work) / "train.jsonl"
    common = dict(
        output_dir=str(Path(args.work) / row), per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
        max_length=args.max_length, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=0, dataloader_num_workers=0,
    )
    if row.startswith("trl"):
        from datasets import Dataset

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        # SFTConfig's default bf16=True refuses to start on a CPU unless use_cpu is set (then: CPU bf16 autocast)
        extra = {"use_cpu": not torch.cuda.is_available()}
        if row in ("trl_matched", "trl_liger"):  # the recipe's defaults (hfl3.trainers.sft.config.ChatSFTConfig)
            extra.update(bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                         gradient_checkpointing=False, use_liger_kernel=row == "trl_liger")
        trainer = SFTTrainer(
            model=model, args=SFTConfig(**common, **extra), processing_class=tokenizer,
            train_dataset=Dataset.from_list([{"messages": list(r.messages)} for r in records]),
            peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                                   task_type="CAUSAL_LM"),
        )
    else:
        sys.path.insert(0, str(REPO / "recipes"))
        from sft_lora import make_parser

        from hfl3.trainers.cli.setup import set_up_sft
        from hfl3.trainers.sft.builder import build_sft_trainer

        with open(subset, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"messages": list(r.messages)}) + "\n" for r in records)
        cli = ["--config", str(REPO / "recipes" / "configs" / "sft_gsm8k.yaml"), "--model_name_or_path", args.model,
               "--train_file", str(subset), "--eval_file", "", "--eval_strategy", "no",
               "--lr_scheduler_type", "linear", "--warmup_steps", "0"]
        cli += [f"--{key}={value}" for key, value in common.items()] + (["--packing"] if row == "hfl3_packed" else [])
        parser = make_parser()
        script_args, training_args, model_args = parser.parse_args_and_config(cli)
        setup = set_up_sft(script_args, training_args, model_args, parser.given_arguments(cli))
        trainer = build_sft_trainer(script_args, training_args, model_args, setup).trainer
    timer = Timer()
    trainer.add_callback(timer.callback)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    (t0, c0, n0), (t1, c1, n1) = timer.marks[args.timing_warmup - 1], timer.marks[-1]
    fraction = supervised_fraction(trainer.train_dataset)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {
        "row": row, "timed_steps": len(timer.marks) - args.timing_warmup, "seconds": t1 - t0,
        "tokens_per_s": (n1 - n0) / (t1 - t0), "supervised_per_s": fraction * (n1 - n0) / (t1 - t0),
        "tokens_per_cpu_s": (n1 - n0) / (c1 - c0),
        "s_per_step": (t1 - t0) / (len(timer.marks) - args.timing_warmup), "peak_mib": peak / 2**20,
        "train_rows": len(trainer.train_dataset), "supervised_fraction": fraction,
        "device": "cuda" if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="chat JSONL (default: the GSM8K train split of the assets)")
    parser.add_argument("--model", default=None, help="model folder (default: a tiny Qwen3 built in --work)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="attention heads (key/value heads: half)")
    parser.add_argument("--n_train", type=int, default=1024, help="first N records of --data")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--max_steps", type=int, default=25)
    parser.add_argument("--timing_warmup", type=int, default=3, help="steps left out of the timing (>= 1)")
    parser.add_argument("--rows", default="trl_default,trl_matched,hfl3,hfl3_packed", help=f"some of {ROWS}")
    parser.add_argument("--reference", default="trl_default", help="the row the ratios are against")
    parser.add_argument("--repeats", type=int, default=1, help="run the rows this many times in turn; keep the best")
    parser.add_argument("--work", default=str(REPO / "outputs" / "bench_sft"))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--save_model", default=None, help="only write the tiny Qwen3 to this folder and exit")
    args = parser.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; choose from {','.join(ROWS)}")
    if not 1 <= args.timing_warmup < args.max_steps:
        parser.error(f"--timing_warmup {args.timing_warmup} must be >= 1 and below --max_steps {args.max_steps}")
    if "trl_liger" in args.rows.split(",") and importlib.util.find_spec("liger_kernel") is None:
        parser.error("--rows trl_liger needs liger-kernel (pip install liger-kernel; its kernels need a CUDA GPU)")
    if args.data is None:
        args.data = str(find_asset("chat/gsm8k_messages_train.jsonl"))
    return args


def run(args: argparse.Namespace) -> dict:
    """Each row of `args.rows` in a fresh process, `args.repeats` times in turn (the best run kept); prints the table
    and returns (with `--json` also writes) `{"args", "versions", "reference", "results"}`."""
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = str(save_tiny_qwen3(Path(args.work) / "tiny_qwen3", args.hidden, args.layers, args.heads))
    best: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for row in args.rows.split(","):
            started = time.perf_counter()
            result = in_fresh_process(worker, row, args)
            print(f"run {repeat + 1}/{args.repeats} {row}: {result['tokens_per_s']:.0f} tokens/s "
                  f"({time.perf_counter() - started:.0f} s with start-up)", flush=True)
            if row not in best or result["tokens_per_s"] > best[row]["tokens_per_s"]:
                best[row] = result
    results = list(best.values())

    reference = best.get(args.reference, results[0])
    print(f"\n{args.n_train} GSM8K chats, batch {args.batch_size}, max_length {args.max_length}, "
          f"{args.max_steps} steps ({args.timing_warmup} warm-up), {results[0]['device']}; ratios against "
          f"{reference['row']}")
    header = (f"{'row':<12} {'tokens/s':>9} {'ratio':>6} {'supervised/s':>12} {'ratio':>6} {'tokens/CPU s':>12} "
              f"{'ratio':>6} {'s/step':>7} {'peak MiB':>9} {'ratio':>6}")
    print(header + "\n" + "-" * len(header))
    for r in results:
        print(f"{r['row']:<12} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / reference['tokens_per_s']:>6.2f} "
              f"{r['supervised_per_s']:>12.0f} {r['supervised_per_s'] / reference['supervised_per_s']:>6.2f} "
              f"{r['tokens_per_cpu_s']:>12.0f} {r['tokens_per_cpu_s'] / reference['tokens_per_cpu_s']:>6.2f} "
              f"{r['s_per_step']:>7.2f} {r['peak_mib']:>9.0f} {r['peak_mib'] / reference['peak_mib']:>6.2f}")
    from hfl3.provenance import package_versions

    # Paths relative to the repository: no absolute local path in a committed result
    recorded = {key: shown_path(value) if isinstance(value, str) and os.path.isabs(value) else value
                for key, value in vars(args).items()}
    return write_result(args.json, {"args": recorded, "versions": package_versions(), "reference": reference["row"],
                                    "results": results})


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.save_model:
        print(f"wrote {save_tiny_qwen3(Path(parsed.save_model), parsed.hidden, parsed.layers, parsed.heads)}")
    else:
        run(parsed)
