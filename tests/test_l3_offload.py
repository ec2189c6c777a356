"""L3 tables served from CPU memory: outputs equal the on-device model's (logits, greedy generation with a
cache), tables memory-mapped from safetensors, inference-only refusal, moving the model, remote code; on CUDA the
fetch overlaps the decoder layers (marked gpu)."""

import copy
import json
import os
import sys

import pytest
import torch
from test_l3gpt import VOCAB, skewed_model, tiny_config
from transformers import AutoModelForCausalLM

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.models.l3gpt import offload


def sharpened(model: L3GPTForCausalLM) -> L3GPTForCausalLM:
    """`model` in eval mode with a scaled-up head, so that greedy choices are not near-ties."""
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    return model.eval()


def outputs(model: L3GPTForCausalLM, ids: torch.LongTensor) -> tuple[torch.Tensor, torch.LongTensor]:
    """Logits of `ids` and 16 greedy tokens generated (with the cache) after its first 5 positions."""
    with torch.no_grad():
        logits = model(ids).logits
    generated = model.generate(ids[:, :5], max_new_tokens=16, do_sample=False, pad_token_id=0)
    return logits, generated


def file_backed(tensor: torch.Tensor) -> str | None:
    """Path of the file whose mapping holds `tensor`'s memory (Linux `/proc/self/maps`), or None."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


CASES = [  # (name, config overrides, most distinct tokens copied token by token; 0 = always the host gather)
    ("tied, direct copies", {}, offload.DIRECT_COPY_MAX_TOKENS),
    ("tied, host gather", {}, 0),
    ("untied, direct copies", {"l3_tie_kv": False}, offload.DIRECT_COPY_MAX_TOKENS),
    ("two L3 layers, host gather", {"l3_after_layers": [0, 1]}, 0),
]


@pytest.mark.parametrize("name,overrides,direct_max", CASES, ids=[case[0] for case in CASES])
def test_offloaded_equals_on_device(name, overrides, direct_max, monkeypatch):
    monkeypatch.setattr(offload, "DIRECT_COPY_MAX_TOKENS", direct_max)
    model = sharpened(skewed_model(tiny_config(**overrides)))
    offloaded = copy.deepcopy(model).offload_l3_tables()
    assert all(isinstance(layer.key_table, offload.HostTable) for layer in offloaded.model.l3_layers.values())
    ids = torch.randint(0, VOCAB, (2, 24))
    logits, generated = outputs(model, ids)
    offloaded_logits, offloaded_generated = outputs(offloaded, ids)
    assert torch.equal(offloaded_logits, logits)  # exact copies of the same rows: bit-identical on the CPU
    assert torch.equal(offloaded_generated, generated)
    # guard: the offloaded model reads its host tables (zeroing them changes the logits)
    with torch.no_grad():
        for layer in offloaded.model.l3_layers.values():
            layer.key_table.weight.zero_()
        assert not torch.allclose(offloaded(ids).logits, logits, atol=1e-3)


def test_forward_fetches_each_distinct_tokens_rows_once():
    model = skewed_model(tiny_config(l3_tie_kv=False)).offload_l3_tables()
    ids = torch.tensor([[3, 7, 3, 3, 50, 7]])
    prefetch = model.model.route_l3(ids).prefetch
    counts = model.model.l3_counts()
    layer = model.model.l3_layers["0"]
    for table in (layer.key_table, layer.value_table):
        rows = prefetch.rows(table)
        assert rows.shape[0] == int(counts[[3, 7, 50]].sum()) < int(counts[ids].sum())
        bounds = model.model.l3_bounds
        expected = torch.cat([table.weight[bounds[t] : bounds[t + 1]] for t in (3, 7, 50)])
        assert torch.equal(rows, expected)


def test_tables_memory_mapped_from_safetensors(tmp_path):
    model = sharpened(skewed_model(tiny_config(l3_tie_kv=False)))
    model.save_pretrained(tmp_path)
    # disable_mmap: transformers reads the file into memory, so a mapping of the tables is offload_l3_tables' own
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, disable_mmap=True)
    mapped = AutoModelForCausalLM.from_pretrained(tmp_path, disable_mmap=True, l3_offload="mmap")
    if sys.platform == "linux":
        layer = mapped.model.l3_layers["0"]
        for table in (layer.key_table, layer.value_table):
            assert file_backed(table.weight) == os.path.realpath(tmp_path / "model.safetensors")
        assert file_backed(plain.model.l3_layers["0"].key_table.weight) is None  # guard: not mapped without it
        assert file_backed(mapped.lm_head.weight) is None
    ids = torch.randint(0, VOCAB, (2, 24))
    logits, generated = outputs(model, ids)
    mapped_logits, mapped_generated = outputs(mapped, ids)
    assert torch.equal(mapped_logits, logits) and torch.equal(mapped_generated, generated)
    in_memory = copy.deepcopy(model).offload_l3_tables(mmap_checkpoint=tmp_path / "model.safetensors")
    assert torch.equal(outputs(in_memory, ids)[0], logits)


def test_mmap_checkpoint_must_match_the_model(tmp_path):
    model = skewed_model(tiny_config())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        copy.deepcopy(model).offload_l3_tables(mmap_checkpoint=tmp_path)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"l3_layers\.0\.key_table\.weight .*float32.*bfloat16"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, l3_offload="mmap")
    other = skewed_model(tiny_config(l3_after_layers=[1]))
    with pytest.raises(KeyError, match=r"l3_layers\.1\.key_table\.weight"):
        other.offload_l3_tables(mmap_checkpoint=tmp_path)


@pytest.mark.parametrize("kwargs,match", [(dict(l3_offload="yes"), "l3_offload='yes'"),
                                          (dict(l3_offload=True, device_map="auto"), "device_map='auto'")])
def test_bad_offload_arguments_are_refused(tmp_path, kwargs, match):
    skewed_model(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs)


def test_training_offloaded_tables_is_refused_frozen_tables_train_exactly():
    model = skewed_model(tiny_config()).train()
    offloaded = copy.deepcopy(model).offload_l3_tables()
    ids = torch.randint(0, VOCAB, (2, 16))
    with pytest.raises(RuntimeError, match="offloaded to CPU memory.*torch.no_grad"):
        offloaded(ids, labels=ids)
    # frozen tables (PEFT's base weights) are constants: the other parameters get the on-device model's gradients
    for each in (model, offloaded):
        each.model.l3_layers["0"].key_table.weight.requires_grad_(False)
        each(ids, labels=ids).loss.backward()
    grads = {name: param.grad for name, param in model.named_parameters() if param.requires_grad}
    for name, param in offloaded.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=0, msg=name)
    assert grads["model.l3_layers.0.up_proj.weight"].abs().sum() > 0


def test_moving_the_model_keeps_tables_in_cpu_memory(tmp_path):
    model = skewed_model(tiny_config()).offload_l3_tables()
    table = model.model.l3_layers["0"].key_table
    model.to(torch.float64)
    assert table.weight.dtype == torch.float64 and model.lm_head.weight.dtype == torch.float64
    model.float().save_pretrained(tmp_path)  # the tables are still in the state dict
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    model.to("meta")  # any device move: everything goes but the tables
    assert model.lm_head.weight.device.type == "meta" and table.weight.device.type == "cpu"


REMOTE_SCRIPT = """
import torch
from transformers import AutoModelForCausalLM

folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, l3_offload="mmap")
assert type(model.model.l3_layers["0"].key_table).__name__ == "HostTable"
ids = torch.load(folder + "/ids.pt")
torch.save(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), folder + "/remote.pt")
"""


def test_remote_code_offloads_without_hfl3(tmp_path, run_without_hfl3):
    model = sharpened(skewed_model(tiny_config()))
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 6))
    torch.save(ids, tmp_path / "ids.pt")
    result = run_without_hfl3(REMOTE_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(torch.load(tmp_path / "remote.pt"), expected)


@pytest.mark.gpu
def test_offloaded_on_cuda_equals_on_device_and_frees_gpu_memory():
    model = sharpened(skewed_model(tiny_config(l3_tie_kv=False)))
    on_device = copy.deepcopy(model).cuda()
    offloaded = copy.deepcopy(model).offload_l3_tables()
    table_bytes = sum(t.weight.nbytes for layer in offloaded.model.l3_layers.values()
                      for t in (layer.key_table, layer.value_table))
    assert offloaded.model.l3_layers["0"].key_table.weight.is_pinned()
    before = torch.cuda.memory_allocated()
    offloaded.cuda()
    model_bytes = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    assert torch.cuda.memory_allocated() - before <= model_bytes - table_bytes + (1 << 20)
    ids = torch.randint(0, VOCAB, (2, 24), device="cuda")
    logits, generated = outputs(on_device, ids)
    offloaded_logits, offloaded_generated = outputs(offloaded, ids)
    torch.testing.assert_close(offloaded_logits, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(offloaded_generated, generated)


@pytest.mark.gpu
def test_fetch_overlaps_the_decoder_layers_on_cuda(tmp_path):
    """The host→device copy of the routed rows runs on a side stream while the decoder layers before the L3 layer
    run on the current stream (a profiler trace shows a kernel of another stream inside the copy's interval)."""
    config = L3GPTConfig(vocab_size=1024, hidden_size=1024, num_attention_heads=8, num_hidden_layers=4,
                         l3_after_layers=[3], l3_n_emb=1024 * 32, l3_k_max=64)
    model = L3GPTForCausalLM(config).eval().offload_l3_tables().cuda()
    ids = torch.arange(1024, device="cuda").repeat(4, 1)  # every token: the whole 128 MB table is fetched
    with torch.no_grad():
        model(ids)  # warm-up
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            model(ids)
            torch.cuda.synchronize()
    profile.export_chrome_trace(str(tmp_path / "trace.json"))
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    assert copies, "no host-to-device copy in the trace"
    rows_copy = max(copies, key=lambda e: e["dur"])  # the 128 MB of rows; the other copies are a few bytes
    start, end = rows_copy["ts"], rows_copy["ts"] + rows_copy["dur"]
    overlapping = [e for e in events if e.get("cat") == "kernel" and e["args"]["stream"] != rows_copy["args"]["stream"]
                   and e["ts"] < end and start < e["ts"] + e["dur"]]
    assert overlapping, "the rows' copy did not overlap any kernel of another stream"
