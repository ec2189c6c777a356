"""`benchmarks/step_proxies.py`, the CPU proxies of the GPU pretraining step, at a tiny shape: the recipe's hfl3 arm
fills every row of the table that an eager run can (syncs, copies, fills, device ops, bytes, tensors saved for
backward at a larger shape), and a host sync and a zeroing planted in the model are counted once per step at the
planting line in both phases; the compiled-step counter sees what Inductor's generated code dispatches (the extern
matmul, as one graph call) and not what its kernels do inside. No speed is asserted."""

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

from hfl3.trainers.pretraining.trainer import PackedCollator


@pytest.fixture(scope="module")
def step_proxies(repo_root):
    sys.path.insert(0, str(repo_root / "benchmarks"))
    import step_proxies

    yield step_proxies
    sys.path.remove(str(repo_root / "benchmarks"))


def planted_builder(build):
    """`host_syncs.build_hfl3_trainer` with a hook after the first decoder layer: one `.item()` and one `zeros_like`
    of its (device) output per forward (none when the forward is traced with fake tensors)."""

    def build_planted(*args, **kwargs):
        trainer = build(*args, **kwargs)

        def planted(module, inputs, output):
            hidden = tree_leaves(output)[0]
            if is_fake(hidden):  # the saved-tensor count traces the forward with fake tensors: no value to read
                return
            hidden.float().mean().item()
            torch.zeros_like(hidden)

        trainer.model.model.layers[0].register_forward_hook(planted)
        return trainer

    return build_planted


@pytest.mark.timeout(300)
def test_the_hfl3_arm_fills_the_table_and_counts_a_planted_sync_and_zeroing(step_proxies, assets, monkeypatch):
    monkeypatch.setattr(step_proxies.host_syncs, "build_hfl3_trainer",
                        planted_builder(step_proxies.host_syncs.build_hfl3_trainer))
    args = step_proxies.StepProxyArguments(
        arms=["hfl3_muon"], depth=2, seq_len=64, batch_size=2, vocab_size=512, head_dim=32, compile=False,
        dataset=str(assets / "text" / "tinyshakespeare.txt"), eager_steps=1, warmup_steps=1, steps=2,
        gpu_batch_size=4, gpu_seq_len=128)
    result = step_proxies.measure_hfl3(args, "hfl3_muon")
    assert result["compiled"]["steps"] == [4, 5] and result["compiled_logging_step"]["steps"] == [6]
    for phase in ("eager", "compiled"):
        counts = result[phase]
        planted = {key.split(" | ")[0]: count for category in ("sync", "fill")
                   for key, count in counts[category]["by_site"].items() if "(planted)" in key}
        assert planted == {"item": 1.0, step_proxies.ZEROING: 1.0}, (phase, planted)
        # every tensor of the collated batch reaches the device without blocking (TrainerHooks.get_batch_samples),
        # so the Trainer's own `.to(device)` (`_prepare_input`) finds it there: no host sync (nanochat: none)
        batch = PackedCollator(0, attend_across_documents=True)([{"input_ids": [0, 1, 2]}])
        prepared = sum(count for key, count in counts["sync"]["by_site"].items() if "(_prepare_input)" in key)
        moved = sum(count for key, count in counts["copy"]["by_site"].items()
                    if key.startswith(step_proxies.step_counting.H2D_NB) and "hfl3/trainers/hooks.py" in key)
        assert prepared == 0, counts["sync"]["by_site"]
        if phase == "compiled":  # the eager phase's counter starts after the step's batch is fetched
            assert moved == len(batch), counts["copy"]["by_site"]
    compile_only = ("compiled graphs (dynamo)", "graph breaks", "kept inside the graphs", "recompiles",
                    "kernels defined")
    for row in step_proxies.table_rows(args, [result]):  # every row filled but dynamo's and Inductor's (not compiled)
        assert row["hfl3_muon"] not in ("", None), row
        assert (row["hfl3_muon"] == "n/a") == any(part in row["row"] for part in compile_only), row
    counts = result["bytes"]["parameter_counts"]
    # float32 matrices and scalars; bf16 token and value-embedding tables (--bf16's --embedding_dtype auto)
    tables = counts["embeddings"] + counts["value embeddings"]
    assert result["bytes"]["parameters"]["total"] == 4 * (sum(counts.values()) - tables) + 2 * tables
    assert 0 < result["bytes"]["gradients"]["total"] <= result["bytes"]["parameters"]["total"]
    assert result["bytes"]["optimizer_state"]["by_dtype"]["float32"] > 0
    for saved in ("saved_eager", "saved_compiled"):
        assert result[saved].get("total", 0) > 0, result[saved]


@pytest.mark.timeout(300)
def test_the_compiled_step_counter_sees_what_the_generated_code_dispatches(step_proxies):
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    weight = torch.randn(64, 64)

    @torch.compile
    def forward(x):
        return torch.relu(x @ weight).sum()

    x = torch.randn(16, 64)
    with step_proxies.arm_settings():
        forward(x)  # compiled here: one matmul (an extern kernel) and one fused C++ kernel
        graphs = counters["stats"]["unique_graphs"]
        counter = step_proxies.RuntimeStepCounter()
        with profile() as profiler, counter:
            counter.begin_step(1)
            counter.mark_device(x, weight)
            loss = forward(x)
            counter.mark_device(loss)  # a graph's output: made below the dispatch mode
            torch.zeros_like(x)
            loss.item()
        assert counters["stats"]["unique_graphs"] == graphs  # entering the counter did not recompile
    counts = counter.summarize_events([1])
    assert counts["sync"]["by_kind"] == {"item": 1.0}
    assert counts["fill"]["by_kind"] == {step_proxies.ZEROING: 1.0}
    assert "mm" not in counts[step_proxies.OP]["by_kind"] and "relu" not in counts[step_proxies.OP]["by_kind"]
    assert counts[step_proxies.OP]["by_kind"]["zeros_like"] == 1.0
    summary = step_proxies.profile_summary(profiler, 1)
    assert summary["graph_calls"] == 1 and summary["extern_by_name"] == {"aten::mm": 1.0} and summary["kernels"] >= 1
