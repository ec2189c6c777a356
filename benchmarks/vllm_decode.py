"""Decode tokens/s of vLLM (the `integrations/vllm` plugin) vs transformers' `generate` on the same L3GPT folder.

Builds an L3GPT folder in hfl3's environment (random weights, speed does not depend on them; the dense core and an
L3 layer, sizes from the flags), times transformers' `generate` on it there, then vLLM in the serving environment
(`--serving_python`, default `.venv-serving/bin/python` of `make test-serving`; a fresh process running this file
with `--side vllm`, which imports neither hfl3 nor transformers' modeling code). Both decode greedily from the same
prompts (token ids, `--prompt_tokens` each, distinct), never stopping at EOS, in batches of `--batch_sizes`.

decode tok/s = batch × (new − 1) / (time(new tokens) − time(1 token)), median of `--repeats` after one warm-up, so
prefill and start-up are left out. Two clocks: wall-clock and the process's CPU time (all its threads), the usable
one on a shared box. transformers runs one thread (`OMP_NUM_THREADS=1`); vLLM's CPU worker binds its OpenMP threads
to the cores it is given (`VLLM_CPU_OMP_THREADS_BIND`, by default all but one). vLLM runs in the benchmark's
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni` executor), eager (`--vllm_compile` for vLLM's default CPU
compilation), without prefix caching (each repeat computes its prompts again).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_decode.py --json benchmarks/results/vllm_decode_cpu.json
    python benchmarks/vllm_decode.py --dtype bfloat16 --depth 12 --serving_python VLLM_ENV/bin/python  # a GPU, owed
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import write_result  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["transformers", "vllm"], default="transformers",
                        help="transformers: build the folder, time both sides (vLLM in a subprocess); vllm: internal")
    parser.add_argument("--folder", help="an existing L3GPT folder instead of building one")
    parser.add_argument("--depth", type=int, default=6, help="layers of the built model (hidden = 64 × depth)")
    parser.add_argument("--vocab_size", type=int, default=32768)
    parser.add_argument("--l3_after_layers", type=int, nargs="*", default=[2])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="bfloat16 on a GPU")
    parser.add_argument("--device", default=None, help="transformers' device (default: cuda when available)")
    parser.add_argument("--vllm_compile", action="store_true", help="vLLM's default torch.compile instead of eager")
    parser.add_argument("--serving_python", default=str(REPO / ".venv-serving" / "bin" / "python"))
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def prompts(batch: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(batch)]


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def decode_rates(generate, args, vocab_size: int) -> dict:
    """{batch: {"wall": tok/s, "cpu": tok/s}} for `generate(batch_prompts, new_tokens)`."""
    rates = {}
    for batch in args.batch_sizes:
        batch_prompts = prompts(batch, args.prompt_tokens, vocab_size)
        generate(batch_prompts, 2)  # warm-up
        wall, cpu = [], []
        for _ in range(args.repeats):
            start = clocks()
            generate(batch_prompts, 1)
            one = clocks()
            generate(batch_prompts, args.new_tokens)
            end = clocks()
            decode = [(e - m) - (m - s) for s, m, e in zip(start, one, end)]
            wall.append(batch * (args.new_tokens - 1) / decode[0])
            cpu.append(batch * (args.new_tokens - 1) / decode[1])
        rates[batch] = {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}
        print(f"  batch {batch}: {rates[batch]['wall']:.1f} tok/s wall, {rates[batch]['cpu']:.1f} tok/s CPU",
              flush=True)
    return rates


def vllm_side(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.folder, dtype=args.dtype, enforce_eager=not args.vllm_compile, enable_prefix_caching=False,
              max_num_seqs=max(args.batch_sizes), kv_cache_memory_bytes=1 << 30, distributed_executor_backend="uni",
              max_model_len=args.prompt_tokens + args.new_tokens, seed=0, skip_tokenizer_init=True)

    def generate(batch_prompts, new_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params, use_tqdm=False)

    return decode_rates(generate, args, llm.llm_engine.model_config.hf_config.vocab_size)


def build_folder(args, folder: Path) -> None:
    import torch

    from hfl3 import L3GPTConfig, L3GPTForCausalLM

    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(args.depth, vocab_size=args.vocab_size, l3_after_layers=args.l3_after_layers,
                                    max_position_embeddings=max(256, args.prompt_tokens + args.new_tokens))
    model = L3GPTForCausalLM(config)
    with torch.no_grad():  # the zero-initialised projections and smear get values, as a trained model has
        for parameter in model.parameters():
            if not parameter.any():
                parameter.normal_(0.0, 0.02)
    model.save_pretrained(folder)


def transformers_side(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=getattr(torch, args.dtype)).to(device).eval()

    @torch.no_grad()
    def generate(batch_prompts, new_tokens):
        ids = torch.tensor(batch_prompts, device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()

    return decode_rates(generate, args, model.config.vocab_size)


def main(args) -> None:
    if args.side == "vllm":
        print("VLLM_RATES " + json.dumps(vllm_side(args)))
        return
    with tempfile.TemporaryDirectory() as work:
        if args.folder is None:
            args.folder = str(Path(work) / "l3gpt")
            build_folder(args, Path(args.folder))
        print("transformers generate:", flush=True)
        hf = transformers_side(args)
        print("vLLM (hfl3-vllm plugin):", flush=True)
        command = [args.serving_python, __file__, "--side", "vllm", "--folder", args.folder, "--batch_sizes",
                   *map(str, args.batch_sizes), "--prompt_tokens", str(args.prompt_tokens), "--new_tokens",
                   str(args.new_tokens), "--repeats", str(args.repeats), "--dtype", args.dtype,
                   *(["--vllm_compile"] if args.vllm_compile else [])]
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        lines = [line for line in result.stdout.splitlines() if line.startswith("VLLM_RATES ")]
        if result.returncode or not lines:
            raise SystemExit(f"vLLM side failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")
        vllm = {int(batch): rate for batch, rate in json.loads(lines[0].removeprefix("VLLM_RATES ")).items()}
    print(f"\n| batch | transformers tok/s (wall / CPU) | vLLM tok/s (wall / CPU) | vLLM / transformers (wall / CPU) |")
    print("|---|---|---|---|")
    for batch in args.batch_sizes:
        h, v = hf[batch], vllm[batch]
        print(f"| {batch} | {h['wall']:.1f} / {h['cpu']:.1f} | {v['wall']:.1f} / {v['cpu']:.1f} | "
              f"{v['wall'] / h['wall']:.2f}× / {v['cpu'] / h['cpu']:.2f}× |")
    settings = {key: value for key, value in vars(args).items() if key not in ("json", "serving_python", "folder")}
    write_result(args.json, {"settings": settings, "transformers": hf, "vllm": vllm})


if __name__ == "__main__":
    main(parse_args())
