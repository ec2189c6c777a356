"""QLoRA vs LoRA: the memory of the base and of a few LoRA SFT steps, base loaded in bfloat16 vs quantized to NF4.

The base has Qwen3-0.6B's shape (hidden 1024, 28 layers, MLP 3072, 16 query and 8 key/value heads of 128, vocabulary
151,936, tied embeddings; `Qwen3Config`, random weights, saved once in bfloat16 under `--work`). Each arm runs in a
fresh process on the path the SFT recipe takes: `hfl3.trainers.sft.base_model.load_base_model` with `--dtype bfloat16`
(`lora`), or with `--load_in_4bit --bnb_4bit_quant_type nf4` too (`qlora_nf4`), then `ChatSFTTrainer` with LoRA r=16
on q/v over GSM8K chats (the real Qwen3 tokenizer), `--max_steps` steps of `--batch_size` rows, each a chat's last
`--max_length` tokens.

    OMP_NUM_THREADS=1 python benchmarks/qlora_memory.py --json benchmarks/results/qlora_memory_cpu.json
    python benchmarks/qlora_memory.py --max_length 512 --batch_size 8 --max_steps 12 --timing_warmup 2   # a GPU

Memory, in bfloat16: the bytes of the quantized layers' weights (every `nn.Linear` of the decoder layers: packed NF4
weights plus their quantization state, as `save_pretrained` stores it, against the same layers' bfloat16 weights) and
of the whole base (parameters, buffers and quantization state; the tied embedding stays bfloat16), on CUDA the memory
allocated after loading (on a CPU the RSS says little here: bfloat16 weights are mapped from the file and count once
touched, 513 MiB of RSS for a 1,137 MiB base), and the time to load (NF4: quantizing included). Goals: quantized
layers ≤ 0.3× their bfloat16 bytes (4 bits and one float32 scale per 64 weights: 0.28×), whole base ≤ 0.5×; reported
either way.

Training, in `--train_dtype` (auto: bfloat16 on CUDA, in the same process; float32 on a CPU, in a process of its own,
the 4-bit compute dtype float32 too): the peak memory over the steps (CUDA `max_memory_allocated`; CPU the peak RSS,
glibc's mmap threshold fixed so that freed tensors leave it) and over the process's life, and the tokens/s after
`--timing_warmup` steps (non-padding tokens, TRL's `num_tokens`). Why float32 on a CPU: without AVX512-BF16 (the
2-core development box) bfloat16 matmuls run 40–250× slower than float32 (32 × 151,936 × 1,024: 248 s vs 1.06 s;
32 × 1,024 × 3,072: 0.88 s vs 0.022 s), so one bfloat16 step of this model takes over ten minutes there.
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import find_asset, in_fresh_process, machine_name, shown_path, write_result  # noqa: E402
from l3_forward import cpu_resident_bytes  # noqa: E402
from sft_throughput import Timer  # noqa: E402

ARMS = ("lora", "qlora_nf4")
GOALS = {"quantized_layer_bytes": 0.3, "base_bytes": 0.5}  # QLoRA / LoRA, at most


@dataclass
class QLoRAArguments:
    hidden_size: int = field(default=1024, metadata={"help": "Qwen3-0.6B: 1024"})
    num_hidden_layers: int = field(default=28, metadata={"help": "Qwen3-0.6B: 28"})
    intermediate_size: int = field(default=3072, metadata={"help": "Qwen3-0.6B: 3072"})
    num_attention_heads: int = field(default=16, metadata={"help": "Qwen3-0.6B: 16 (key/value heads: half)"})
    head_dim: int = field(default=128, metadata={"help": "Qwen3-0.6B: 128"})
    vocab_size: int = field(default=151936, metadata={"help": "Qwen3-0.6B: 151,936 (the tokenizer's 151,669 fit)"})
    batch_size: int = field(default=1, metadata={"help": "rows per step"})
    max_length: int = field(default=32, metadata={"help": "tokens per row at most (short: a CPU steps slowly)"})
    max_steps: int = field(default=4, metadata={"help": "training steps per arm"})
    timing_warmup: int = field(default=1, metadata={"help": "steps left out of tokens/s"})
    n_train: int = field(default=64, metadata={"help": "GSM8K chats trained on"})
    train_dtype: str = field(default="auto", metadata={"help": "dtype of the training steps: auto (bfloat16 on CUDA, "
                                                                "float32 on a CPU), bfloat16 or float32"})
    arms: str = field(default=",".join(ARMS), metadata={"help": f"some of {ARMS}"})
    work: str = field(default=str(REPO / "outputs" / "qlora_memory"), metadata={"help": "the base and the runs"})
    json: str | None = field(default=None, metadata={"help": "write the results as JSON here"})


def save_base(args: QLoRAArguments) -> Path:
    """The random-weight Qwen3 of `args`' shape in bfloat16 with the Qwen3 tokenizer, under `args.work` (kept and
    reused while its config is the same)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(find_asset("tokenizers/qwen3"))
    config = Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_attention_heads // 2, head_dim=args.head_dim, max_position_embeddings=40960,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder = Path(args.work) / f"qwen3_h{args.hidden_size}_l{args.num_hidden_layers}_v{args.vocab_size}"
    saved = folder / "config.json"
    if saved.is_file() and all(json.loads(saved.read_text()).get(key) == value
                               for key, value in config.to_diff_dict().items() if key != "transformers_version"):
        return folder  # whole: it is renamed into place only once written
    staged = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staged, ignore_errors=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16).save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    shutil.rmtree(folder, ignore_errors=True)
    staged.rename(folder)
    return folder


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def module_bytes(module: torch.nn.Module, recurse: bool = True) -> int:
    """Parameters and buffers of `module` (each tensor once), plus a bitsandbytes weight's quantization state as
    `save_pretrained` stores it (scales, quantization map, nested scales)."""
    total = 0
    seen = set()
    for tensor in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor_bytes(tensor)
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            total += sum(tensor_bytes(value) for value in state.as_dict(packed=True).values()
                         if isinstance(value, torch.Tensor))
    return total


def run_arm(arm: str, args: QLoRAArguments, base: str, dtype: str, train: bool) -> dict:
    """One arm in this process (call it in a fresh one: the peaks are its own): the base loaded with `--dtype
    dtype` (NF4 for "qlora_nf4"), its memory, and with `train` the LoRA steps."""
    from transformers import AutoTokenizer
    from trl import get_peft_config

    from hfl3.data.chat import read_chat_jsonl, write_chat_jsonl
    from hfl3.data.sft import load_sft_data
    from hfl3.trainers.sft.base_model import check_quantization_arguments, load_base_model, quantization_metadata
    from hfl3.trainers.sft.trainer import ChatSFTTrainer
    from hfl3.trainers.sft.config import ChatSFTConfig, SFTModelArguments

    cuda = torch.cuda.is_available()
    work = Path(args.work) / f"{arm}_{dtype}"
    quantize = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4") if arm == "qlora_nf4" else {}
    model_args = SFTModelArguments(model_name_or_path=base, dtype=dtype, lora_r=16, lora_alpha=32, **quantize)
    training_args = ChatSFTConfig(
        output_dir=str(work), per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
        max_length=args.max_length, logging_steps=1, save_strategy="no", eval_strategy="no",
        load_best_model_at_end=False, report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    check_quantization_arguments(model_args, training_args)
    started = time.perf_counter()
    model = load_base_model(model_args, training_args)
    result = {"arm": arm, "dtype": dtype, "load_seconds": time.perf_counter() - started,
              "memory_after_load_bytes": torch.cuda.memory_allocated() if cuda else None,
              "device": "cuda" if cuda else f"cpu x{torch.get_num_threads()} threads"}
    layers = {name: module for name, module in model.model.layers.named_modules()
              if isinstance(module, torch.nn.Linear)}
    result |= {"layer_kinds": sorted({type(module).__name__ for module in layers.values()}),
               "quantized_layers": len(layers), "quantized_layer_bytes": sum(map(module_bytes, layers.values())),
               "base_bytes": module_bytes(model), "quantization": quantization_metadata(model)}
    if not train:
        return result
    tokenizer = AutoTokenizer.from_pretrained(base)
    records = read_chat_jsonl(find_asset("chat/gsm8k_messages_train.jsonl"))[: args.n_train]
    chats = write_chat_jsonl([{"messages": list(r.messages)} for r in records], work / "train.jsonl")
    # the rows' last tokens: the answer, which a short row would otherwise cut away
    data = load_sft_data(tokenizer, chats, seed=0, max_length=args.max_length, truncation_mode="keep_end")
    trainer = ChatSFTTrainer(model=model, args=training_args, train_dataset=data.train, processing_class=tokenizer,
                             peft_config=get_peft_config(model_args))
    timer = Timer()
    trainer.add_callback(timer.callback)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        cpu_resident_bytes(reset_peak=True)
    trainer.train()
    (t0, c0, n0), (t1, c1, n1) = timer.marks[args.timing_warmup - 1], timer.marks[-1]
    return result | {
        "training_peak_bytes": torch.cuda.max_memory_allocated() if cuda else cpu_resident_bytes(peak=True),
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tokens_per_s": (n1 - n0) / (t1 - t0), "tokens_per_cpu_s": (n1 - n0) / (c1 - c0),
        "s_per_step": (t1 - t0) / (len(timer.marks) - args.timing_warmup),
        "timed_steps": len(timer.marks) - args.timing_warmup,
    }


MEASUREMENTS = {  # result key: (unit, divisor, phase)
    "quantized_layer_bytes": ("MiB", 2**20, "memory"), "base_bytes": ("MiB", 2**20, "memory"),
    "memory_after_load_bytes": ("MiB", 2**20, "memory"), "load_seconds": ("s", 1, "memory"),
    "training_peak_bytes": ("MiB", 2**20, "training"), "process_peak_rss_bytes": ("MiB", 2**20, "training"),
    "tokens_per_s": ("tok/s", 1, "training"), "tokens_per_cpu_s": ("tok/CPU s", 1, "training"),
}


def rows(results: dict[str, dict[str, dict]]) -> list[dict]:
    """`{key, measurement, dtype, lora, qlora_nf4, ratio, goal, passed}` per measurement both arms have; `results` is
    `{phase: {arm: result}}`."""
    out = []
    for key, (unit, divisor, phase) in MEASUREMENTS.items():
        lora, qlora = (results.get(phase, {}).get(arm) or {} for arm in ARMS)
        if lora.get(key) is None or qlora.get(key) is None:
            continue
        ratio, goal = qlora[key] / lora[key], GOALS.get(key)
        out.append({"key": key, "measurement": f"{key} ({unit})", "dtype": lora["dtype"], "lora": lora[key] / divisor,
                    "qlora_nf4": qlora[key] / divisor, "ratio": ratio, "goal": f"<= {goal}" if goal else None,
                    "passed": None if goal is None else ratio <= goal})
    return out


def train_dtype(args: QLoRAArguments) -> str:
    """`args.train_dtype`, or for "auto" bfloat16 on CUDA and float32 on a CPU."""
    if args.train_dtype != "auto":
        return args.train_dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"


def main(args: QLoRAArguments) -> dict:
    """Build (or reuse) the base, run each arm in fresh processes (memory in bfloat16; the training steps in
    `train_dtype(args)`, in the same process when that is bfloat16), print the table; returns (and with `--json`
    writes) `{"args", "machine", "versions", "train_dtype", "results": {"memory", "training"}, "rows"}`."""
    base = str(in_fresh_process(save_base, args))
    dtype, results = train_dtype(args), {"memory": {}, "training": {}}
    for arm in args.arms.split(","):
        started = time.perf_counter()
        for phases, arm_dtype in ((("memory", "training"), "bfloat16"),) if dtype == "bfloat16" else (
                (("memory",), "bfloat16"), (("training",), dtype)):
            result = in_fresh_process(run_arm, arm, args, base, arm_dtype, "training" in phases,
                                      env={"MALLOC_MMAP_THRESHOLD_": "65536"})
            for phase in phases:
                results[phase][arm] = result
        print(f"{arm}: {time.perf_counter() - started:.0f} s with start-up", flush=True)
    table = rows(results)
    print(f"\nQwen3 shape: hidden {args.hidden_size}, {args.num_hidden_layers} layers, vocabulary {args.vocab_size}; "
          f"LoRA r=16 on q/v; {args.max_steps} steps of {args.batch_size} × {args.max_length} tokens in {dtype}")
    print(f"{'measurement':<34} {'dtype':>9} {'LoRA':>10} {'QLoRA NF4':>10} {'ratio':>7} {'goal':>7} {'passed':>6}")
    for line in table:
        print(f"{line['measurement']:<34} {line['dtype']:>9} {line['lora']:>10.1f} {line['qlora_nf4']:>10.1f} "
              f"{line['ratio']:>7.3f} {line['goal'] or '':>7} {'' if line['passed'] is None else line['passed']!s:>6}")
    from hfl3.provenance import package_versions

    recorded = asdict(args) | {"work": shown_path(args.work), "json": shown_path(args.json)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return write_result(args.json, {"args": recorded, "machine": machine_name(device), "versions": package_versions(),
                                    "train_dtype": dtype, "results": results, "rows": table})


if __name__ == "__main__":
    main(HfArgumentParser(QLoRAArguments).parse_args_into_dataclasses()[0])
