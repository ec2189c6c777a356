"""Every GPU measurement hfl3 owes, in one command, each beside its reference in the same process tree.

    make bench-gpu                                         # on the GPU machine: what fits 540 s, most owed first
    python benchmarks/gpu_suite.py --nanochat_dir build/nanochat --out_dir benchmarks/results
    python benchmarks/gpu_suite.py --sections pretrain,trainer --out_dir "$OUT" --time_limit_s 540   # chosen ones
    python benchmarks/gpu_suite.py --merge a/gpu_suite_h100.json b/gpu_suite_h100.json    # slices -> one file
    python benchmarks/gpu_suite.py --resume                # run what a cut-off run left undone
    python benchmarks/gpu_suite.py --smoke                 # CPU, tiny sizes, compile off (the test suite runs it)
    python benchmarks/gpu_suite.py --dry_run               # CPU, tiny sizes, the GPU run's settings (compile on)
    python benchmarks/gpu_suite.py --prepare --nanochat_dir ~/nanochat   # where PyPI is reachable: wheels, copies

Sections, in order of importance (`gpu_sections.py` says what each measures, with which script and sizes): pretrain,
trainer, muon_step, fp8, loss, dense_core, l3_offload, sft. `--sections auto` (the default) takes them in that order,
those without a committed GPU result (`benchmarks/results/gpu_suite_<gpu>.json`, any GPU) first, and runs each whose
time share fits in what is left of the call (540 s on a GPU by default: one device call), so that successive calls
complete the table instead of repeating its head. Each section runs in its own process group with its share; one
that overruns is killed with every process it started and reported as `overran` with the rows it had finished.
Every process is started fresh (a new interpreter): none is forked from one that may have started threads. The JSON
(`<out_dir>/gpu_suite_<device>.json`) and its markdown table (`.md`: measurement, hfl3, reference, ratio, goal,
pass/fail) are rewritten after every section, so a run cut off still leaves what was done.

First the environment is checked (CUDA, torch, the versions pyproject.toml asks for, the wheels, the nanochat
checkout, the assets): each missing thing is one line saying what to do; sections that need it are skipped.

nanochat is never vendored: its arm runs from `--nanochat_dir` (default `build/nanochat`, git-ignored, copied there
by `--prepare`). Without one, the pretraining section measures hfl3 alone and its rows say
"not available: pass --nanochat_dir" in the reference column — what a CI machine (no checkout, no network) shows.

Pass/fail is judged on a `gpu` run only; `--smoke` and `--dry_run` prove that every section's Python runs (the same
code path with compile on, for `--dry_run`) and fill every field, and say nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpu_sections  # noqa: E402
from gpu_report import render_markdown, write_results  # noqa: E402
from gpu_sections import SECTIONS, Profile  # noqa: E402

REPO = common.REPO_ROOT
# Wheels the GPU image lacks (no network there): downloaded by --prepare into .whl/, installed by `make bench-gpu`
WHEELS = ("transformers==5.23.0", "trl==1.16.0", "datasets==5.2.0", "torchao==0.18.0", "liger-kernel==0.8.5",
          "dill==0.4.1", "multiprocess==0.70.19")
# What the sections read from the assets (the novels: l3_forward.real_text_ids reads the first three)
ASSETS = ("text/tinyshakespeare.txt", "text/gutenberg", "tokenizers/qwen3", "chat/gsm8k_messages_train.jsonl")
GSM8K_RECORDS_COPIED = 1000
# One device call: at most 600 s of command, minus the wheels' installation and a margin for the process ends
GPU_CALL_SECONDS = 540.0
# What the device call carries besides the working tree (all git-ignored), and the size limit on all of it
CARRIED = (".whl", "build/nanochat", "build/assets")
DEVICE_CALL_MIB = 64
WHEELS_FIX = "put its wheel in .whl/ (`make bench-gpu-prepare` where PyPI is reachable) and carry .whl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--sections", default="auto",
                        help="comma-separated, run in this order; auto: by importance, those without a committed GPU "
                             "result first")
    parser.add_argument("--out_dir", default=str(REPO / "benchmarks" / "results"), help="JSON and markdown go here")
    parser.add_argument("--nanochat_dir", default=str(REPO / "build" / "nanochat"), help="a karpathy/nanochat checkout")
    parser.add_argument("--time_limit_s", type=float, default=None,
                        help="whole-run limit: a section whose share does not fit in what is left is skipped "
                             f"(default: {GPU_CALL_SECONDS:.0f} s on a GPU, one device call; none on a CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="the pretraining arms also profile 3 steps after their timed window (torch.profiler) "
                             "and write <arm>_profile.txt into --out_dir")
    parser.add_argument("--resume", action="store_true", help="keep the sections already done in the JSON")
    parser.add_argument("--rounds", type=int, default=gpu_sections.ROUNDS,
                        help="times each A-vs-B section measures its arms, alternating their order (the FP8 pairs: "
                             "once)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, compile off: does every section run?")
    mode.add_argument("--dry_run", action="store_true", help="CPU, tiny sizes, the GPU run's settings")
    mode.add_argument("--merge", nargs="+", metavar="JSON", help="merge these suite JSONs into --out_dir, no run")
    mode.add_argument("--prepare", action="store_true", help="fill .whl/, build/nanochat and build/assets")
    args = parser.parse_args(argv)
    args.section_list = ([] if args.sections == "auto" else
                         [name.strip() for name in args.sections.split(",") if name.strip()])
    unknown = [name for name in args.section_list if name not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    return args


# ---- environment ---------------------------------------------------------------------------------------------------


def _requirement_checks() -> list[dict]:
    """pyproject.toml's dependencies (and the fp8 extra) against what is importable here."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {"torch", "transformers", "accelerate", "peft", "trl", "datasets", "torchao"}
    requirements = [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["fp8"]]
    checks = []
    for requirement in requirements:
        if requirement.name not in wanted:
            continue
        try:
            found = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            found = None
        ok = found is not None and requirement.specifier.contains(found, prereleases=True)
        checks.append({"what": requirement.name, "ok": ok, "found": found, "fix": None if ok else (
            f"{requirement.name} {found or 'is missing'} (hfl3 needs {requirement}): {WHEELS_FIX}")})
    try:
        liger = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        liger = None
    checks.append({"what": "liger_kernel", "ok": liger is not None, "found": liger, "fix": None if liger else (
        f"liger-kernel is missing (the fused loss and TRL's use_liger_kernel row): {WHEELS_FIX}")})
    return checks


def check_environment(profile: Profile, nanochat_dir: str) -> dict:
    """What this machine has for the suite (`nanochat_dir`: the checkout asked for): `{"device", "versions",
    "commit", "checks": [{"what", "ok", "found", "fix"}]}`; run it in a fresh process (it imports torch and hfl3)."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    checks = [{"what": "cuda", "ok": cuda or not profile.gpu, "found": device, "fix": None if cuda or not profile.gpu
               else f"no CUDA GPU visible (torch {torch.__version__}): run on the GPU machine, or --smoke / --dry_run "
                    "on a CPU"}]
    checks += _requirement_checks()
    try:
        importlib.import_module("hfl3")
        checks.append({"what": "hfl3", "ok": True, "found": str(common.shown_path(sys.modules["hfl3"].__file__)),
                       "fix": None})
    except Exception as error:
        checks.append({"what": "hfl3", "ok": False, "found": gpu_sections.one_line(error), "fix": (
            "import hfl3 failed: run from the repository root with PYTHONPATH=src and the wheels installed "
            "(`make bench-gpu` does both)")})
    nanochat = Path(nanochat_dir, "nanochat", "gpt.py").is_file()
    checks.append({"what": "nanochat", "ok": nanochat, "found": common.shown_path(nanochat_dir),
                   "fix": None if nanochat else (
                       f"no nanochat checkout at {common.shown_path(nanochat_dir)} (the pretraining "
                       "section's reference): `make bench-gpu-prepare NANOCHAT_DIR=<a karpathy/nanochat checkout>` "
                       "copies one to build/nanochat; carry build/nanochat")})
    for relative in ASSETS:
        found = common.asset_or_none(relative)
        checks.append({"what": f"asset:{relative}", "ok": found is not None,
                       "found": found and f"{relative} in {common.asset_origin(found)}",
                       "fix": None if found else (
                           f"asset {relative} not found: set HFL3_ASSETS to a folder with the layout of "
                           "tests/fixtures (`make bench-gpu-prepare` copies what the suite reads to build/assets)")})
    from hfl3.provenance import package_versions

    versions = package_versions() | {"torch_cuda": torch.version.cuda}
    return {"device": device, "versions": versions, "checks": checks, "commit": source_commit()}


def source_commit() -> str:
    """`HFL3_COMMIT` when set (a copied checkout's `.git` can be older than its files: the device tool's copy was),
    else the checkout's commit (`git describe --always --dirty`), else "unknown"."""
    if os.environ.get("HFL3_COMMIT"):
        return os.environ["HFL3_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no .git here: set HFL3_COMMIT)"


def device_slug(device: str, profile: Profile) -> str:
    """File-name part for a device: "NVIDIA H100 80GB HBM3" -> "h100_80gb_hbm3"; CPU runs by profile."""
    if not profile.gpu:
        return f"cpu_{profile.name}"
    return re.sub(r"[^a-z0-9]+", "_", device.lower().removeprefix("nvidia").strip()).strip("_")


def measured_on_a_gpu(name: str, results_dir: Path = REPO / "benchmarks" / "results") -> bool:
    """Whether a committed GPU suite result (`gpu_suite_<gpu>.json` of a `gpu` run) holds section `name` finished,
    every goal row with a ratio."""
    for path in results_dir.glob("gpu_suite_*.json"):
        results = json.loads(path.read_text())
        entry = results.get("sections", {}).get(name)
        if results.get("environment", {}).get("profile") != "gpu" or not entry or entry.get("status") != "done":
            continue
        if all(row["ratio"] is not None for row in entry["rows"] if row.get("goal")):
            return True
    return False


def auto_sections(profile: Profile, results_dir: Path = REPO / "benchmarks" / "results") -> list[str]:
    """`--sections auto`: every section by importance; on a GPU, those `measured_on_a_gpu` last."""
    if not profile.gpu:
        return list(SECTIONS)
    return sorted(SECTIONS, key=lambda name: measured_on_a_gpu(name, results_dir))  # stable: by importance within


# ---- one section in its own process group ----------------------------------------------------------------------------

# What a section's process runs: `python -c SECTION_BOOTSTRAP CALL_FILE`, CALL_FILE a pickle of (the parent's
# `sys.path`, the pickled `_section_process` arguments); the path comes first so that the section's function (a
# `gpu_sections` one, or a test's) can be unpickled
SECTION_BOOTSTRAP = """import pickle, sys
path, call = pickle.loads(open(sys.argv[1], "rb").read())
sys.path[:] = path
import gpu_suite
gpu_suite._section_process(*pickle.loads(call))
"""


def _section_process(run_section_of, profile: Profile, partial: str) -> None:
    """Child: run a section (`run_section_of(profile, report)`), writing `{"status", "rows", "details"[, "error"]}` to
    `partial` as it goes."""
    if profile.name == "smoke":  # measures nothing: the arms run in this process, on one thread (tiny matrices gain
        import torch  # nothing from more, and OpenMP's threads spin on busy cores)

        os.environ[common.SAME_PROCESS_VARIABLE] = "1"
        torch.set_num_threads(1)
    from hfl3.atomic import write_json_atomic

    def report(rows: list[dict], details) -> None:
        write_json_atomic(partial, {"status": "running", "rows": rows, "details": details})

    try:
        result = run_section_of(profile, report)
        write_json_atomic(partial, {"status": "done", **result})
    except BaseException as error:
        traceback.print_exc()
        done = json.loads(Path(partial).read_text()) if Path(partial).exists() else {"rows": [], "details": None}
        write_json_atomic(partial, done | {"status": "failed", "error": gpu_sections.one_line(error)})
        sys.exit(1)


def start_section_process(run_section_of, profile: Profile, partial: Path) -> subprocess.Popen:
    """Start `_section_process(run_section_of, profile, partial)` in a new interpreter (never a fork: see
    `common.in_fresh_process`) that leads a process group of its own from before it runs any code
    (`start_new_session`: the child calls `setsid()` between fork and exec, and `Popen` returns only after the exec),
    so that `stop_process_group` can stop it and every process it started at any moment, its first instant included."""
    call = partial.with_suffix(".call.pickle")
    call.write_bytes(pickle.dumps((sys.path, pickle.dumps((run_section_of, profile, str(partial))))))
    return subprocess.Popen([sys.executable, "-c", SECTION_BOOTSTRAP, str(call)], start_new_session=True)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGKILL every process in the group that `process` leads (`start_section_process`), then reap `process`. A group
    already gone (its leader exited and was reaped, and nothing it started is left) is not an error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_section(name: str, profile: Profile, share_seconds: float, scratch: Path) -> dict:
    """Run section `name` in a child process for at most `share_seconds`; the section's JSON entry. Whether the
    section finished, failed, overran or the parent was interrupted, its process group is then killed: nothing it
    started outlives it."""
    partial = scratch / f"{name}.json"
    partial.unlink(missing_ok=True)  # what an earlier run left must not pass for this one's
    started, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    process = start_section_process(SECTIONS[name].run, profile, partial)
    try:
        process.wait(share_seconds)
    except subprocess.TimeoutExpired:  # overran: stopped below
        pass
    finally:
        stop_process_group(process)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the section's processes, once they have ended
    cpu_seconds = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    entry = json.loads(partial.read_text()) if partial.exists() else {"rows": [], "details": None}
    if seconds >= share_seconds and entry.get("status") not in ("done", "failed"):
        entry |= {"status": "overran", "error": f"stopped after its share of {share_seconds:.0f} s"}
    elif entry.get("status") not in ("done", "failed"):
        entry |= {"status": "failed", "error": f"the section's process ended with exit code {process.returncode} "
                                               "(killed? out of memory?) before reporting"}
    if not profile.gpu:  # goals are about GPU speed: a CPU run checks the plumbing and judges nothing
        entry["rows"] = [row | {"passed": None} for row in entry["rows"]]
    return entry | {"seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1), "share_seconds": share_seconds}


# ---- the run -------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    """Check the environment, then run the asked-for sections one after the other within the time limit, rewriting
    the JSON and markdown after each; returns the results."""
    started = time.perf_counter()
    name = "smoke" if args.smoke else "dry_run" if args.dry_run else "gpu"
    nanochat = args.nanochat_dir if Path(args.nanochat_dir, "nanochat", "gpt.py").is_file() else None
    profile = Profile(name=name, device="cuda" if name == "gpu" else "cpu", nanochat_dir=nanochat,
                      work_dir=str(REPO / "outputs" / "gpu_suite"),
                      profile_dir=str(Path(args.out_dir).resolve()) if args.profile else None, rounds=args.rounds)
    environment = common.in_fresh_process(check_environment, profile, args.nanochat_dir)
    failing = {check["what"]: check["fix"] for check in environment["checks"] if not check["ok"]}
    for fix in failing.values():
        print(f"gpu_suite: missing: {fix}", flush=True)
    if "cuda" in failing:
        sys.exit(2)
    out = Path(args.out_dir) / f"gpu_suite_{device_slug(environment['device'], profile)}.json"
    time_limit = args.time_limit_s or (GPU_CALL_SECONDS if profile.gpu else float("inf"))
    sections = args.section_list or auto_sections(profile)
    print(f"gpu_suite: sections {', '.join(sections)}; time limit {time_limit:.0f} s", flush=True)
    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "profile": profile.name, "device": environment["device"], "commit": environment["commit"],
             "versions": environment["versions"]}
    results = json.loads(out.read_text()) if args.resume and out.exists() else {"sections": {}}
    results |= {"environment": stamp | {"checks": environment["checks"]}}
    scratch = Path(profile.work_dir) / "sections"
    scratch.mkdir(parents=True, exist_ok=True)
    for section in sections:
        if results["sections"].get(section, {}).get("status") == "done" and args.resume:
            continue
        requirement = next((failing[need] for need in SECTIONS[section].requires if need in failing), None)
        left = time_limit - (time.perf_counter() - started)
        # a CPU compiles and trains far slower than a GPU: shares there only catch a hang
        share = SECTIONS[section].share_seconds if profile.gpu else 600 if profile.name == "smoke" else 3600
        if requirement or share > left:
            why = requirement or f"its share of {share} s does not fit in the {max(left, 0):.0f} s left of the run's " \
                                 f"{time_limit:.0f} s: a later call runs it"
            entry = {"status": "skipped", "error": why, "rows": [], "details": None, "seconds": 0.0}
        else:
            print(f"gpu_suite: {section} ({SECTIONS[section].title}), share {share:.0f} s", flush=True)
            entry = run_section(section, profile, share, scratch)
        results["sections"][section] = entry | {"run": stamp}
        write_results(out, results)
        cpu = f" ({entry['cpu_seconds']:.0f} s of CPU time)" if "cpu_seconds" in entry else ""
        print(f"gpu_suite: {section}: {entry['status']} in {entry['seconds']:.0f} s{cpu}"
              + (f": {entry['error']}" if entry.get("error") else ""), flush=True)
    print(render_markdown(results))
    print(f"gpu_suite: {time.perf_counter() - started:.0f} s; wrote {out} and {out.with_suffix('.md')}", flush=True)
    return results


def _measured(entry: dict) -> tuple[int, bool]:
    """How many of a section's rows hold an hfl3 number (a section cut off or crashed holds fewer), then whether it
    finished: what `merge` compares."""
    return sum(row.get("hfl3") is not None for row in entry.get("rows", [])), entry["status"] == "done"


def merge(paths: list[str], out_dir: str) -> Path:
    """Merge suite JSONs of one device (a later file's section wins unless it measured fewer rows than the earlier
    one, or as many but did not finish: an overrun that measured more beats a finished run whose arms crashed) into `out_dir`, and write its
    markdown.

    Raises:
        ValueError: the files are from different devices or profiles.
    """
    merged: dict = {"sections": {}}
    for path in paths:
        part = json.loads(Path(path).read_text())
        environment = part["environment"]
        if "environment" in merged and (merged["environment"]["device"], merged["environment"]["profile"]) != (
                environment["device"], environment["profile"]):
            raise ValueError(f"--merge {path}: {environment['device']} ({environment['profile']}) is not "
                             f"{merged['environment']['device']} ({merged['environment']['profile']})")
        merged["environment"] = environment
        for name, entry in part["sections"].items():
            earlier = merged["sections"].get(name)
            if earlier is None or _measured(entry) >= _measured(earlier):
                merged["sections"][name] = entry
    merged["sections"] = {name: merged["sections"][name] for name in SECTIONS if name in merged["sections"]}
    profile = Profile(merged["environment"]["profile"], "cuda")
    out = Path(out_dir) / f"gpu_suite_{device_slug(merged['environment']['device'], profile)}.json"
    write_results(out, merged)
    return out


# ---- preparing a GPU run where PyPI is reachable ---------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> None:
    """Fill what `make bench-gpu` on the GPU machine needs and cannot download there: `.whl/` (the wheels its image
    lacks), `build/nanochat` (a copy of `--nanochat_dir`), `build/assets` (the assets the suite reads that
    tests/fixtures does not have). All three are git-ignored; carry them."""
    source, target = Path(args.nanochat_dir).resolve(), REPO / "build" / "nanochat"
    if not (source / "nanochat" / "gpt.py").is_file():
        sys.exit(f"--nanochat_dir {args.nanochat_dir}: no nanochat/gpt.py there; pass a karpathy/nanochat checkout")
    if source != target.resolve():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".git", ".claude", "__pycache__", "*.png"))
        print(f"copied {source.name} to {common.shown_path(target)}")
    for relative in ASSETS:
        in_repo = REPO / "tests" / "fixtures" / relative
        found = common.asset_or_none(relative)
        if in_repo.exists() or found is None:
            continue
        copy = REPO / "build" / "assets" / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        if relative.endswith(".jsonl"):  # the SFT section reads a few hundred chats
            with open(found, encoding="utf-8") as records:
                copy.write_text("".join(records.readline() for _ in range(GSM8K_RECORDS_COPIED)), encoding="utf-8")
        elif found.is_dir():
            shutil.rmtree(copy, ignore_errors=True)
            files = (sorted(found.glob("*.txt"))[:3] if relative == "text/gutenberg"
                     else [file for file in found.iterdir() if file.is_file()])
            copy.mkdir()
            for file in files:
                shutil.copyfile(file, copy / file.name)
        else:
            shutil.copyfile(found, copy)
        print(f"copied asset {relative} to {common.shown_path(copy)}")
    wheels = REPO / ".whl"
    wheels.mkdir(exist_ok=True)
    platforms = [item for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
                 for item in ("--platform", tag)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS],
                   check=True)
    size = sum(file.stat().st_size for file in wheels.glob("*.whl")) / 2**20
    print(f".whl: {len(list(wheels.glob('*.whl')))} wheels, {size:.0f} MiB.")
    call = device_call()
    travelling = travelling_mib(call["carry"])
    print(f"The device call (the working tree and what it carries: {travelling:.1f} MiB of {DEVICE_CALL_MIB}):\n"
          f"  command: {call['command']}\n  carry: {json.dumps(call['carry'])}\n  timeout_s: {call['timeout_s']}\n"
          "Then commit $OUT's gpu_suite_<gpu>.json and .md into benchmarks/results/ (--merge with the committed "
          "file keeps the sections measured before) and log the numbers in dev/LOG.md.")
    if travelling > DEVICE_CALL_MIB:
        sys.exit(f"what the device call sends is {travelling:.1f} MiB, over its {DEVICE_CALL_MIB} MiB: remove "
                 "untracked files that git does not ignore, or large files from .whl/")


def device_call(commit: str | None = None) -> dict:
    """The device tool's `run` arguments for one suite call: `command` (run in the checkout's copy there; `$OUT` is
    the folder whose files come back; the copy's `.git` may be older than its files, so the commit is passed in
    `HFL3_COMMIT`), `carry` (the prepared git-ignored folders that exist) and `timeout_s` (the call's limit, above
    the suite's own `GPU_CALL_SECONDS`). `BENCH_GPU_MODE=--smoke` in the environment runs the same command on a CPU
    at tiny sizes (the test suite does)."""
    commit = commit or source_commit()
    command = (f'set -o pipefail; HFL3_COMMIT={commit} make bench-gpu BENCH_GPU_ARGS="--out_dir $OUT --profile" '
               '2>&1 | tee $OUT/gpu_suite.log')
    return {"command": command, "carry": [path for path in CARRIED if (REPO / path).exists()], "timeout_s": 600}


def travelling_mib(carry: list[str]) -> float:
    """MiB that a device call sends: the files git tracks or does not ignore, plus the carried folders."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    files = [REPO / name for name in listed if name] + [file for path in carry for file in (REPO / path).rglob("*")]
    return sum(file.stat().st_size for file in files if file.is_file() and not file.is_symlink()) / 2**20


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.merge:
        out = merge(args.merge, args.out_dir)
        print(render_markdown(json.loads(out.read_text())))
        print(f"wrote {out} and {out.with_suffix('.md')}")
        return None
    if args.prepare:
        prepare(args)
        return None
    return run(args)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
