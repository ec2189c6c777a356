"""Plumbing of the benchmarks: FLOPs accounting and time bookkeeping of l3_vs_dense, that trainer_overhead's plain
loop is step-for-step equivalent to the Trainer; the GPU suite (`benchmarks/gpu_suite.py`): its `--smoke` run fills
every section's fields on a CPU, a section over its time share is stopped with the rows it had, slices merge, assets
are looked up in order. No speed is asserted (speed lives in the benchmark tables)."""

import argparse
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from hfl3 import L3GPTConfig
from hfl3.models.l3gpt.configuration_l3gpt import flops_per_token
from hfl3.tokenization import train_tokenizer


@pytest.fixture(scope="module")
def bench(repo_root):
    sys.path.insert(0, str(repo_root / "benchmarks"))
    import l3_flops
    import l3_vs_dense
    import text_corpus
    import trainer_overhead
    import vs_nanochat

    yield l3_vs_dense, trainer_overhead, vs_nanochat, l3_flops, text_corpus
    sys.path.remove(str(repo_root / "benchmarks"))


@pytest.fixture(scope="module")
def suite(repo_root):
    """The GPU suite's modules: (common, gpu_sections, gpu_suite)."""
    sys.path.insert(0, str(repo_root / "benchmarks"))
    import common
    import gpu_sections
    import gpu_suite

    yield common, gpu_sections, gpu_suite
    sys.path.remove(str(repo_root / "benchmarks"))


def test_l3_lookup_flops_count_scores_and_weighted_sum(bench):
    l3_lookup_flops_per_token = bench[3].l3_lookup_flops_per_token
    config = L3GPTConfig(vocab_size=512, hidden_size=64, num_attention_heads=1, num_hidden_layers=2,
                         l3_after_layers=[0, 1])
    # per layer: (2·d·C scores + 2·d·C weighted sum) forward, ×3 with backward; two L3 layers
    assert l3_lookup_flops_per_token(config, 5.0) == 2 * 3 * (2 + 2) * 5.0 * 64
    dense = L3GPTConfig(vocab_size=512, hidden_size=64, num_attention_heads=1, num_hidden_layers=2)
    assert l3_lookup_flops_per_token(dense, 5.0) == 0


def test_in_memory_corpus_keeps_files_whole(bench, assets):
    corpus, opened = bench[4].load_corpus(str(assets / "text" / "tinyshakespeare.txt"))
    assert len(corpus) == 1 and corpus["text"][0] == (assets / "text" / "tinyshakespeare.txt").read_text()
    assert opened.files[0].name == "tinyshakespeare.txt"


def test_widened_dense_model_matches_l3_flops(bench, assets):
    l3_vs_dense = bench[0]
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:200_000]
    tokenizer = train_tokenizer([text], 2048)
    args = l3_vs_dense.BenchmarkArguments()
    l3_config = l3_vs_dense.make_config(args, tokenizer, with_l3=True)
    target = flops_per_token(l3_config, args.seq_len) + bench[3].l3_lookup_flops_per_token(l3_config, 20.0)
    hidden = l3_vs_dense.widened_hidden_size(args, tokenizer, target)
    wide = l3_vs_dense.make_config(args, tokenizer, with_l3=False, hidden_size=hidden)
    assert hidden > l3_config.hidden_size and not wide.l3_after_layers
    assert wide.num_attention_heads == l3_config.num_attention_heads
    assert wide.head_dim * wide.num_attention_heads == hidden
    step = 2 * wide.num_attention_heads
    misses = {h: abs(flops_per_token(l3_vs_dense.make_config(args, tokenizer, False, h), args.seq_len) - target)
              for h in (hidden - step, hidden, hidden + step)}
    assert misses[hidden] == min(misses.values())
    assert misses[hidden] / target < 0.02


def test_eval_clock_excludes_evaluation_time(bench, monkeypatch):
    l3_vs_dense = bench[0]
    clock = l3_vs_dense.EvalClock(flops_per_step=10.0)
    ticks = iter([(0.0, 0.0), (1.0, 0.5), (3.0, 1.5), (4.0, 2.0), (5.0, 2.5)])
    monkeypatch.setattr(l3_vs_dense.EvalClock, "_now", staticmethod(lambda: next(ticks)))
    state = type("State", (), {"global_step": 0})()
    clock.on_evaluate(None, state, None, metrics={"eval_bpb": 4.0})  # before training: step 0
    clock.on_train_begin(None, state, None)  # t = 0
    state.global_step = 1
    clock.on_step_end(None, state, None)  # t = 1
    clock.on_evaluate(None, state, None, metrics={"eval_bpb": 3.0})  # evaluation 1 → 3
    state.global_step = 2
    clock.on_step_end(None, state, None)  # t = 4
    clock.on_evaluate(None, state, None, metrics={"eval_bpb": 2.0})
    assert [(p["step"], p["flops"], p["seconds"], p["cpu_seconds"], p["bpb"]) for p in clock.points] == [
        (0, 0.0, 0.0, 0.0, 4.0), (1, 10.0, 1.0, 0.5, 3.0), (2, 20.0, 2.0, 1.0, 2.0)]


def test_summary_interpolates_at_common_budgets(bench):
    l3_vs_dense = bench[0]

    def run(arm, seed, flops, seconds, bpbs):
        points = [dict(step=i, flops=f, seconds=s, cpu_seconds=s, bpb=b)
                  for i, (f, s, b) in enumerate(zip(flops, seconds, bpbs))]
        return dict(arm=arm, seed=seed, points=points, final_bpb=bpbs[-1], flops_per_token=1.0, hidden_size=8,
                    dense_parameters=1, table_parameters=0, tok_per_sec=1.0, tok_per_cpu_sec=2.0)

    runs = [run("dense", 0, [0, 10, 20], [0, 5, 10], [4.0, 3.0, 2.0]),
            run("l3", 0, [0, 15, 30], [0, 10, 20], [4.0, 2.5, 1.5])]
    summary = l3_vs_dense.summarize(runs, ["dense", "l3"], {"dense": 2**20, "l3": 2**21})
    assert summary["budgets"] == {"flops": 20, "seconds": 10, "cpu_seconds": 10}
    l3 = summary["arms"]["l3"]
    assert l3["bpb_equal_steps"] == [1.5] and l3["peak_memory_mb"] == 2.0
    assert l3["bpb_equal_flops"] == [pytest.approx(2.5 - 1.0 * 5 / 15)]
    assert l3["bpb_equal_seconds"] == [pytest.approx(2.5)]
    assert summary["arms"]["dense"]["bpb_equal_flops"] == [pytest.approx(2.0)]


@pytest.mark.slow
def test_plain_loop_is_step_for_step_equivalent_to_trainer(bench, assets, tmp_path):
    trainer_overhead = bench[1]
    args = trainer_overhead.OverheadArguments(
        text_file=str(assets / "text" / "tinyshakespeare.txt"), vocab_size=512, seq_len=64, batch_size=4,
        aspect_ratio=32, head_dim=32, steps=3, warmup_steps=1, rounds=1,
    )
    tokenizer, packed, sample = trainer_overhead.build_data(args)
    result = trainer_overhead.run_round(args, tokenizer, packed, sample, str(tmp_path), seed=0)
    assert len(result["trainer"]) == 3 and len(result["plain"]) == 3
    assert result["max_abs_param_difference"] == 0.0


def _two_host_reads(x):
    return x.sum().item() + x.max().item()


def test_the_profile_names_the_code_behind_each_host_copy_and_sync(bench):
    """`vs_nanochat.call_sources` (the profile table's sources section) attributes each sync or copy to its op and the
    innermost Python frames outside torch, from a profile taken with stacks: here two `.item()`s per call."""
    vs_nanochat = bench[2]
    x = torch.randn(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as profile:
        for _ in range(3):
            _two_host_reads(x)
    [(source, count)] = vs_nanochat.call_sources(profile.events(), vs_nanochat.SOURCED_CALLS, frames=1)
    assert count == 6 and source.startswith("aten::item < test_benchmarks_smoke.py(") and "_two_host_reads" in source


def test_vs_nanochat_refuses_a_folder_without_nanochat(bench, tmp_path):
    with pytest.raises(ValueError, match="no nanochat/gpt.py"):
        bench[2].VsNanochatArguments(nanochat_dir=str(tmp_path))


# Rows that a CPU run cannot fill, each with the note that says why; every other hfl3 and reference value must be a
# number. nanochat's arm is filled where a checkout is at build/nanochat (git-ignored, never in CI), else its rows
# carry NANOCHAT_MISSING.
CPU_ONLY_NOTES = {"peak memory is measured on CUDA only", "MFU needs a known GPU peak",
                  "GPU memory is measured on CUDA only", "needs liger-kernel and a CUDA GPU"}


@pytest.mark.slow
@pytest.mark.parametrize("sections", ["pretrain", pytest.param(None, id="every", marks=pytest.mark.extended)])
def test_the_device_call_runs_its_sections_at_smoke_sizes_and_fills_their_fields(suite, repo_root, tmp_path, sections):
    """The device call as printed, at smoke sizes: `pretrain` (the first section of every GPU call, with the profiles)
    in make test; every section (~4 minutes here) in make test-extended and before each GPU call in make
    bench-gpu-prepare."""
    common, gpu_sections, gpu_suite = suite
    have_nanochat = (repo_root / "build" / "nanochat" / "nanochat" / "gpt.py").is_file()
    # the device call `make bench-gpu-prepare` prints, run as a user runs it: no thread variables set
    command = gpu_suite.device_call()["command"]
    environment = {key: value for key, value in os.environ.items() if not key.endswith("_NUM_THREADS")}
    mode = "--smoke" + (f" --sections {sections}" if sections else "")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=repo_root,
                          env=environment | {"OUT": str(tmp_path), "BENCH_GPU_MODE": mode})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected = [sections] if sections else list(gpu_sections.SECTIONS)
    ordered = f"{sections};" if sections else "pretrain, pretrain_l3, sft"  # auto: by importance
    assert f"gpu_suite: sections {ordered}" in (tmp_path / "gpu_suite.log").read_text()
    assert {path.name for path in tmp_path.glob("*_profile.txt")} == (
        {"hfl3_profile.txt"} | ({"hfl3_l3_profile.txt"} if not sections else set())
        | ({"nanochat_profile.txt"} if have_nanochat else set()))
    results = json.loads((tmp_path / "gpu_suite_cpu_smoke.json").read_text())
    markdown = (tmp_path / "gpu_suite_cpu_smoke.md").read_text()
    assert list(results["sections"]) == expected
    checks = {check["what"]: check for check in results["environment"]["checks"]}
    assert checks["nanochat"]["ok"] is have_nanochat and checks["hfl3"]["ok"] and checks["cuda"]["found"] == "CPU"
    nanochat_missing = {gpu_sections.NANOCHAT_MISSING} if not have_nanochat else set()
    for name, entry in results["sections"].items():
        assert entry["status"] == "done", (name, entry.get("error"))
        assert entry["rows"] and f"`{name}`" in markdown
        for row in entry["rows"]:
            assert row["hfl3"] is not None or row["note"] in CPU_ONLY_NOTES | nanochat_missing, (name, row)
            if row["reference_name"]:
                assert row["reference"] is not None or row["note"] in CPU_ONLY_NOTES | nanochat_missing, (name, row)
            if row["hfl3"] is not None and row["reference"]:
                assert row["ratio"] == pytest.approx(row["hfl3"] / row["reference"])
            assert row["passed"] is None  # a CPU run judges no goal
        arms = (entry["details"] or {}).get("results")  # per arm where a section runs arms that may fail alone
        if isinstance(arms, dict):
            assert not [arm for arm, runs in arms.items() for run in runs if "error" in run], (name, arms)
    pretrain = results["sections"]["pretrain"]
    # every arm measured once per round, in alternating order (A B, then B A), and the ratios carry the rounds' range
    assert {arm: len(runs) for arm, runs in pretrain["details"]["results"].items()} == (
        {"hfl3": gpu_sections.ROUNDS} | ({"nanochat": gpu_sections.ROUNDS} if have_nanochat else {}))
    assert (pretrain["rows"][0]["spread"] is not None) is have_nanochat
    assert [row["note"] == gpu_sections.NANOCHAT_MISSING for row in pretrain["rows"]][:4] == [not have_nanochat] * 4
    dense = pretrain["details"]["results"]["hfl3"][0]
    sizes = gpu_sections.PRETRAIN_TINY
    config = L3GPTConfig.from_depth(sizes["depth"], vocab_size=sizes["vocab_size"], head_dim=sizes["head_dim"],
                                    max_position_embeddings=sizes["seq_len"], window_pattern="L")
    assert dense["flops_per_token"] == flops_per_token(config, sizes["seq_len"]) and dense["table_parameters"] == 0
    if "fp8" in expected:
        assert set(results["sections"]["fp8"]["details"]["results"]) == {"hfl3", "hfl3_fp8_tensorwise"}
    if "pretrain_l3" in expected:  # two arms in every checkout: the rounds' range is there
        l3_rows = results["sections"]["pretrain_l3"]["rows"]
        first_row = next(line for line in markdown.split("`pretrain_l3`")[1].splitlines() if line.startswith("| tok/s"))
        assert l3_rows[0]["spread"] is not None and "–" in first_row.split("|")[4]  # the ratio cell: its range
    assert "| measurement | hfl3 | reference | ratio (rounds' range) | goal | pass/fail | note |" in markdown


def test_a_sections_arms_alternate_over_the_rounds_and_their_ratios_carry_the_spread(suite):
    gpu_sections = suite[1]
    order, reported = [], []
    tok_per_sec = {"a": iter([100.0, 120.0]), "b": iter([50.0, 40.0])}

    def measure(arm):
        order.append(arm)
        return {"tok_per_sec": next(tok_per_sec[arm])}

    results = gpu_sections.each_arm(["a", "b"], measure, lambda rows, details: reported.append(rows),
                                    lambda results: [len(results["a"]) + len(results["b"])], rounds=2)
    assert order == ["a", "b", "b", "a"] and reported == [[1], [2], [3], [4]]
    assert gpu_sections.value(results["a"], "tok_per_sec") == 110.0  # the median over the rounds
    assert gpu_sections.ratio_spread(results["a"], results["b"], "tok_per_sec") == (2.0, 3.0)  # per round: 2, 3
    failed = gpu_sections.each_arm(["a"], lambda arm: 1 / 0, lambda *_: None, lambda results: [], rounds=2)
    assert gpu_sections.missing(failed["a"]).startswith("ZeroDivisionError") and gpu_sections.value(failed["a"], "x") is None
    row = gpu_sections.row("m", 2.0, 1.0, "ref", spread=(1.9, 2.1))
    assert row["spread"] == [1.9, 2.1] and row["ratio"] == 2.0


def _finished_section(profile, report):
    rows = [{"measurement": "done", "hfl3": 3.0}]
    report(rows, None)
    return {"rows": rows, "details": None}


def _overrunning_section(profile, report):
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    report([{"measurement": "done before the stop", "hfl3": 1.0}], {"grandchild": grandchild.pid})
    time.sleep(120)


def _failing_section(profile, report):
    report([{"measurement": "done before the error", "hfl3": 2.0}], None)
    raise RuntimeError("first line\nthe reason")


def _exiting_section(profile, report):
    os._exit(3)  # before reporting anything, leaving nothing behind in its process group


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# A share that only guards against a hang, for a fake section that ends by itself
HANG_GUARD_S = 600.0


def run_fake_section(suite, monkeypatch, tmp_path, section, share):
    common, gpu_sections, gpu_suite = suite
    monkeypatch.setitem(gpu_sections.SECTIONS, "fake", gpu_sections.Section(section, "fake", 1, ()))
    return gpu_suite.run_section("fake", gpu_sections.Profile("smoke", "cpu"), share, tmp_path)


def test_a_section_that_finishes_fails_or_overruns_keeps_the_rows_it_reported(suite, monkeypatch, tmp_path):
    """The overrunning section's share is derived from what it waits for: the time the finished section took to
    start a process, import, report and end on this machine, now (about 3 s quiet, far more beside other work)."""
    finished = run_fake_section(suite, monkeypatch, tmp_path, _finished_section, HANG_GUARD_S)
    assert (finished["status"], finished["rows"]) == ("done", [{"measurement": "done", "hfl3": 3.0, "passed": None}])
    failed = run_fake_section(suite, monkeypatch, tmp_path, _failing_section, HANG_GUARD_S)
    assert (failed["status"], failed["error"]) == ("failed", "RuntimeError: the reason")
    assert failed["rows"] == [{"measurement": "done before the error", "hfl3": 2.0, "passed": None}]

    start_s = max(finished["seconds"], failed["seconds"])
    share = round(3 * start_s + 5)  # the report comes as soon as in the finished section: 3x its time, and then some
    overran = run_fake_section(suite, monkeypatch, tmp_path, _overrunning_section, share)
    assert (overran["status"], overran["error"]) == ("overran", f"stopped after its share of {share} s")
    assert overran["rows"] == [{"measurement": "done before the stop", "hfl3": 1.0, "passed": None}]
    assert share <= overran["seconds"] < share + start_s + 10  # stopped at its share, not when the section ended
    grandchild = overran["details"]["grandchild"]  # what the section started was stopped with it (one group)
    deadline = time.monotonic() + start_s + 10  # SIGKILL is immediate; its delivery, like a start, waits for a core
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(grandchild)


def test_a_section_killed_before_its_group_forms_or_after_it_exited_is_reported_not_raised(suite, monkeypatch,
                                                                                           tmp_path):
    """A share of 0 s kills the section's process the instant it is started, before it could run a line (the suite
    used to make the group from inside the spawned child, after its imports: the kill raised ProcessLookupError and
    ended the suite); a section that exits by itself has its group killed after the exit, when no process is left
    in it: reported as `failed` with its exit code, not raised."""
    real_killpg, kills = os.killpg, []

    def killpg(pgid, signal_number):
        try:
            real_killpg(pgid, signal_number)
            kills.append((pgid, "killed"))
        except ProcessLookupError:
            kills.append((pgid, "gone"))
            raise

    monkeypatch.setattr(os, "killpg", killpg)
    at_once = run_fake_section(suite, monkeypatch, tmp_path, _overrunning_section, 0.0)
    assert (at_once["status"], at_once["error"], at_once["rows"]) == ("overran", "stopped after its share of 0 s", [])
    assert [outcome for _, outcome in kills] == ["killed"] and _gone(kills[0][0])

    exited = run_fake_section(suite, monkeypatch, tmp_path, _exiting_section, HANG_GUARD_S)
    assert (exited["status"], exited["rows"]) == ("failed", [])
    assert exited["error"].startswith("the section's process ended with exit code 3 ")
    assert [outcome for _, outcome in kills] == ["killed", "gone"]  # the group was killed after it had emptied


@pytest.mark.parametrize("hfl3, reference, goal, ratio, passed", [
    (2.0, 1.0, (">=", 1.1), 2.0, True),
    (1.0, 1.0, (">=", 1.1), 1.0, False),
    (1.0, 2.0, ("<=", 1.0), 0.5, True),
    (3.0, 2.0, ("<=", 1.0), 1.5, False),
    (1.0, None, (">=", 1.1), None, None),
    (None, 1.0, (">=", 1.1), None, None),
    (1.0, 2.0, None, 0.5, None),
])
def test_rows_compute_ratio_and_judge_the_goal(suite, hfl3, reference, goal, ratio, passed):
    row = suite[1].row("m", hfl3, reference, "ref", goal)
    assert (row["ratio"], row["passed"]) == (ratio, passed)


def test_merge_keeps_finished_sections_and_refuses_another_device(suite, tmp_path):
    gpu_suite = suite[2]

    def row(hfl3):
        return suite[1].row("m", hfl3, 1.0, "ref")

    def part(device: str, sections: dict, measured: tuple = ()) -> str:
        environment = {"date": "2026-11-25T10:00:00+00:00", "profile": "gpu", "device": device, "commit": "abc",
                       "versions": {}, "checks": []}
        entries = {name: {"status": status, "rows": [row(1.0 if name in measured else None)],
                          "details": None, "seconds": 1.0, "run": environment}
                   for name, status in sections.items()}
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"environment": environment, "sections": entries}))
        return str(path)

    first = part("NVIDIA H100 80GB HBM3", {"pretrain": "done", "fp8": "overran", "sft": "done", "loss": "done"})
    second = part("NVIDIA H100 80GB HBM3", {"fp8": "done", "pretrain": "failed", "trainer": "done",
                                            "loss": "overran"}, measured=("loss",))
    out = gpu_suite.merge([first, second], str(tmp_path / "merged"))
    assert out.name == "gpu_suite_h100_80gb_hbm3.json" and out.with_suffix(".md").exists()
    merged = json.loads(out.read_text())["sections"]
    # a later section wins unless it measured less, or as much without finishing; an overrun that measured more
    # rows (loss) beats a finished section whose arms crashed
    assert {name: entry["status"] for name, entry in merged.items()} == {
        "pretrain": "done", "fp8": "done", "trainer": "done", "sft": "done", "loss": "overran"}
    assert list(merged) == ["pretrain", "sft", "fp8", "trainer", "loss"]  # the suite's order
    other = part("NVIDIA H200", {"loss": "done"})
    with pytest.raises(ValueError, match="NVIDIA H200 .gpu. is not NVIDIA H100"):
        gpu_suite.merge([first, other], str(tmp_path / "merged"))


def test_auto_runs_the_sections_without_a_committed_gpu_result_first(suite, tmp_path):
    common, gpu_sections, gpu_suite = suite

    def result(profile: str, device: str, sections: dict) -> dict:
        return {"environment": {"profile": profile, "device": device},
                "sections": {name: {"status": status, "rows": [gpu_sections.row("m", hfl3, 1.0, "ref", (">=", 1.1))]}
                             for name, (status, hfl3) in sections.items()}}

    (tmp_path / "gpu_suite_h100_80gb_hbm3.json").write_text(json.dumps(result("gpu", "NVIDIA H100 80GB HBM3", {
        "muon_step": ("done", 2.3), "pretrain": ("done", None), "trainer": ("failed", None)})))
    (tmp_path / "gpu_suite_h200.json").write_text(json.dumps(result("gpu", "NVIDIA H200", {"loss": ("done", 0.5)})))
    (tmp_path / "gpu_suite_cpu_smoke.json").write_text(json.dumps(result("smoke", "CPU", {"fp8": ("done", 1.0)})))
    order = gpu_suite.auto_sections(gpu_sections.Profile("gpu", "cuda"), tmp_path)
    # a section counts as measured when a GPU run finished it with every goal's ratio: muon_step and loss, not
    # pretrain (its hfl3 value missing), trainer (failed) or fp8 (a CPU run)
    assert order == ["pretrain", "pretrain_l3", "sft", "fp8", "trainer", "dense_core", "l3_offload", "fp8_rowwise",
                     "fp8_ao", "qlora", "muon_step", "loss"]
    assert gpu_suite.auto_sections(gpu_sections.Profile("smoke", "cpu"), tmp_path) == list(gpu_sections.SECTIONS)


def test_a_section_whose_share_does_not_fit_in_the_time_left_is_skipped_for_a_later_call(suite, tmp_path):
    common, gpu_sections, gpu_suite = suite
    results = gpu_suite.main(["--smoke", "--sections", "loss,muon_step", "--time_limit_s", "300",
                              "--out_dir", str(tmp_path)])  # a smoke section's share is 600 s
    for name in ("loss", "muon_step"):
        entry = results["sections"][name]
        assert (entry["status"], entry["seconds"], entry["rows"]) == ("skipped", 0.0, [])
        assert entry["error"].startswith("its share of 600 s does not fit in the ")
        assert entry["error"].endswith(" s left of the run's 300 s: a later call runs it")


def test_assets_are_looked_up_in_hfl3_assets_then_fixtures_then_beside_the_checkout(suite, monkeypatch, tmp_path):
    common = suite[0]
    repo, beside, chosen = tmp_path / "repo", tmp_path / "shared" / "assets", tmp_path / "chosen"
    for root, files in ((repo / "tests" / "fixtures", ["a.txt", "b.txt"]), (beside, ["a.txt", "b.txt", "c.txt"]),
                        (chosen, ["a.txt"])):
        for name in files:
            (root / "text").mkdir(parents=True, exist_ok=True)
            (root / "text" / name).write_text(name)
    monkeypatch.setattr(common, "REPO_ROOT", repo)
    monkeypatch.setenv("HFL3_ASSETS", str(chosen))
    assert [common.find_asset(f"text/{name}") for name in ("a.txt", "b.txt", "c.txt")] == [
        chosen / "text" / "a.txt", repo / "tests" / "fixtures" / "text" / "b.txt", beside / "text" / "c.txt"]
    monkeypatch.setenv("HFL3_ASSETS", "")
    assert common.find_asset("text/a.txt") == repo / "tests" / "fixtures" / "text" / "a.txt"
    with pytest.raises(FileNotFoundError, match="asset text/d.txt not found .* set HFL3_ASSETS"):
        common.find_asset("text/d.txt")
    assert common.asset_or_none("text/d.txt") is None


def test_model_shape_fills_only_unset_flags_and_gives_the_scripts_config(suite, tmp_path):
    common = suite[0]
    args = argparse.Namespace(depth=None, vocab_size=4000, seq_len=None, steps=None)
    common.CPU_SHAPE.fill(args)
    assert vars(args) == {"depth": 2, "vocab_size": 4000, "seq_len": 128, "steps": None}  # no field args lacks
    shape = common.ModelShape.of(args, head_dim=32)
    assert (shape.batch_size, shape.aspect_ratio) == (None, 64)
    config = shape.config(window_pattern="L")
    assert config.to_dict() == L3GPTConfig.from_depth(2, vocab_size=4000, head_dim=32, max_position_embeddings=128,
                                                      window_pattern="L").to_dict()
    without_rows = common.ModelShape(depth=2, vocab_size=4000).config()
    assert without_rows.max_position_embeddings == L3GPTConfig.from_depth(2, vocab_size=4000).max_position_embeddings
    written = common.write_result(tmp_path / "out" / "result.json", {"args": {"depth": 2}})
    assert json.loads((tmp_path / "out" / "result.json").read_text()) == written
    assert common.write_result(None, {"a": 1}) == {"a": 1}  # no --json: nothing written, the result returned


def test_where_liger_runs_the_loss_section_also_times_the_chunked_function_it_would_replace(suite, monkeypatch):
    """On a GPU with liger-kernel the loss section adds the chunked PyTorch function (the one a compiled step keeps in
    its graph) beside Liger. Here Liger is reported present (no GPU): the added path must run the chunked function
    with Liger switched off, and leave the switch as it was."""
    common, gpu_sections, _ = suite
    loss_memory = gpu_sections.loss_memory
    monkeypatch.setenv(common.SAME_PROCESS_VARIABLE, "1")
    monkeypatch.setattr(loss_memory, "liger_applies", lambda hidden: True)
    switches, measure = [], loss_memory._measure_path

    def measure_noting_the_switch(args, path):
        switches.append((path, loss_memory.linear_cross_entropy.LIGER_INSTALLED))
        return measure(args, path)

    monkeypatch.setattr(loss_memory, "_measure_path", measure_noting_the_switch)
    monkeypatch.setattr(loss_memory.linear_cross_entropy, "LIGER_INSTALLED", True)

    output = gpu_sections.run_loss(gpu_sections.Profile(name="smoke", device="cpu"), None)

    assert switches == [("plain", True), ("chunked", True), ("pytorch_chunked", False)]
    assert loss_memory.linear_cross_entropy.LIGER_INSTALLED is True
    plain, fused, pytorch = output["details"]["results"]
    assert pytorch["loss"] == fused["loss"]  # the same chunked function here, same seed
    rows = {row["measurement"]: row for row in output["rows"]}
    timed = rows["s/step, chunked (PyTorch) vs Liger"]
    assert timed["ratio"] == pytest.approx(pytorch["seconds"] / fused["seconds"])
    assert rows["peak memory MiB, chunked (PyTorch, in the compiled graph) vs Liger"]["reference"] == \
        fused["peak_bytes"] / 2**20
