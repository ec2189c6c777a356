"""L3 tables served from CPU memory vs kept with the model: memory saved and generation tok/s.

Builds an L3GPT whose tables dominate its size (LZW allocation of real text), saves it to a temporary folder, then
loads it once per arm, each arm in a fresh process, arms alternating over `--rounds`:

- on CUDA: `on_device` (everything on the GPU) vs `offloaded` (`l3_offload=True`: tables pinned in RAM, the routed
  rows copied on a side stream) vs `mmap` (`l3_offload="mmap"`: tables mapped from the safetensors file);
  GPU memory after loading and at the peak of generation.
- on CPU (by default): `in_ram` (`disable_mmap=True`: the file read into memory) vs `mmap` (`l3_offload="mmap"`) vs
  `default`
  (plain `from_pretrained`: transformers 5.23 itself maps the file on the CPU); RSS growth after loading and after
  generating (and its file-backed part, RssFile), beside the bytes of the table rows the text routes to (the least
  any method must read). The file is dropped from the page cache before each arm (`posix_fadvise`), so every arm
  starts cold, as after a reboot: a just-written file sits in the page cache in large folios, and mapping one
  row then maps its whole folio. `--arms on_device,offloaded,mmap` runs the CUDA arms' loading on a CPU (a dry run
  of the GPU code path: the tables then stay in ordinary RAM, nothing is pinned and no copy is made).

Generation: `generate` with greedy decoding, forced (a logits processor) to emit held-out text, so that the routed
tokens have real text's frequencies; decode tok/s = batch × (new − 1) / (time(new tokens) − time(1 token)), median of
`--repeats`; time is the process's CPU time on CPU (run with `OMP_NUM_THREADS=1`: a usable clock on a shared box) and
wall-clock on CUDA. The prompt's logits of every arm are compared with the first arm's.

    OMP_NUM_THREADS=1 python benchmarks/l3_offload.py --json benchmarks/results/l3_offload_cpu.json
    python benchmarks/l3_offload.py --device cuda --dtype bfloat16 --vocab_size 32768 --hidden_size 768 \\
        --num_hidden_layers 12 --l3_after_layer 5 --l3_n_emb 720896 --json benchmarks/results/l3_offload_h100.json
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, LogitsProcessor, LogitsProcessorList

from hfl3 import L3GPTForCausalLM
from hfl3.models.l3gpt import lzw_allocation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelShape, in_fresh_process, machine_name, write_result  # noqa: E402
from l3_forward import real_text_ids  # noqa: E402

ARMS = {"cuda": ("on_device", "offloaded", "mmap"), "cpu": ("in_ram", "mmap", "default")}
LOAD_KWARGS = {
    "on_device": {}, "offloaded": {"l3_offload": True}, "mmap": {"l3_offload": "mmap"},
    "in_ram": {"disable_mmap": True}, "default": {},
}


@dataclass
class Args:
    device: str = field(default="cuda" if torch.cuda.is_available() else "cpu", metadata={"help": "cuda or cpu"})
    dtype: str = field(default="float32", metadata={"help": "weights' dtype (bfloat16 on a GPU)"})
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary (a BPE trained on the novels)"})
    hidden_size: int = field(default=256, metadata={"help": "C, also the width of the table rows"})
    num_hidden_layers: int = field(default=2, metadata={"help": "decoder layers"})
    l3_after_layer: int = field(default=0, metadata={"help": "the L3 layer follows this decoder layer"})
    l3_n_emb: int = field(default=1 << 20, metadata={"help": "table rows (1M × 256 × fp32 = 1 GiB)"})
    l3_k_max: int = field(default=512, metadata={"help": "most rows per token (the paper's k)"})
    text_tokens: int = field(default=400_000, metadata={"help": "novel tokens: 3/4 for the allocation, then prompts"})
    text_chars: int | None = field(default=None, metadata={"help": "train the BPE on this many characters only"})
    prompt_len: int = field(default=64, metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=128, metadata={"help": "tokens generated per sequence"})
    batch_sizes: str = field(default="1,8", metadata={"help": "comma-separated batch sizes"})
    repeats: int = field(default=5, metadata={"help": "timed generations per batch size (median)"})
    rounds: int = field(default=3, metadata={"help": "fresh processes per arm, arms alternating"})
    arms: str | None = field(default=None, metadata={"help": f"comma-separated (default by device: {ARMS})"})
    json: str | None = field(default=None, metadata={"help": "write the results as JSON here"})

    def __post_init__(self):
        if self.arms is None:
            self.arms = ",".join(ARMS[self.device])
        unknown = set(self.arm_list) - set(LOAD_KWARGS)
        if unknown:
            raise ValueError(f"--arms: unknown {sorted(unknown)}; choose from {sorted(LOAD_KWARGS)}")

    @property
    def arm_list(self) -> list[str]:
        return self.arms.split(",")


def resident_bytes() -> dict[str, int]:
    """This process's resident memory from /proc/self/status (Linux): total, anonymous and file-backed bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssAnon", "RssFile")}


def drop_from_page_cache(folder: Path) -> None:
    """Ask the kernel to drop the clean cached pages of `folder`'s safetensors files (no-op off Linux)."""
    if hasattr(os, "posix_fadvise"):
        for file in folder.glob("*.safetensors"):
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


class FollowText(LogitsProcessor):
    """Makes `generate` emit `continuation` `(batch, new_tokens)` after prompts of `prompt_len` tokens."""

    def __init__(self, continuation: torch.LongTensor, prompt_len: int):
        self.continuation, self.prompt_len = continuation, prompt_len

    def __call__(self, input_ids, scores):
        forced = self.continuation[:, input_ids.shape[1] - self.prompt_len, None].to(scores.device)
        return torch.full_like(scores, -torch.inf).scatter_(1, forced, 0.0)


def build(args: Args, folder: Path) -> None:
    """Save the model and the text (prompts + continuations, `(8, prompt_len + new_tokens)`) to `folder`."""
    torch.manual_seed(0)
    ids = real_text_ids(args.vocab_size, args.text_tokens, args.text_chars)
    split, length = 3 * len(ids) // 4, args.prompt_len + args.new_tokens
    stride = min(5000, (len(ids) - split - length) // 7)
    if stride < 1:
        raise ValueError(f"--text_tokens {args.text_tokens}: {len(ids)} tokens of text leave too few after the "
                         f"allocation's {split} for 8 sequences of {length}; raise --text_tokens or --text_chars")
    shape = ModelShape(depth=args.num_hidden_layers, vocab_size=args.vocab_size, head_dim=min(128, args.hidden_size),
                       aspect_ratio=args.hidden_size // args.num_hidden_layers)
    config = shape.config(window_pattern="L", l3_after_layers=[args.l3_after_layer], l3_n_emb=args.l3_n_emb,
                          l3_k_max=args.l3_k_max)
    model = L3GPTForCausalLM(config)
    model.set_l3_allocation(lzw_allocation([ids[:split].tolist()], config.vocab_size, args.l3_n_emb, args.l3_k_max))
    with torch.no_grad():  # non-zero output projections, so that every layer (L3 included) shapes the logits
        for param in model.parameters():
            if param.ndim == 2 and not param.any():
                param.normal_(std=0.02)
    model.to(getattr(torch, args.dtype)).save_pretrained(folder)
    text = ids[split:].unfold(0, length, stride)[:8]  # 8 sequences, `stride` tokens apart
    torch.save(text.clone(), folder / "text.pt")


def measure_arm(args: Args, arm: str, folder: Path) -> dict:
    """Load the model of `folder` as `arm` says and generate, in this process (call it in a fresh one)."""
    text = torch.load(folder / "text.pt")
    cuda = args.device == "cuda"
    rss_before = resident_bytes()
    kwargs = dict(LOAD_KWARGS[arm], dtype=getattr(torch, args.dtype))
    if cuda:
        kwargs["device_map"] = "cuda"
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.process_time
    result = {"rss_load_bytes": resident_bytes()["VmRSS"] - rss_before["VmRSS"]}
    if cuda:
        result["gpu_allocated_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        logits = model(text[:1, : args.prompt_len].to(args.device)).logits
    torch.save(logits.float().cpu(), folder / f"logits_{arm}.pt")

    def generate(batch: int, new_tokens: int) -> float:
        prompt = text[:batch, : args.prompt_len].to(args.device)
        follow = FollowText(text[:batch, args.prompt_len :], args.prompt_len)
        sync()
        start = clock()
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([follow]))
        sync()
        assert torch.equal(out[:, args.prompt_len :].cpu(), text[:batch, args.prompt_len :][:, :new_tokens])
        return clock() - start

    for batch in map(int, args.batch_sizes.split(",")):
        generate(batch, args.new_tokens)  # warm-up: also touches every row the text routes to
        full = statistics.median(generate(batch, args.new_tokens) for _ in range(args.repeats))
        first = statistics.median(generate(batch, 1) for _ in range(args.repeats))
        result[f"decode_tok_s_batch{batch}"] = batch * (args.new_tokens - 1) / (full - first)
    rss = resident_bytes()
    result["rss_generated_bytes"] = rss["VmRSS"] - rss_before["VmRSS"]
    result["rss_file_generated_bytes"] = rss["RssFile"] - rss_before["RssFile"]
    if cuda:
        result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def touched_table_bytes(args: Args, folder: Path) -> int:
    """Bytes of the table rows that the text routes to (each distinct token's rows once)."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    text = torch.load(folder / "text.pt")
    rows = int(model.model.l3_counts()[text.unique()].sum())
    return rows * args.hidden_size * getattr(torch, args.dtype).itemsize


def main(args: Args) -> dict:
    """Build, then measure every arm `rounds` times, each in a fresh process; returns (and with `--json` writes) the
    results (see `report`)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(args, folder)
        table_bytes = args.l3_n_emb * args.hidden_size * getattr(torch, args.dtype).itemsize
        runs = {arm: [] for arm in args.arm_list}
        for _ in range(args.rounds):
            for arm in runs:
                drop_from_page_cache(folder)
                runs[arm].append(in_fresh_process(measure_arm, args, arm, folder))
        reference = torch.load(folder / f"logits_{args.arm_list[0]}.pt")
        logit_diff = {arm: float((torch.load(folder / f"logits_{arm}.pt") - reference).abs().max()) for arm in runs}
        touched = touched_table_bytes(args, folder)
    return report(args, runs, logit_diff, table_bytes, touched)


def report(args: Args, runs: dict, logit_diff: dict, table_bytes: int, touched: int) -> dict:
    """Print the table (medians over rounds; ratios against the first arm); returns and with `--json` writes
    `{"args", "device", "table_bytes", "touched_table_bytes", "max_abs_logit_diff", "median", "runs"}`."""
    batches = [int(b) for b in args.batch_sizes.split(",")]
    median = {arm: {key: statistics.median(run[key] for run in arm_runs) for key in arm_runs[0]}
              for arm, arm_runs in runs.items()}
    base = median[args.arm_list[0]]
    print(f"\nL3 tables {table_bytes / 2**20:.0f} MB ({args.l3_n_emb} rows × {args.hidden_size}, {args.dtype}); "
          f"rows the text routes to: {touched / 2**20:.1f} MB; device={args.device}, "
          f"clock={'wall' if args.device == 'cuda' else 'process CPU'}")
    memory = ["gpu_allocated_bytes", "gpu_peak_bytes"] if args.device == "cuda" else []
    memory += ["rss_load_bytes", "rss_generated_bytes", "rss_file_generated_bytes"]
    header = f"{'arm':<10}" + "".join(f"{key.replace('_bytes', ' MB'):>22}" for key in memory)
    header += "".join(f"{f'tok/s b{b} (ratio)':>22}" for b in batches) + f"{'max |Δ logit|':>15}"
    print(header)
    for arm, values in median.items():
        line = f"{arm:<10}" + "".join(f"{values[key] / 2**20:>22.1f}" for key in memory)
        for b in batches:
            key = f"decode_tok_s_batch{b}"
            line += f"{f'{values[key]:.1f} ({values[key] / base[key]:.3f})':>22}"
        print(line + f"{logit_diff[arm]:>15.1e}")
    return write_result(args.json, {
        "args": asdict(args), "device": machine_name(args.device), "table_bytes": table_bytes,
        "touched_table_bytes": touched, "max_abs_logit_diff": logit_diff, "median": median, "runs": runs})


if __name__ == "__main__":
    main(HfArgumentParser(Args).parse_args_into_dataclasses()[0])
