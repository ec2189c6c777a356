"""hfl3's pretraining step as the recipe builds it makes no host sync of its own between logs (each one drains a GPU's
queue; docs/design.md, decision 12), counted by `benchmarks/host_syncs.py`: dense and with an L3 layer, MuonAdamW
and the Trainer's AdamW. Guards: the counter sees an `.item()` planted in the forward (and not one on a host
tensor), and it sees hfl3's own frames where they do sync, at the logging step."""

import sys

import pytest
import torch
from torch.utils._pytree import tree_leaves


@pytest.fixture(scope="module")
def host_syncs(repo_root):
    sys.path.insert(0, str(repo_root / "benchmarks"))
    import host_syncs

    yield host_syncs
    sys.path.remove(str(repo_root / "benchmarks"))


def plant_item(model: torch.nn.Module) -> None:
    """After the first decoder layer's forward: one `.item()` on its (device) output, one on a host tensor."""

    def planted(module, inputs, output):
        tree_leaves(output)[0].float().mean().item()
        torch.tensor(1.0).item()

    model.model.layers[0].register_forward_hook(planted)


@pytest.mark.parametrize("arm", ["hfl3_muon", "hfl3_muon_l3", "hfl3_adamw"])
def test_hfl3_makes_no_host_sync_in_a_plain_step(host_syncs, assets, tmp_path, arm):
    # Block-causal rows (the recipe's default); 1 warm-up step, steps 2-3 plain, step 4 logs and stops
    args = host_syncs.HostSyncArguments(arms=[arm], depth=2, seq_len=64, batch_size=2, vocab_size=512, head_dim=32,
                                        dataset=str(assets / "text" / "tinyshakespeare.txt"), evaluate=False,
                                        warmup_steps=1, steps=3)
    optim, l3 = host_syncs.HFL3_ARMS[arm]
    trainer = host_syncs.build_hfl3_trainer(args, optim, l3, str(tmp_path / "run"))
    plant_item(trainer.model)
    counted = host_syncs.count_trainer(trainer, args)
    plain, logging = counted[host_syncs.PLAIN], counted[host_syncs.LOGGING]
    assert plain["steps"] == [2, 3] and logging["steps"] == [4]
    assert not [site for site in plain["by_site"] if site.startswith("hfl3:")], plain["by_site"]
    # the planted device `.item()`: one per plain step, at this file's line; the host one is no sync
    planted = {site: count for site, count in plain["by_site"].items() if site.startswith("test_host_syncs.py:")}
    assert list(planted.values()) == [1.0] and "(planted) [item]" in next(iter(planted)), plain["by_site"]
    assert any(site.startswith("test_host_syncs.py:") for site in plain["host reads"]), plain["host reads"]
    # hfl3's frames are seen where they sync by design: the NaN/inf guard reads its flags where the Trainer logs
    assert logging["by_library"].get("hfl3", 0) > 0, logging["by_site"]
    if l3:  # the L3 routing's pair count is copied without waiting, read at the L3 layer
        assert any("pair_count_on_host" in site for site in plain[f"{host_syncs.DEFERRED}s"])


@pytest.mark.gpu
def test_the_l3_pair_count_reaches_the_host_without_waiting_on_cuda():
    from hfl3.models.l3gpt.lookup import l3_routing

    bounds = torch.tensor([0, 3, 5, 9], device="cuda")
    ids = torch.randint(0, 3, (4, 16), device="cuda")
    torch.cuda._sleep(100_000_000)  # the stream stays busy for tens of ms: a blocking copy would wait for it
    routing = l3_routing(ids, bounds)
    assert routing.num_pairs.is_pinned() and not routing.num_pairs_copied.query()  # returned before the copy ran
    routing.num_pairs_copied.synchronize()
    assert int(routing.num_pairs) == int((bounds[1:] - bounds[:-1])[ids].sum())
