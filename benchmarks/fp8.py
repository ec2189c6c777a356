"""FP8 training throughput: bf16 vs hfl3's Float8Linear (tensorwise, rowwise) vs torchao's, eager and compiled.

One training step = forward + backward + AdamW step of a dense L3GPT (L3 layers off, so only the matmuls differ)
under bf16 autocast with fp32 master weights, on random token batches. Every FP8 variant converts the same layers
(`hfl3.fp8.select_float8_layers`: dims % 16, min dim ≥ 128, layer 0's q/k/v and lm_head kept). Reported per
(size, compile, variant): tokens/s over the timed steps (warm-up excluded), × bf16 at the same size and compile
setting, peak memory (CUDA `max_memory_allocated` during the timed steps; not measured on CPU), activation memory
autograd saves for backward (eager only, parameters excluded) and the last loss (sanity: ≈ ln(vocab) early on).

On CPU hfl3's FP8 matmuls are *emulated* (dequantise, bf16 matmul) and torchao runs torch's CPU `_scaled_mm`:
the CPU table only proves the script and every variant run, it says nothing about GPU speed.

    python benchmarks/fp8.py                                          # CPU, tiny d2 model
    python benchmarks/fp8.py --device cuda --sizes d12,d20 --json benchmarks/results/fp8_h100.json
    python benchmarks/fp8.py --device cuda --sizes d20 --variants bf16,tensorwise,torchao_tensorwise --compile on
"""

import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hfl3 import L3GPTForCausalLM
from hfl3.fp8 import convert_to_float8_training, select_float8_layers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CPU_SHAPE, GPU_SHAPE, ModelShape, machine_name, write_result  # noqa: E402

VARIANTS = ("bf16", "tensorwise", "rowwise", "torchao_tensorwise", "torchao_rowwise")
# CPU defaults are tiny (the point is that it runs); CUDA defaults are nanochat's d12/d20 training shapes.
DEVICE_SHAPES = {"cpu": replace(CPU_SHAPE, vocab_size=512), "cuda": GPU_SHAPE}
DEVICE_DEFAULTS = {"cpu": {"sizes": "d2", "steps": 8, "warmup": 2},
                   "cuda": {"sizes": "d12,d20", "steps": 20, "warmup": 5}}


@dataclass
class Args:
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    sizes: str | None = field(default=None, metadata={"help": "comma-separated depths, e.g. d12,d20 (cpu: d2)"})
    variants: str = field(
        default="bf16,tensorwise,rowwise,torchao_tensorwise",
        metadata={"help": f"comma-separated subset of {','.join(VARIANTS)}"},
    )
    compile: str = field(default="off,on", metadata={"help": "off, on, or off,on (torch.compile of the model)"})
    batch_size: int | None = field(default=None, metadata={"help": "sequences per step (cpu 4, cuda 16)"})
    seq_len: int | None = field(default=None, metadata={"help": "tokens per sequence (cpu 128, cuda 2048)"})
    vocab_size: int | None = field(default=None, metadata={"help": "vocabulary (cpu 512, cuda 32768)"})
    steps: int | None = field(default=None, metadata={"help": "timed steps (cpu 8, cuda 20)"})
    warmup: int | None = field(default=None, metadata={"help": "untimed first steps, incl. compiling (cpu 2, cuda 5)"})
    json: str | None = field(default=None, metadata={"help": "write args, machine and rows as JSON here"})

    def __post_init__(self):
        if self.device not in DEVICE_DEFAULTS:
            raise ValueError(f"--device {self.device!r}: use cpu or cuda")
        DEVICE_SHAPES[self.device].fill(self)
        for key, value in DEVICE_DEFAULTS[self.device].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        unknown = set(self.variant_list) - set(VARIANTS)
        if unknown:
            raise ValueError(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
        if not set(self.compile_list) <= {False, True}:
            raise ValueError(f"--compile {self.compile!r}: use off, on or off,on")

    @property
    def variant_list(self) -> list[str]:
        return self.variants.split(",")

    @property
    def compile_list(self) -> list[bool]:
        return [{"off": False, "on": True}.get(item, item) for item in self.compile.split(",")]

    @property
    def depth_list(self) -> list[int]:
        return [int(size.removeprefix("d")) for size in self.sizes.split(",")]


def build_model(args: Args, depth: int, variant: str) -> L3GPTForCausalLM:
    """Dense L3GPT of `depth` (nanochat sizing), converted for `variant`, on `args.device`."""
    torch.manual_seed(0)
    config = ModelShape.of(args, depth=depth).config(window_pattern="L")
    model = L3GPTForCausalLM(config)
    if variant in ("tensorwise", "rowwise"):
        convert_to_float8_training(model, recipe=variant)
    elif variant.startswith("torchao_"):
        from torchao.float8 import Float8LinearConfig
        from torchao.float8 import convert_to_float8_training as torchao_convert

        selected = set(select_float8_layers(model)[0])
        torchao_convert(model, config=Float8LinearConfig.from_recipe_name(variant.removeprefix("torchao_")),
                        module_filter_fn=lambda module, name: name in selected)
    return model.to(args.device)


def saved_activation_bytes(model, batch, device_type: str) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(device_type, torch.bfloat16):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def measure(args: Args, depth: int, variant: str, compiled: bool) -> dict:
    """Train `warmup + steps` steps; tokens/s and memory over the timed steps."""
    device_type = torch.device(args.device).type
    model = build_model(args, depth, variant)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=generator).to(args.device)
               for _ in range(2)]
    saved = None if compiled else saved_activation_bytes(model, batches[0], device_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    step_model = torch.compile(model) if compiled else model
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)

    def step(batch) -> torch.Tensor:
        with torch.autocast(device_type, torch.bfloat16):
            loss = step_model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.warmup):
        step(batches[i % 2])
    sync()
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % 2])
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device_type == "cuda" else None
    row = {
        "size": f"d{depth}", "compile": compiled, "variant": variant, "hidden_size": model.config.hidden_size,
        "tok_per_s": args.steps * args.batch_size * args.seq_len / seconds, "peak_mib": peak and peak / 2**20,
        "saved_mib": saved and saved / 2**20, "loss": float(loss),
    }
    del model, step_model, optimizer
    gc.collect()
    torch._dynamo.reset()
    if device_type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    """Markdown table with × bf16 (same size and compile setting)."""
    base = {(r["size"], r["compile"]): r["tok_per_s"] for r in rows if r["variant"] == "bf16"}
    lines = ["| size | compile | variant | tok/s | × bf16 | peak MiB | saved-for-backward MiB | loss |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["tok_per_s"] / base[(r["size"], r["compile"])] if (r["size"], r["compile"]) in base else math.nan
        fmt = lambda value: "—" if value is None else f"{value:.0f}"  # noqa: E731
        lines.append(f"| {r['size']} | {'on' if r['compile'] else 'off'} | {r['variant']} | {r['tok_per_s']:.0f} | "
                     f"{ratio:.2f} | {fmt(r['peak_mib'])} | {fmt(r['saved_mib'])} | {r['loss']:.3f} |")
    return "\n".join(lines)


def main(args: Args) -> None:
    machine = machine_name(args.device)
    rows = []
    for depth in args.depth_list:
        for compiled in args.compile_list:
            for variant in args.variant_list:
                rows.append(measure(args, depth, variant, compiled))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\nFP8 training step, {machine}, torch {torch.__version__}, batch {args.batch_size} × seq {args.seq_len}, "
          f"vocab {args.vocab_size}, {args.steps} timed steps after {args.warmup} warm-up\n")
    print(table(rows))
    d20 = {r["variant"]: r["tok_per_s"] for r in rows if r["size"] == "d20" and r["compile"]}
    if "bf16" in d20 and "tensorwise" in d20:
        ratio = d20["tensorwise"] / d20["bf16"]
        verdict = "met" if ratio >= 1.2 else "NOT met"
        print(f"\ngoal: tensorwise ≥ 1.2× bf16 at d20 (compiled): {ratio:.2f}× — {verdict}")
    write_result(args.json, {"args": asdict(args), "machine": machine, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main(HfArgumentParser(Args).parse_args_into_dataclasses()[0])
