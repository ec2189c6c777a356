"""The sections of `gpu_suite.py`: what each one measures with which existing benchmark, at which sizes, and the rows
(measurement, hfl3, reference, ratio, goal) it reports. Each `run_*` function takes the `Profile` and a `report(rows,
details)` callback (called with the rows so far after each arm, so a section stopped mid-way keeps them) and returns
`{"rows": [...], "details": {...}}`.

Sizes: `gpu` is what the goals are about (nanochat's d12 shape, d20 for FP8); `dry_run` runs the same code path
(every arm, compile and bf16 on) at tiny sizes on a CPU; `smoke` is `dry_run` with compile off and the fewest steps,
the test suite's check that every section still runs.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
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
# Rounds of an A-vs-B section: its arms measured in A B, B A, ... order, each in a fresh process, so that neither
# always runs first (cold disk and compile caches, the GPU's clocks) and the spread of the ratio over the rounds shows
# how far one run can be trusted
ROUNDS = 2


@dataclass(frozen=True)
class Profile:
    """How a run is sized: `name` is gpu, dry_run or smoke; `device` cuda or cpu."""

    name: str
    device: str
    nanochat_dir: str | None = None
    work_dir: str = "outputs/gpu_suite"
    profile_dir: str | None = None  # the pretraining arms write <arm>_profile.txt here (vs_nanochat.StepProfiler)
    rounds: int = ROUNDS  # each A-vs-B section measures its arms this many times, alternating their order

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
        goal: tuple[str, float] | None = None, note: str | None = None,
        spread: tuple[float, float] | None = None) -> dict:
    """One line of the table; `ratio` = hfl3 / reference when both are known (medians over the rounds where the arms
    were measured several times; `spread`: the lowest and highest ratio of a single round, see `ratio_spread`);
    `note` says why a value is missing."""
    ratio = hfl3 / reference if hfl3 is not None and reference else None
    return {"measurement": measurement, "hfl3": hfl3, "reference": reference, "reference_name": reference_name,
            "ratio": ratio, "spread": list(spread) if spread else None, "goal": list(goal) if goal else None,
            "passed": judge(ratio, goal), "note": note}


def alternating(arms: list[str], rounds: int) -> list[str]:
    """The order in which `rounds` rounds measure `arms`: as given, then reversed, and so on (A B, B A, A B, ...)."""
    return [arm for index in range(rounds) for arm in (arms if index % 2 == 0 else arms[::-1])]


def each_arm(arms: list[str], measure, report, rows_of, rounds: int = 1) -> dict[str, list[dict]]:
    """`measure(arm)` for every arm, `rounds` times in `alternating` order (each call measures in a fresh process:
    the caller's job); a measurement that raises is recorded as `{"error": ...}` and the others still run;
    `report(rows_of(results), results)` after each. Returns every arm's measurements in the order taken."""
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for arm in alternating(arms, rounds):
        try:
            results[arm].append(measure(arm))
        except Exception as error:  # one arm's failure must not cost the others' numbers
            traceback.print_exc()
            results[arm].append({"error": one_line(error)})
        report(rows_of(results), results)
    return results


def one_line(error: BaseException) -> str:
    """`Type: last line of the message`, at most 300 characters: what a table cell can hold."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def _measured(result: dict | list[dict] | None, key: str | None = None) -> list[dict]:
    """An arm's measurements (one dict, or the list `each_arm` collects) that did not fail and hold `key`."""
    measurements = [] if result is None else [result] if isinstance(result, dict) else result
    return [m for m in measurements if "error" not in m and (key is None or m.get(key) is not None)]


def missing(result: dict | list[dict] | None, what: str = "not run") -> str | None:
    """Why an arm's numbers are absent: its first error when no measurement succeeded, or `what` when none was
    taken; None when there are numbers."""
    if not result:
        return what
    if _measured(result):
        return None
    return (result if isinstance(result, dict) else result[0]).get("error")


def value(result: dict | list[dict] | None, key: str) -> float | None:
    """An arm's `key`: the median over its successful measurements (one value when measured once), or None."""
    values = [m[key] for m in _measured(result, key)]
    return statistics.median(values) if values else None


def ratio_spread(hfl3: list[dict] | None, reference: list[dict] | None, key: str) -> tuple[float, float] | None:
    """The lowest and highest `hfl3[i][key] / reference[i][key]` over the rounds `i` where both were measured (the
    arms of round i ran next to each other); None with fewer than two such rounds."""
    pairs = [(a, b) for a, b in zip(hfl3 or [], reference or [])
             if _measured(a, key) and _measured(b, key) and b[key]]
    ratios = [a[key] / b[key] for a, b in pairs]
    return (min(ratios), max(ratios)) if len(ratios) >= 2 else None


# ---- 1. pretraining step vs nanochat, and 6. the dense core, 2. FP8: hfl3's Trainer path (vs_nanochat.py) ----------

# Warm-up cut from 10 to 5 steps and the window from 20 to 15 to fit one device call: compilation and autotuning
# happen in step 1, and 15 steps of ~75 ms still span over a second at d12.
PRETRAIN_GPU = dict(depth=12, seq_len=2048, batch_size=16, vocab_size=32768, head_dim=128, steps=15, warmup_steps=5)
PRETRAIN_TINY = dict(depth=2, seq_len=64, batch_size=2, vocab_size=512, head_dim=64, steps=2, warmup_steps=2)
FP8_GPU = PRETRAIN_GPU | dict(depth=20, steps=15, warmup_steps=5)
ONE_STEP = dict(steps=1, warmup_steps=1)


def _vs_nanochat_arms(profile: Profile, sizes: dict, arms: list[str], report, rows_of,
                     profile_dir: str | None = None, rounds: int | None = None) -> dict:
    args = vs_nanochat.VsNanochatArguments(
        nanochat_dir=profile.nanochat_dir, arms=arms, compile=profile.compile, bf16=True,
        dataloader_num_workers=2 if profile.gpu else 0, profile_dir=profile_dir, **sizes)
    results = each_arm(args.arms, lambda arm: vs_nanochat.main(replace(args, arms=[arm]))["results"][0], report,
                       rows_of, profile.rounds if rounds is None else rounds)
    recorded = asdict(args) | {"nanochat_dir": shown_path(args.nanochat_dir)}
    return {"rows": rows_of(results), "details": {"args": recorded, "results": results}}


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _memory_note(profile: Profile) -> str | None:
    return None if profile.device == "cuda" else "peak memory is measured on CUDA only"


def _step_rows(dense, reference, reference_name: str, why: str | None) -> list[dict]:
    """Where a pretraining step's time goes, hfl3 beside `reference`: the process's CPU time per step against the step
    (host-bound when they meet), the device's busy time (its kernels, copies, fills; profiled steps), and the host
    syncs and copies, memsets and device-to-device copies per step."""
    rows = [row("ms/step (wall, CUDA-synchronised window), hfl3 vs " + reference_name, value(dense, "ms_per_step"),
                value(reference, "ms_per_step"), reference_name, None, why,
                ratio_spread(dense, reference, "ms_per_step"))]
    for key, label in (("host_cpu_ms_per_step", "host CPU ms/step (the process's CPU time; ≈ ms/step: host-bound)"),
                       ("device_busy_ms_per_step", "device busy ms/step (kernels, copies, fills; profiled steps)"),
                       ("host_syncs_per_step", "host syncs per step (cuda*Synchronize)"),
                       ("host_copies_per_step", "host copy calls per step (cudaMemcpyAsync)"),
                       ("memsets_per_step", "memsets per step"),
                       ("memcpy_dtod_per_step", "device-to-device copies per step")):
        rows.append(row(f"{label}, hfl3 vs {reference_name}", value(dense, key), value(reference, key),
                        reference_name, None, why))
    return rows


def run_pretrain(profile: Profile, report) -> dict:
    sizes = profile.sizes(PRETRAIN_GPU, PRETRAIN_TINY, ONE_STEP)
    arms = (["nanochat"] if profile.nanochat_dir else []) + ["hfl3"]
    shape = f"d{sizes['depth']}, {sizes['batch_size']}×{sizes['seq_len']}, bf16, compile {_on(profile.compile)}"

    def rows_of(results: dict) -> list[dict]:
        nanochat, dense = results.get("nanochat"), results.get("hfl3")
        why = NANOCHAT_MISSING if not profile.nanochat_dir else missing(nanochat) or missing(dense)
        memory = _memory_note(profile)
        return [
            row(f"tok/s, hfl3 dense vs nanochat ({shape}, Muon)", value(dense, "tok_per_sec"),
                value(nanochat, "tok_per_sec"), "nanochat", (">=", 1.1), why,
                ratio_spread(dense, nanochat, "tok_per_sec")),
            row("MFU %, hfl3 dense vs nanochat", value(dense, "mfu"), value(nanochat, "mfu"), "nanochat", None,
                why or (None if profile.device == "cuda" else "MFU needs a known GPU peak")),
            row("peak memory GB, hfl3 dense vs nanochat", value(dense, "peak_memory_gb"),
                value(nanochat, "peak_memory_gb"), "nanochat", ("<=", 1.0), why or memory,
                ratio_spread(dense, nanochat, "peak_memory_gb")),
            row("compile s (torch._dynamo's compile time, forward and backward graphs; later rounds reuse "
                "Inductor's cache), hfl3 dense vs nanochat", value(dense, "compile_wall_seconds"),
                value(nanochat, "compile_wall_seconds"), "nanochat", ("<=", 1.1), why,
                ratio_spread(dense, nanochat, "compile_wall_seconds")),
            row("first step s beyond a timed one (compile, data loading, optimizer state), hfl3 dense vs nanochat",
                value(dense, "compile_seconds"), value(nanochat, "compile_seconds"), "nanochat", None, why),
            row("compiled graphs, hfl3 dense vs nanochat", value(dense, "compiled_graphs"),
                value(nanochat, "compiled_graphs"), "nanochat", None, why),
            *_step_rows(dense, nanochat, "nanochat", why),
        ]

    return _vs_nanochat_arms(profile, sizes, arms, report, rows_of, profile_dir=profile.profile_dir)


def run_pretrain_l3(profile: Profile, report) -> dict:
    sizes = profile.sizes(PRETRAIN_GPU, PRETRAIN_TINY, ONE_STEP)

    def rows_of(results: dict) -> list[dict]:
        dense, l3 = results.get("hfl3"), results.get("hfl3_l3")
        why = missing(l3) or missing(dense)
        return [
            row(f"tok/s, hfl3 + one L3 layer vs hfl3 dense (d{sizes['depth']}, {sizes['batch_size']}×"
                f"{sizes['seq_len']}, bf16, compile {_on(profile.compile)}, Muon)", value(l3, "tok_per_sec"),
                value(dense, "tok_per_sec"), "hfl3 dense", (">=", 0.9), why,
                ratio_spread(l3, dense, "tok_per_sec")),
            row("peak memory GB, hfl3 + L3 vs hfl3 dense", value(l3, "peak_memory_gb"), value(dense, "peak_memory_gb"),
                "hfl3 dense", None, why or _memory_note(profile), ratio_spread(l3, dense, "peak_memory_gb")),
            row("compile s, hfl3 + L3 vs hfl3 dense", value(l3, "compile_seconds"), value(dense, "compile_seconds"),
                "hfl3 dense", None, why),
            *_step_rows(l3, dense, "hfl3 dense", why),
        ]

    return _vs_nanochat_arms(profile, sizes, ["hfl3", "hfl3_l3"], report, rows_of, profile_dir=profile.profile_dir)


FP8_ARMS = {"hfl3_fp8_tensorwise": "tensorwise (hfl3 Float8Linear)", "hfl3_fp8_rowwise": "rowwise (hfl3 Float8Linear)",
            "hfl3_fp8_ao": "tensorwise via accelerate's torchao backend"}
ARM_NAMES = {"hfl3": "bf16", **FP8_ARMS}
# One d20 arm takes ~220 s on an H200 (132 s of it compiling; dev/LOG.md 2026-11-28), so an FP8 section measures one
# pair, once, per device call: bf16 vs tensorwise (the goal), then rowwise and accelerate's backend each against
# tensorwise, in later calls
FP8_ROUNDS_NOTE = "one round (a d20 arm takes ~220 s: two fit one device call)"


def run_fp8_pair(arms: tuple[str, str], goal: tuple[str, float] | None, profile: Profile, report) -> dict:
    """FP8 at d20, `arms[1]` vs `arms[0]` (each an arm of vs_nanochat.py), one round."""
    sizes = profile.sizes(FP8_GPU, PRETRAIN_TINY, ONE_STEP)
    torchao = importlib.util.find_spec("torchao") is not None
    candidate, reference = arms[1], arms[0]
    name, reference_name = ARM_NAMES[candidate], ARM_NAMES[reference]

    def rows_of(results: dict) -> list[dict]:
        ours, theirs = results.get(candidate), results.get(reference)
        why = ("torchao is not installed: carry its wheel in .whl" if "hfl3_fp8_ao" in arms and not torchao
               else missing(ours) or missing(theirs))
        rows = [row(f"tok/s, FP8 {name} vs {reference_name} (d{sizes['depth']}, compile {_on(profile.compile)}, "
                    "Muon)", value(ours, "tok_per_sec"), value(theirs, "tok_per_sec"), reference_name, goal,
                    why or FP8_ROUNDS_NOTE),
                row(f"peak memory GB, FP8 {name} vs {reference_name}", value(ours, "peak_memory_gb"),
                    value(theirs, "peak_memory_gb"), reference_name, None, why or _memory_note(profile)),
                row(f"compile s, FP8 {name} vs {reference_name}", value(ours, "compile_seconds"),
                    value(theirs, "compile_seconds"), reference_name, None, why)]
        if reference == "hfl3":
            rows.insert(0, row(f"MFU %, hfl3 bf16 (d{sizes['depth']})", value(theirs, "mfu"), None, None, None,
                               missing(theirs) or (None if profile.device == "cuda" else "MFU needs a known GPU peak")))
        return rows

    if "hfl3_fp8_ao" in arms and not torchao:
        return {"rows": rows_of({}), "details": None}
    return _vs_nanochat_arms(profile, sizes, list(arms), report, rows_of, rounds=1)


def run_dense_core(profile: Profile, report) -> dict:
    sizes = profile.sizes(PRETRAIN_GPU, PRETRAIN_TINY, ONE_STEP)

    def rows_of(results: dict) -> list[dict]:
        new, legacy = results.get("hfl3"), results.get("hfl3_legacy")
        why = missing(new) or missing(legacy)
        return [
            row(f"tok/s, new dense core (value embeddings, smear, backout) vs legacy core (d{sizes['depth']})",
                value(new, "tok_per_sec"), value(legacy, "tok_per_sec"), "legacy core", None, why,
                ratio_spread(new, legacy, "tok_per_sec")),
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
                    value(hfl3, "tokens_per_s"), value(trl, "tokens_per_s"), trl_row, (">=", 1.2), why,
                    ratio_spread(hfl3, trl, "tokens_per_s")),
                row(f"peak memory MiB, recipes/sft_lora.py vs {label}", value(hfl3, "peak_mib"),
                    value(trl, "peak_mib"), trl_row, ("<=", 1.0), why, ratio_spread(hfl3, trl, "peak_mib")),
            ]
        return lines

    def measure(sft_row: str) -> dict:
        return sft_throughput.run(replace_namespace(args, rows=sft_row, reference=sft_row))["results"][0]

    results = each_arm(rows_wanted, measure, report, rows_of, profile.rounds)
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


# In the order of importance of the measurements owed. Shares from the H200 run of 2026-11-28 (dev/LOG.md): a d12
# nanochat arm took 75 s (68 s of it compiling), an hfl3 arm 108 s, a d20 arm ~220 s; an A-vs-B section measures
# each arm twice (`ROUNDS`), the second time with Inductor's caches warm. A device call holds 540 s, the checks and
# the wheels' installation (~30 s) included.
SECTIONS = {
    "pretrain": Section(run_pretrain, "pretraining step vs nanochat at d12", 330, ("hfl3", "datasets")),
    "pretrain_l3": Section(run_pretrain_l3, "pretraining step with one L3 layer vs dense at d12", 400,
                           ("hfl3", "datasets")),
    "sft": Section(run_sft, "LoRA SFT: the recipe vs TRL's SFTTrainer", 240,
                   ("hfl3", "datasets", "trl", "peft", "asset:tokenizers/qwen3",
                    "asset:chat/gsm8k_messages_train.jsonl")),
    "fp8": Section(functools.partial(run_fp8_pair, ("hfl3", "hfl3_fp8_tensorwise"), (">=", 1.2)),
                   "FP8 tensorwise vs bf16 at d20", 480, ("hfl3", "datasets")),
    "trainer": Section(run_trainer, "the Trainer path vs a plain loop", 150,
                       ("hfl3", "datasets", "asset:text/tinyshakespeare.txt")),
    "muon_step": Section(run_muon_step, "MuonAdamW.step() vs fused AdamW", 70, ("hfl3",)),
    "loss": Section(run_loss, "the training loss: fused (Liger) vs plain and vs chunked", 75, ("hfl3",)),
    "dense_core": Section(run_dense_core, "the new dense core vs the legacy core", 300, ("hfl3", "datasets")),
    "l3_offload": Section(run_l3_offload, "L3 tables offloaded at inference", 150, ("hfl3", "asset:text/gutenberg")),
    "fp8_rowwise": Section(functools.partial(run_fp8_pair, ("hfl3_fp8_tensorwise", "hfl3_fp8_rowwise"), None),
                           "FP8 rowwise vs tensorwise at d20", 480, ("hfl3", "datasets")),
    "fp8_ao": Section(functools.partial(run_fp8_pair, ("hfl3_fp8_tensorwise", "hfl3_fp8_ao"), None),
                      "FP8 through accelerate's torchao backend vs hfl3's tensorwise at d20", 480,
                      ("hfl3", "datasets")),
    # bitsandbytes is not among the carried wheels (43 MB): without it the section fails, naming the qlora extra
    "qlora": Section(run_qlora, "QLoRA NF4 vs LoRA bf16 at Qwen3-0.6B's shape: memory, tokens/s", 180,
                     ("hfl3", "datasets", "trl", "peft", "asset:tokenizers/qwen3",
                      "asset:chat/gsm8k_messages_train.jsonl")),
}
