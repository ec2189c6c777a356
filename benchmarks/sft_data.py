"""SFT data preparation: hfl3's `load_sft_data` beside TRL's `SFTTrainer` preparation of the same records, at two
sizes and with one and two processes, in one run.

```bash
OMP_NUM_THREADS=1 python benchmarks/sft_data.py                  # 20,000 and 200,000 GSM8K conversations
OMP_NUM_THREADS=1 python benchmarks/sft_data.py --sizes 2000 --trl_sizes 2000 --json /tmp/sft_data.json  # quick
```

The records: GSM8K chats of the assets (`chat/gsm8k_messages_train.jsonl`: 7,473 in `shared/assets`, 300 in
`tests/fixtures`) repeated until `--sizes`, each repeat's question made unique (" (variant k)"), so none is a duplicate;
the tokenizer: the real Qwen3 one; `max_length` 1024. Arms, each in a fresh process:
- `hfl3`: `hfl3.data.sft.load_sft_data(tokenizer, FILE, dataset_num_proc=P)` into an empty cache (JSONL read by hfl3,
  masked from the stock Qwen3 template, rows written to Arrow), then once more from the cache (`cached s`);
- `hfl3_parquet` (with `--parquet`): the same records as a local parquet folder read by `dataset_name`;
- `trl`: `SFTTrainer._prepare_dataset` (its own preparation: ChatML conversion check, chat-template tokenization,
  labels, truncation, the filter of fully masked rows) of `datasets.load_dataset("json", FILE)` with
  `SFTConfig(dataset_num_proc=P, max_length=1024)`; the file is loaded inside the timing, as hfl3 reads it inside
  its own. TRL cannot mask the stock Qwen3 template (`assistant_only_loss` needs `{% generation %}`), so its rows
  train on every token: it does less work per record than hfl3 (one render instead of one per reply plus one).

Measured: conversations per second of wall time, and per CPU second (the process and its workers, user + system:
what the work costs, which other jobs on a shared machine move far less than the wall clock); peak RSS of the process
(`VmHWM`: resident pages, memory-mapped Arrow files included), its peak anonymous RSS (`anon`: `RssAnon` sampled every
10 ms, without the file-backed pages that the kernel can drop) and the peak RSS of its worker processes (`ru_maxrss`
of the children, the largest one), with the RSS before preparing (imports and tokenizer loaded) as `base`. The goals:
peak RSS at the largest size ≤ 1.2× the smallest's (1 process); 2 processes ≥ 1.6× one, and ≥ TRL's at the same
number of processes. The load average is recorded before and after each arm: on a machine whose cores other jobs
hold, two processes cannot run twice as fast, and the CPU-second rate says whether the parallel work itself costs more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import find_asset, in_fresh_process, shown_path  # noqa: E402

MAX_LENGTH = 1024


def write_records(source: Path, n: int, path: Path) -> Path:
    """`n` conversations from `source` (JSONL), repeated with each repeat's user question made unique."""
    base = [json.loads(line)["messages"] for line in source.read_text(encoding="utf-8").split("\n") if line.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            messages = [dict(m) for m in base[i % len(base)]]
            if i >= len(base):
                user = next(m for m in messages if m["role"] == "user")
                user["content"] += f" (variant {i // len(base)})"
            f.write(json.dumps({"id": f"r{i}", "messages": messages}, ensure_ascii=False) + "\n")
    return path


def write_parquet(jsonl: Path, folder: Path, row_group_size: int = 10_000) -> Path:
    """The records as a Hub-style parquet folder, in row groups of `row_group_size` rows (`datasets` converts a
    parquet file one row group at a time, so its memory follows the largest row group)."""
    import datasets
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache:
        records = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=cache)
        pq.write_table(records.data.table, folder / "train-00000-of-00001.parquet", row_group_size=row_group_size)
    return folder


def _status(key: str) -> int:
    """A `/proc/self/status` field in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakAnon:
    """The largest `RssAnon` of this process while in the `with` block, sampled every 10 ms by a thread: its anonymous
    resident memory (heap, Arrow buffers), without the file-backed pages of memory-mapped or read files that `VmHWM`
    also counts and the kernel can drop under pressure."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, _status("RssAnon"))
            if self._stop.wait(0.01):
                return


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _rows_sha256(dataset) -> str:
    digest = hashlib.sha256()
    for batch in dataset.with_format("arrow").iter(batch_size=4096):
        for column in ("input_ids", "labels"):
            digest.update(json.dumps(batch[column].to_pylist()).encode())
    return digest.hexdigest()


def worker(arm: str, data: str, num_proc: int, tokenizer_path: str, work: str) -> dict:
    """Prepare `data` as `arm` with `num_proc` processes in this process (call it in a fresh one)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    cache = tempfile.mkdtemp(dir=work, prefix=f"{arm}_cache_")
    result = {"arm": arm, "num_proc": num_proc, "load_before": os.getloadavg()[0]}
    if arm.startswith("hfl3"):
        from hfl3.data.sft import load_sft_data

        source = {"dataset_name": data} if arm == "hfl3_parquet" else {"train_file": data}
        result["base_rss"], result["base_anon"] = _status("VmRSS"), _status("RssAnon")
        started, cpu = time.perf_counter(), _cpu_seconds()
        with PeakAnon() as anon:
            prepared = load_sft_data(tokenizer, **source, max_length=MAX_LENGTH, dataset_num_proc=num_proc,
                                     cache_dir=cache)
        result["seconds"], result["cpu_seconds"] = time.perf_counter() - started, _cpu_seconds() - cpu
        result["peak_rss"], result["peak_anon"] = _status("VmHWM"), anon.peak
        rows = prepared.train
        started = time.perf_counter()
        load_sft_data(tokenizer, **source, max_length=MAX_LENGTH, dataset_num_proc=num_proc, cache_dir=cache)
        result["cached_seconds"] = time.perf_counter() - started
    else:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from trl import SFTConfig, SFTTrainer

        config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        args = SFTConfig(output_dir=str(Path(work) / "trl"), max_length=MAX_LENGTH, dataset_num_proc=num_proc,
                         report_to="none", use_cpu=not torch.cuda.is_available(), bf16=False)
        tiny = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "Hi"},
                                                         {"role": "assistant", "content": "Hello"}]}])
        trainer = SFTTrainer(model=Qwen3ForCausalLM(config), args=args, train_dataset=tiny, processing_class=tokenizer)
        result["base_rss"], result["base_anon"] = _status("VmRSS"), _status("RssAnon")
        started, cpu = time.perf_counter(), _cpu_seconds()
        with PeakAnon() as anon:
            records = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
            rows = trainer._prepare_dataset(records, tokenizer, args, packing=False, formatting_func=None,
                                            dataset_name="train")
        result["seconds"], result["cpu_seconds"] = time.perf_counter() - started, _cpu_seconds() - cpu
        result["peak_rss"], result["peak_anon"] = _status("VmHWM"), anon.peak
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result.update(rows=len(rows), conversations_per_s=len(rows) / result["seconds"], children_peak_rss=children,
                  conversations_per_cpu_s=len(rows) / result["cpu_seconds"],
                  rows_sha256=_rows_sha256(rows), load_after=os.getloadavg()[0])
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000], help="conversations per arm")
    parser.add_argument("--trl_sizes", type=int, nargs="*", default=[20_000], help="sizes TRL also prepares")
    parser.add_argument("--num_proc", type=int, nargs="+", default=[1, 2], help="dataset_num_proc values")
    parser.add_argument("--parquet", action="store_true", help="also read the records as a parquet folder")
    parser.add_argument("--skip", nargs="*", default=[], help="arm:size:num_proc runs to leave out")
    parser.add_argument("--data", default=None, help="chat JSONL to draw from (default: the assets' GSM8K train)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.data = args.data or str(find_asset("chat/gsm8k_messages_train.jsonl"))
    return args


def run(args: argparse.Namespace) -> dict:
    """Every arm × size × processes in a fresh process; prints the table and the goals, returns the results."""
    tokenizer = str(find_asset("tokenizers/qwen3"))
    with tempfile.TemporaryDirectory(dir=args.work, prefix="sft_data_") as work:
        results = []
        for size in args.sizes:
            jsonl = write_records(Path(args.data), size, Path(work) / f"records_{size}.jsonl")
            sources = {"hfl3": str(jsonl)}
            if args.parquet:
                sources["hfl3_parquet"] = str(write_parquet(jsonl, Path(work) / f"parquet_{size}"))
            if size in args.trl_sizes:
                sources["trl"] = str(jsonl)
            for arm, data in sources.items():
                for num_proc in args.num_proc:
                    if f"{arm}:{size}:{num_proc}" in args.skip:
                        continue
                    result = in_fresh_process(worker, arm, data, num_proc, tokenizer, work)
                    result["size"] = size
                    results.append(result)
                    print(f"{arm} {size} × {num_proc} proc: {result['conversations_per_s']:.0f} conv/s, peak "
                          f"{result['peak_rss'] / 2**20:.0f} MiB (load {result['load_before']:.1f}→"
                          f"{result['load_after']:.1f})", flush=True)
    table = report(results, args)
    from hfl3.atomic import write_json_atomic
    from hfl3.provenance import package_versions

    output = {"args": {**vars(args), "data": shown_path(args.data), "work": None},
              "versions": package_versions(), "cpus": os.cpu_count(), "results": results, "goals": table}
    if args.json:
        write_json_atomic(args.json, output)
    return output


def report(results: list[dict], args: argparse.Namespace) -> dict:
    """Print the table of arms with ratios, and the goals met or missed."""
    print(f"\n{'arm':<13} {'size':>8} {'proc':>4} {'conv/s':>7} {'conv/CPU s':>10} {'s':>7} {'cached s':>8} "
          f"{'base MiB':>8} {'peak MiB':>8} {'anon MiB':>8} {'workers MiB':>11} {'load':>9}")
    for r in results:
        cached = f"{r['cached_seconds']:>8.1f}" if "cached_seconds" in r else f"{'':>8}"
        anon = f"{r['peak_anon'] / 2**20:>8.0f}" if "peak_anon" in r else f"{'':>8}"
        print(f"{r['arm']:<13} {r['size']:>8} {r['num_proc']:>4} {r['conversations_per_s']:>7.0f} "
              f"{r['conversations_per_cpu_s']:>10.0f} {r['seconds']:>7.1f} {cached} {r['base_rss'] / 2**20:>8.0f} "
              f"{r['peak_rss'] / 2**20:>8.0f} {anon} {r['children_peak_rss'] / 2**20:>11.0f} "
              f"{r['load_before']:>4.1f}→{r['load_after']:<4.1f}")

    def find(arm, size, num_proc):
        return next((r for r in results if (r["arm"], r["size"], r["num_proc"]) == (arm, size, num_proc)), None)

    goals = {}
    small, large = min(args.sizes), max(args.sizes)
    for arm in ("hfl3", "hfl3_parquet"):
        low, high = find(arm, small, 1), find(arm, large, 1)
        if low and high and small != large:
            goals[f"{arm} peak RSS {large} / {small}"] = (high["peak_rss"] / low["peak_rss"], "<=", 1.2)
            if "peak_anon" in low and "peak_anon" in high:
                print(f"{arm}: peak anonymous RSS {large} / {small} = {high['peak_anon'] / low['peak_anon']:.2f} "
                      f"({low['peak_anon'] / 2**20:.0f} → {high['peak_anon'] / 2**20:.0f} MiB)")
    for size in sorted(set(args.sizes)):
        one, two = find("hfl3", size, 1), find("hfl3", size, 2)
        if one and two:
            goals[f"hfl3 conv/s 2 proc / 1 proc at {size}"] = (
                two["conversations_per_s"] / one["conversations_per_s"], ">=", 1.6)
            efficiency = two["conversations_per_cpu_s"] / one["conversations_per_cpu_s"]
            print(f"hfl3 at {size}: 2 processes do {efficiency:.2f}× the conversations per CPU second of one (a 2× "
                  "wall-clock speed-up needs that near 1.0 and 2 free cores)")
            if one["rows_sha256"] != two["rows_sha256"]:
                goals[f"hfl3 rows equal with 1 and 2 processes at {size}"] = (0.0, ">=", 1.0)
        for num_proc in args.num_proc:
            ours, theirs = find("hfl3", size, num_proc), find("trl", size, num_proc)
            if ours and theirs:
                goals[f"hfl3 / TRL conv/s at {size}, {num_proc} proc"] = (
                    ours["conversations_per_s"] / theirs["conversations_per_s"], ">=", 1.0)
    print()
    for name, (value, relation, goal) in goals.items():
        met = value <= goal if relation == "<=" else value >= goal
        print(f"{name:<50} {value:>6.2f}  goal {relation} {goal}: {'met' if met else 'MISSED'}")
    return {name: {"value": value, "goal": f"{relation} {goal}"} for name, (value, relation, goal) in goals.items()}


if __name__ == "__main__":
    run(parse_args())
