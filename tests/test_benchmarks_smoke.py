"""Plumbing of the issue-8 benchmarks: FLOPs accounting and time bookkeeping of l3_vs_dense, that
trainer_overhead's plain loop is step-for-step equivalent to the Trainer, that vs_nanochat runs on CPU.
No speed is asserted (speed lives in the benchmark tables)."""

import sys

import pytest
import torch

from hfl3 import L3GPTConfig
from hfl3.callbacks import flops_per_token, l3_lookup_flops_per_token
from hfl3.tokenization import train_tokenizer


@pytest.fixture(scope="module")
def bench(repo_root):
    sys.path.insert(0, str(repo_root / "benchmarks"))
    import l3_vs_dense
    import trainer_overhead
    import vs_nanochat

    yield l3_vs_dense, trainer_overhead, vs_nanochat
    sys.path.remove(str(repo_root / "benchmarks"))


def test_l3_lookup_flops_count_scores_and_weighted_sum():
    config = L3GPTConfig(vocab_size=512, hidden_size=64, num_attention_heads=1, num_hidden_layers=2,
                         l3_after_layers=[0, 1])
    # per layer: (2·d·C scores + 2·d·C weighted sum) forward, ×3 with backward; two L3 layers
    assert l3_lookup_flops_per_token(config, 5.0) == 2 * 3 * (2 + 2) * 5.0 * 64
    dense = L3GPTConfig(vocab_size=512, hidden_size=64, num_attention_heads=1, num_hidden_layers=2)
    assert l3_lookup_flops_per_token(dense, 5.0) == 0


def test_widened_dense_model_matches_l3_flops(bench, assets):
    l3_vs_dense = bench[0]
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:200_000]
    tokenizer = train_tokenizer([text], 2048)
    args = l3_vs_dense.BenchmarkArguments()
    l3_config = l3_vs_dense.make_config(args, tokenizer, with_l3=True)
    target = flops_per_token(l3_config, args.seq_len) + l3_lookup_flops_per_token(l3_config, 20.0)
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


def test_vs_nanochat_runs_hfl3_alone_on_cpu(bench, tmp_path):
    vs_nanochat = bench[2]
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback sizes")
    args = vs_nanochat.VsNanochatArguments(depth=1, seq_len=32, batch_size=2, vocab_size=256, steps=2,
                                           warmup_steps=1, json=str(tmp_path / "out.json"))
    assert args.arms == ["hfl3", "hfl3_l3"]  # nanochat needs --nanochat_dir
    args.arms = ["hfl3"]
    output = vs_nanochat.main(args)
    (dense,) = output["results"]
    assert dense["arm"] == "hfl3" and dense["table_parameters"] == 0 and dense["tok_per_sec"] > 0
    config = L3GPTConfig.from_depth(1, vocab_size=256, head_dim=64, max_position_embeddings=32)
    assert dense["flops_per_token"] == flops_per_token(config, 32)
    assert dense["mfu"] is None and (tmp_path / "out.json").exists()
    with pytest.raises(ValueError, match="no nanochat/gpt.py"):
        vs_nanochat.VsNanochatArguments(nanochat_dir=str(tmp_path))
