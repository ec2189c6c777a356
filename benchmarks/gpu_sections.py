"""The sections of `gpu_suite.py`: what each one measures with which existing benchmark, at which sizes, and the rows
(measurement, hfl3, reference, ratio, goal) it reports. Each `run_*` function takes the `Profile` and a `report(rows,
details)` callback (called with the rows so far after each arm, so a section stopped mid-way keeps them) and returns
`{"rows": [...], "details": {...}}`.

Sizes: `gpu` is what the goals are about (nanochat's d12 shape, d20 for FP8); `dry_run` runs the same code path
(every arm, compile and bf16 on) at tiny sizes on a CPU; `smoke` is `dry_run` with compile off and the fewest steps,
the test suite's check that every section still runs.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import l3_offload  # noqa: E402
import loss_memory  # noqa: E402
import muon_step  # noqa: E402
import qlora_memory  # noqa: E402
import sft_throughput  # noqa: E402
import trainer_overhead  # noqa: E402
import vs_nanochat  # noqa: E402
from common import shown_path  # noqa: E402

NANOCHAT_MISSING = "not available: pass --nanochat_dir (a karpathy/nanochat checkout)"


@dataclass(frozen=True)
class Profile:
    """How a run is sized: `name` is gpu, dry_run or smoke; `device` cuda or cpu."""

    name: str
    device: str
    nanochat_dir: str | None = None
    work_dir: str = "outputs/gpu_suite"
    profile_dir: str | None = None  # the pretraining arms write <arm>_profile.txt here (vs_nanochat.StepProfiler)

    @property
    def gpu(self) -> bool:
        return self.name == "gpu"

    @property
    def compile(self) -> bool:
        return self.name != "smoke"

    def sizes(self, gpu: dict, tiny: dict, smoke: dict | None = None) -> dict:
        """`gpu` on a GPU run; else `tiny`, with `smoke` on top for a smoke run."""
        return dict(gpu) if self.gpu else {**tiny, **((smoke or {}) if self.name == "smoke" else {})}


def judge(ratio: float | None, goal: tuple[str, float] | None) -> bool | None:
    """Whether `ratio` meets `goal` ((">=", 1.1) or ("<=", 1.05)); None when either is missing."""
    if ratio is None or goal is None:
        return None
    operator, bound = goal
    return ratio >= bound if operator == ">=" else ratio <= bound


def row(measurement: str, hfl3: float | None, reference: float | None, reference_name: str | None,
        goal: tuple[str, float] | None = None, note: str | None = None) -> dict:
    """One line of the table; `ratio` = hfl3 / reference when both are known; `note` says why a value is missing."""
    ratio = hfl3 / reference if hfl3 is not None and reference else None
    return {"measurement": measurement, "hfl3": hfl3, "reference": reference, "reference_name": reference_name,
            "ratio": ratio, "goal": list(goal) if goal else None, "passed": judge(ratio, goal), "note": note}


def each_arm(arms: list[str], measure, report, rows_of) -> dict[str, dict]:
    """`measure(arm)` for every arm in turn; an arm that raises is recorded as `{"error": ...}` and the others still
    run; `report(rows_of(results), results)` after each arm."""
    results: dict[str, dict] = {}
    for arm in arms:
        try:
            results[arm] = measure(arm)
        except Exception as error:  # one arm's failure must not cost the others' numbers
            traceback.print_exc()
            results[arm] = {"error": one_line(error)}
        report(rows_of(results), results)
    return results


def one_line(error: BaseException) -> str:
    """`Type: last line of the message`, at most 300 characters: what a table cell can hold."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def missing(result: dict | None, what: str = "not run") -> str | None:
    """Why an arm's numbers are absent: its error, or `what`."""
    if result is None:
        return what
    return result.get("error")


def value(result: dict | None, key: str) -> float | None:
    return None if result is None or "error" in result else result.get(key)


# ---- 1. pretraining step vs nanochat, and 6. the dense core, 2. FP8: hfl3's Trainer path (vs_nanochat.py) ----------

# Warm-up cut from 10 to 5 steps and the window from 20 to 15 to fit one device call: compilation and autotuning
# happen in step 1, and 15 steps of ~75 ms still span over a second at d12.
PRETRAIN_GPU = dict(depth=12, seq_len=2048, batch_size=16, vocab_size=32768, head_dim=128, steps=15, warmup_steps=5)
PRETRAIN_TINY = dict(depth=2, seq_len=64, batch_size=2, vocab_size=512, head_dim=64, steps=2, warmup_steps=2)
FP8_GPU = PRETRAIN_GPU | dict(depth=20, steps=15, warmup_steps=5)
ONE_STEP = dict(steps=1, warmup_steps=1)


def _vs_nanochat_arms(profile: Profile, sizes: dict, arms: list[str], report, rows_of,
                     profile_dir: str | None = None) -> dict:
    args = vs_nanochat.VsNanochatArguments(
        nanochat_dir=profile.nanochat_dir, arms=arms, compile=profile.compile, bf16=True,
        dataloader_num_workers=2 if profile.gpu else 0, profile_dir=profile_dir, **sizes)
    results = each_arm(args.arms, lambda arm: vs_nanochat.main(replace(args, arms=[arm]))["results"][0], report,
                       rows_of)
    recorded = asdict(args) | {"nanochat_dir": shown_path(args.nanochat_dir)}
    return {"rows": rows_of(results), "details": {"args": recorded, "results": results}}


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _memory_note(profile: Profile) -> str | None:
    return None if profile.device == "cuda" else "peak memory is measured on CUDA only"


def run_pretrain(profile: Profile, report) -> dict:
    sizes = profile.sizes(PRETRAIN_GPU, PRETRAIN_TINY, ONE_STEP)
    arms = (["nanochat"] if profile.nanochat_dir else []) + ["hfl3", "hfl3_l3"]
    shape = f"d{sizes['depth']}, {sizes['batch_size']}×{sizes['seq_len']}, bf16, compile {_on(profile.compile)}"

    def rows_of(results: dict) -> list[dict]:
        nanochat, dense, l3 = results.get("nanochat"), results.get("hfl3"), results.get("hfl3_l3")
        why = NANOCHAT_MISSING if not profile.nanochat_dir else missing(nanochat)
        memory = _memory_note(profile)
        return [
            row(f"tok/s, hfl3 dense vs nanochat ({shape}, Muon)", value(dense, "tok_per_sec"),
                value(nanochat, "tok_per_sec"), "nanochat", (">=", 1.1), why or missing(dense)),
            row("MFU %, hfl3 dense vs nanochat", value(dense, "mfu"), value(nanochat, "mfu"), "nanochat", None,
                why or missing(dense) or (None if profile.device == "cuda" else "MFU needs a known GPU peak")),
            row("peak memory GB, hfl3 dense vs nanochat", value(dense, "peak_memory_gb"),
                value(nanochat, "peak_memory_gb"), "nanochat", ("<=", 1.1), why or missing(dense) or memory),
            row("compile s (first step − a timed step), hfl3 dense vs nanochat", value(dense, "compile_seconds"),
                value(nanochat, "compile_seconds"), "nanochat", None, why or missing(dense)),
            row("tok/s, hfl3 + one L3 layer vs hfl3 dense", value(l3, "tok_per_sec"), value(dense, "tok_per_sec"),
                "hfl3 dense", (">=", 0.9), missing(l3) or missing(dense)),
            row("peak memory GB, hfl3 + L3 vs hfl3 dense", value(l3, "peak_memory_gb"), value(dense, "peak_memory_gb"),
                "hfl3 dense", None, missing(l3) or missing(dense) or memory),
        ]

    return _vs_nanochat_arms(profile, sizes, arms, report, rows_of, profile_dir=profile.profile_dir)


FP8_ARMS = {"hfl3_fp8_tensorwise": "tensorwise (hfl3 Float8Linear)", "hfl3_fp8_rowwise": "rowwise (hfl3 Float8Linear)",
            "hfl3_fp8_ao": "tensorwise via accelerate's torchao backend"}


def run_fp8(profile: Profile, report) -> dict:
    sizes = profile.sizes(FP8_GPU, PRETRAIN_TINY, ONE_STEP)
    torchao = importlib.util.find_spec("torchao") is not None
    arms = ["hfl3", *(arm for arm in FP8_ARMS if torchao or arm != "hfl3_fp8_ao")]

    def rows_of(results: dict) -> list[dict]:
        bf16 = results.get("hfl3")
        mfu_note = missing(bf16) or (None if profile.device == "cuda" else "MFU needs a known GPU peak")
        rows = [row(f"MFU %, hfl3 bf16 (d{sizes['depth']}, compile {_on(profile.compile)}, Muon)", value(bf16, "mfu"),
                    None, None, None, mfu_note)]
        for arm, name in FP8_ARMS.items():
            result = results.get(arm)
            why = ("torchao is not installed: carry its wheel in .whl" if arm == "hfl3_fp8_ao" and not torchao
                   else missing(result) or missing(bf16))
            goal = (">=", 1.2) if arm == "hfl3_fp8_tensorwise" else None
            rows += [
                row(f"tok/s, FP8 {name} vs bf16", value(result, "tok_per_sec"), value(bf16, "tok_per_sec"), "bf16",
                    goal, why),
                row(f"peak memory GB, FP8 {name} vs bf16", value(result, "peak_memory_gb"),
                    value(bf16, "peak_memory_gb"), "bf16", None, why or _memory_note(profile)),
                row(f"compile s, FP8 {name} vs bf16", value(result, "compile_seconds"),
                    value(bf16, "compile_seconds"), "bf16", None, why),
            ]
        return rows

    return _vs_nanochat_arms(profile, sizes, arms, report, rows_of)


def run_dense_core(profile: Profile, report) -> dict:
    sizes = profile.sizes(PRETRAIN_GPU, PRETRAIN_TINY, ONE_STEP)

    def rows_of(results: dict) -> list[dict]:
        new, legacy = results.get("hfl3"), results.get("hfl3_legacy")
        why = missing(new) or missing(legacy)
        return [
            row(f"tok/s, new dense core (value embeddings, smear, backout) vs legacy core (d{sizes['depth']})",
                value(new, "tok_per_sec"), value(legacy, "tok_per_sec"), "legacy core", None, why),
            row("MFU %, new core vs legacy core (FLOPs counted per model)", value(new, "mfu"), value(legacy, "mfu"),
                "legacy core", None, why or (None if profile.device == "cuda" else "MFU needs a known GPU peak")),
            row("peak memory GB, new core vs legacy core", value(new, "peak_memory_gb"),
                value(legacy, "peak_memory_gb"), "legacy core", None, why or _memory_note(profile)),
        ]

    return _vs_nanochat_arms(profile, sizes, ["hfl3", "hfl3_legacy"], report, rows_of)


# ---- 3. the Trainer path vs a plain loop (trainer_overhead.py) ------------------------------------------------------


def run_trainer(profile: Profile, report) -> dict:
    sizes = profile.sizes(
        dict(depth=12, seq_len=2048, batch_size=16, vocab_size=32768, head_dim=128, steps=20, warmup_steps=5),
        dict(depth=2, seq_len=64, batch_size=2, vocab_size=512, head_dim=64, steps=3, warmup_steps=1))
    args = trainer_overhead.OverheadArguments(dense=True, optim="muon", compile=profile.compile, bf16=True, rounds=1,
                                              **sizes)
    output = trainer_overhead.main(args)
    medians = output["median_seconds"]
    rows = [
        row(f"ms/step, hfl3 Trainer vs plain loop (d{args.depth} dense, Muon, bf16, compile {_on(args.compile)}; "
            "medians)",
            1e3 * medians["trainer"], 1e3 * medians["plain"], "plain loop", ("<=", 1.05)),
        row("median of paired step ratios, Trainer / plain", output["median_of_paired_ratios"], 1.0, "plain loop"),
        row("max |Δ weight| between the paths after the run", output["max_abs_param_difference"], None, None, None,
            "0 = the same steps; compile and bf16 may reorder round-off"),
    ]
    return {"rows": rows, "details": output}


# ---- 4. MuonAdamW.step() vs fused AdamW (muon_step.py) --------------------------------------------------------------


def run_muon_step(profile: Profile, report) -> dict:
    sizes = profile.sizes(dict(depth=12, vocab_size=32768, head_dim=128, steps=20, warmup_steps=3),
                          dict(depth=2, vocab_size=512, head_dim=64, steps=2, warmup_steps=2), dict(steps=1))
    l3_layer = 5 if profile.gpu else 0
    rows, details = [], {}
    for name, l3_after_layers in (("with one L3 layer", [l3_layer]), ("dense", [])):
        args = muon_step.StepArguments(device=profile.device, l3_after_layers=l3_after_layers,
                                       compiled=profile.compile, **sizes)
        output = details[name] = muon_step.main(args)
        arms, default = output["arms"], output["default_arm"]
        adamw = "fused AdamW" if profile.device == "cuda" else "foreach AdamW (fused is CUDA-only)"
        rows += [
            row(f"ms/step, MuonAdamW ({default}) vs {adamw}, d{args.depth} {name}", arms[default]["wall"],
                arms["adamw"]["wall"], "AdamW", ("<=", 3.0)),
            row(f"ms/step, per-parameter MuonAdamW (before stacking) vs {default}, d{args.depth} {name}",
                arms["per_parameter"]["wall"], arms[default]["wall"], default),
            row(f"first update, relative difference {default} vs per-parameter, {name}",
                output["relative_update_difference_vs_per_parameter"][default], None, None, None,
                "round-off (bf16 Polar Express on CUDA)"),
        ]
        report(rows, details)
    return {"rows": rows, "details": details}


# ---- 5. the training loss: fused (Liger) vs plain (loss_memory.py) -------------------------------------------------


def run_loss(profile: Profile, report) -> dict:
    sizes = profile.sizes(dict(batch_size=16, seq_len=2048, hidden_size=768, vocab_size=32768, repeats=3),
                          dict(batch_size=2, seq_len=64, hidden_size=128, vocab_size=512, repeats=2), dict(repeats=1))
    output = loss_memory.main(loss_memory.Args(device=profile.device, bf16=True, **sizes))
    plain, fused, *pytorch = output["results"]  # pytorch: the chunked function beside Liger, on CUDA
    name = f"fused ({output['fused']})"
    note = None if output["fused"] == "liger" else "Liger needs CUDA and liger-kernel: this is the chunked fallback"
    rows = [
        row(f"peak memory MiB of forward + backward, {name} vs plain (B={sizes['batch_size']}, T={sizes['seq_len']}, "
            f"V={sizes['vocab_size']}, bf16)", fused["peak_bytes"] / 2**20, plain["peak_bytes"] / 2**20, "plain", None,
            note),
        row(f"s/step, {name} vs plain", fused["seconds"], plain["seconds"], "plain", None, note),
        row("|Δ loss|, fused vs plain", abs(fused["loss"] - plain["loss"]), None, None, None, "bf16 round-off"),
    ]
    for chunked in pytorch:  # which memory-light loss the compiled pretraining step should run (dev/LOG.md 2026-11-26)
        rows += [row("peak memory MiB, chunked (PyTorch, in the compiled graph) vs Liger", chunked["peak_bytes"] / 2**20,
                     fused["peak_bytes"] / 2**20, "liger", None, "eager here; Liger is a graph break when compiled"),
                 row("s/step, chunked (PyTorch) vs Liger", chunked["seconds"], fused["seconds"], "liger", None,
                     "eager here; Liger is a graph break when compiled")]
    return {"rows": rows, "details": output}


# ---- 7. L3 tables offloaded at inference (l3_offload.py) -----------------------------------------------------------


def run_l3_offload(profile: Profile, report) -> dict:
    sizes = profile.sizes(
        dict(dtype="bfloat16", vocab_size=32768, hidden_size=768, num_hidden_layers=12, l3_after_layer=5,
             l3_n_emb=720896, l3_k_max=512, repeats=3, rounds=1),
        dict(dtype="bfloat16", vocab_size=512, hidden_size=64, num_hidden_layers=2, l3_after_layer=0, l3_n_emb=4096,
             l3_k_max=64, prompt_len=16, new_tokens=8, batch_sizes="1,2", repeats=1, rounds=1, text_tokens=20_000,
             text_chars=100_000))
    args = l3_offload.Args(device=profile.device, arms="on_device,offloaded,mmap", **sizes)
    output = l3_offload.main(args)
    median = output["median"]
    on_device, offloaded, mapped = median["on_device"], median["offloaded"], median["mmap"]
    rows = []
    for batch in map(int, args.batch_sizes.split(",")):
        key = f"decode_tok_s_batch{batch}"
        rows += [row(f"decode tok/s at batch {batch}, tables offloaded (pinned RAM) vs on-device (d"
                     f"{args.num_hidden_layers}, {args.l3_n_emb} table rows, {args.dtype})", offloaded[key],
                     on_device[key], "on-device", (">=", 0.9)),
                 row(f"decode tok/s at batch {batch}, tables memory-mapped vs on-device", mapped[key], on_device[key],
                     "on-device")]
    loaded = {arm: median[arm].get("gpu_allocated_bytes") for arm in ("on_device", "offloaded")}
    note = None if loaded["on_device"] is not None else "GPU memory is measured on CUDA only"
    gigabytes = {arm: None if loaded[arm] is None else loaded[arm] / 1e9 for arm in loaded}
    rows += [
        row("GPU memory after loading GB, offloaded vs on-device", gigabytes["offloaded"], gigabytes["on_device"],
            "on-device", None, note),
        row("GPU memory saved GB (on-device − offloaded, after loading) vs the tables' bytes",
            None if note else gigabytes["on_device"] - gigabytes["offloaded"], output["table_bytes"] / 1e9,
            "table bytes", None, note),
        row("max |Δ logit| of the prompt, offloaded vs on-device", output["max_abs_logit_diff"]["offloaded"], None,
            None, None, "0 = the same rows are read"),
    ]
    return {"rows": rows, "details": output}


# ---- 8. LoRA SFT: the recipe vs TRL (sft_throughput.py) ------------------------------------------------------------


def run_sft(profile: Profile, report) -> dict:
    sizes = profile.sizes(
        dict(hidden=1024, layers=12, heads=8, n_train=400, batch_size=8, max_length=512, max_steps=25,
             timing_warmup=5),
        dict(hidden=64, layers=2, heads=4, n_train=16, batch_size=2, max_length=128, max_steps=3, timing_warmup=1))
    liger = importlib.util.find_spec("liger_kernel") is not None and profile.device == "cuda"
    cli = [f"--{key}={value}" for key, value in sizes.items()] + [f"--work={Path(profile.work_dir) / 'sft'}"]
    args = sft_throughput.parse_args(cli + ["--rows=hfl3", "--reference=hfl3"])
    args.model = str(sft_throughput.save_tiny_qwen3(Path(args.work) / "qwen3", args.hidden, args.layers, args.heads))
    rows_wanted = ["hfl3", "trl_matched"] + (["trl_liger"] if liger else [])

    def rows_of(results: dict) -> list[dict]:
        hfl3 = results.get("hfl3")
        lines = []
        for trl_row, label in (("trl_matched", "TRL SFTTrainer"), ("trl_liger", "TRL SFTTrainer + use_liger_kernel")):
            trl = results.get(trl_row)
            why = ("needs liger-kernel and a CUDA GPU" if trl_row == "trl_liger" and not liger
                   else missing(hfl3) or missing(trl))
            lines += [
                row(f"tok/s, recipes/sft_lora.py vs {label} (LoRA r=16, bf16 on CUDA, same model, data, batch)",
                    value(hfl3, "tokens_per_s"), value(trl, "tokens_per_s"), trl_row, (">=", 1.2), why),
                row(f"peak memory MiB, recipes/sft_lora.py vs {label}", value(hfl3, "peak_mib"),
                    value(trl, "peak_mib"), trl_row, ("<=", 1.0), why),
            ]
        return lines

    def measure(sft_row: str) -> dict:
        return sft_throughput.run(replace_namespace(args, rows=sft_row, reference=sft_row))["results"][0]

    results = each_arm(rows_wanted, measure, report, rows_of)
    return {"rows": rows_of(results), "details": {"sizes": sizes, "results": results}}


# ---- 9. QLoRA NF4 vs LoRA bf16 at Qwen3-0.6B's shape (qlora_memory.py) ---------------------------------------------


def run_qlora(profile: Profile, report) -> dict:
    sizes = profile.sizes(
        dict(batch_size=8, max_length=512, max_steps=12, timing_warmup=2, n_train=400),
        dict(hidden_size=64, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4, head_dim=16,
             batch_size=1, max_length=32, max_steps=3, timing_warmup=1, n_train=8), dict(max_steps=2))
    args = qlora_memory.QLoRAArguments(work=str(Path(profile.work_dir) / "qlora"), **sizes)
    output = qlora_memory.main(args)
    lines = [row(f"{line['measurement']}, QLoRA NF4 vs LoRA ({line['dtype']}; hidden {args.hidden_size}, "
                 f"{args.num_hidden_layers} layers, {args.batch_size} × {args.max_length} tokens)", line["qlora_nf4"],
                 line["lora"], "LoRA", ("<=", qlora_memory.GOALS[line["key"]]) if line["key"] in qlora_memory.GOALS
                 else None) for line in output["rows"]]
    return {"rows": lines, "details": output}


def replace_namespace(namespace, **changes):
    """A copy of an `argparse.Namespace` with `changes`."""
    return type(namespace)(**(vars(namespace) | changes))


class Section(NamedTuple):
    run: Callable[[Profile, Callable], dict]
    title: str
    share_seconds: int  # of one GPU call (compile and process starts included); stopped beyond it
    requires: tuple[str, ...]  # environment checks (gpu_suite.check_environment) without which it cannot run


# In the order of importance of the measurements owed. Shares from the first H100 run (2026-11-26, dev/LOG.md):
# nanochat's d12 arm took 71 s (63 s of it compiling), each hfl3 arm ~100 s to its first step, MuonAdamW's
# section 56 s. The first three fit one device call of 540 s with the checks and the wheels' installation.
SECTIONS = {
    "pretrain": Section(run_pretrain, "pretraining step vs nanochat at d12", 290, ("hfl3", "datasets")),
    "trainer": Section(run_trainer, "the Trainer path vs a plain loop", 150,
                       ("hfl3", "datasets", "asset:text/tinyshakespeare.txt")),
    "muon_step": Section(run_muon_step, "MuonAdamW.step() vs fused AdamW", 70, ("hfl3",)),
    "fp8": Section(run_fp8, "FP8 tensorwise / rowwise / accelerate's torchao vs bf16 at d20", 360,
                   ("hfl3", "datasets")),
    "loss": Section(run_loss, "the training loss: fused (Liger) vs plain and vs chunked", 75, ("hfl3",)),
    "dense_core": Section(run_dense_core, "the new dense core vs the legacy core", 150, ("hfl3", "datasets")),
    "l3_offload": Section(run_l3_offload, "L3 tables offloaded at inference", 150, ("hfl3", "asset:text/gutenberg")),
    "sft": Section(run_sft, "LoRA SFT: the recipe vs TRL's SFTTrainer", 180,
                   ("hfl3", "datasets", "trl", "peft", "asset:tokenizers/qwen3",
                    "asset:chat/gsm8k_messages_train.jsonl")),
    # bitsandbytes is not among the carried wheels (43 MB): without it the section fails, naming the qlora extra
    "qlora": Section(run_qlora, "QLoRA NF4 vs LoRA bf16 at Qwen3-0.6B's shape: memory, tokens/s", 180,
                     ("hfl3", "datasets", "trl", "peft", "asset:tokenizers/qwen3",
                      "asset:chat/gsm8k_messages_train.jsonl")),
}
