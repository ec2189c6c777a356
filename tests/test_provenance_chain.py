"""hfl3.provenance.lineage and `python -m hfl3.provenance show`: an output's metadata.json carries its base's
provenance (pretraining corpus, commit, plan), recursively, so a merged chat model traces back to its data even after
the base folders are gone; Hub bases resolve to a commit from the local cache offline; nothing local leaks."""

import json
import shutil

import huggingface_hub
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hfl3.provenance import base_lineage, build_metadata, read_chain, sha256_file, sha256_records, stamp_folder
from hfl3.provenance.__main__ import main as provenance_main
from hfl3.provenance.safetensors_header import provenance_header

TOKEN = "hf_" + "Zq3" * 10  # the shape of a Hub token: must never be written
SHA = "0123456789abcdef0123456789abcdef01234567"


def write_output(folder, metadata, weights="model.safetensors"):
    """A stand-in for one stage's output folder: a weight file and the provenance the recipes stamp."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(2, 2)}, folder / weights, metadata={"format": "pt"})
    stamp_folder(folder, metadata, {"title": folder.name})
    return folder


@pytest.fixture
def chain_folders(tmp_path):
    """pretrain -> SFT adapter -> merged model, each metadata.json written as the recipes write theirs."""
    corpus_files = [{"name": f"shard_{i:05d}.txt", "bytes": 1000 + i, "sha256": f"{i:064x}"} for i in range(5000)]
    pretrain = write_output(tmp_path / "pretrain", build_metadata(
        data={"source": str(tmp_path / "corpus"),
              "corpus": {"source": str(tmp_path / "corpus"), "shards": 5000, "files": corpus_files,
                         "skipped_files": {"empty.txt": "empty"}, "duplicate_files": {}, "datasets": []},
              "eval_corpus": None, "train_tokens_sha256": "ab" * 32,
              "split": {"method": "hash", "validation_documents": 5, "training_documents_read": 4990},
              "packing": {"train": {"packed_tokens": 15360}}},
        model={"model_type": "l3gpt", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2},
        compute_optimal={"max_steps": 30, "training_tokens": 15360, "total_batch_size": 512, "world_size": 1},
        training_args={"output_dir": str(tmp_path / "pretrain"), "hub_token": TOKEN, "learning_rate": 0.01,
                       "max_steps": 30, "seed": 0},
        results={"eval_bpb": 4.5, "train_runtime": 31.4},
    ))
    pretrain_sha = sha256_file(pretrain / "metadata.json")
    train_file = tmp_path / "train.jsonl"
    sft = {"data": {"train_records_sha256": "cd" * 32, "eval_records_sha256": "ef" * 32,
                    "files_sha256": {str(train_file): "12" * 32}, "datasets": [], "train_examples": 30,
                    "eval_examples": 10},
           "lora": {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                    "target_modules": ["q_proj", "v_proj"], "layers_pattern": None},
           "base_model": {"name_or_path": str(pretrain), "hub_id": None, "model_type": "l3gpt"},
           "training_args": {"output_dir": str(tmp_path / "sft"), "hub_token": TOKEN, "learning_rate": 0.01},
           "results": {"eval_loss": 1.25}}
    adapter = write_output(tmp_path / "sft", build_metadata(**sft, lineage=base_lineage(str(pretrain))),
                           weights="adapter_model.safetensors")
    merged_lineage = base_lineage(str(adapter), name=str(tmp_path / "sft"))  # the recipe's staged folder, named
    merged = write_output(adapter / "merged", build_metadata(**sft, merged=True, lineage=merged_lineage))
    return {"pretrain": pretrain, "pretrain_sha": pretrain_sha, "adapter": adapter, "merged": merged,
            "corpus_files": corpus_files}


def test_a_merged_model_traces_back_to_the_pretraining_corpus_after_the_base_is_deleted(chain_folders, tmp_path):
    shutil.rmtree(chain_folders["pretrain"])  # the chain is copied forward, not looked up
    chain = read_chain(chain_folders["merged"])
    assert [link["kind"] for link in chain] == ["merged model", "adapter", "pretrained base"]
    assert [link["name"] for link in chain] == ["merged", "sft", "pretrain"]
    merged, adapter, pretrain = chain
    assert merged["metadata_sha256"] == sha256_file(chain_folders["merged"] / "metadata.json")
    assert adapter["metadata_sha256"] == sha256_file(chain_folders["adapter"] / "metadata.json")
    assert pretrain["metadata_sha256"] == chain_folders["pretrain_sha"]
    # the corpus of 5,000 files as counts and one digest anyone can recompute from the base's file list
    assert pretrain["data"]["corpus"] == {"source": "corpus", "files": 5000,
                                          "bytes": sum(f["bytes"] for f in chain_folders["corpus_files"]),
                                          "files_sha256": sha256_records(chain_folders["corpus_files"]),
                                          "skipped_files": 1, "duplicate_files": 0}
    assert pretrain["data"]["train_tokens_sha256"] == "ab" * 32
    assert pretrain["plan"]["max_steps"] == 30 and pretrain["model"]["model_type"] == "l3gpt"
    assert pretrain["results"] == {"eval_bpb": 4.5}  # runtime is not what the model is
    for link in (merged, adapter):
        assert link["data"]["train_records_sha256"] == "cd" * 32 and link["data"]["files_sha256"] == {
            "train.jsonl": "12" * 32}
        assert link["lora"] == {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                "target_modules": ["q_proj", "v_proj"]}
    for link in chain:
        assert link["git_commit"] == build_metadata()["git_commit"] and link["created_at"]
    assert len(json.dumps(pretrain)) < 3000  # bounded, whatever the size of the corpus
    # the weights carry the same chain in their header
    with safe_open(chain_folders["merged"] / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["hfl3.lineage"]) == json.loads(
            (chain_folders["merged"] / "metadata.json").read_text())["lineage"] == chain[1:]


def test_show_prints_every_link_newest_first_without_local_paths_or_tokens(chain_folders, tmp_path, capsys):
    provenance_main(["show", str(chain_folders["merged"])])
    text = capsys.readouterr().out
    headings = [line for line in text.splitlines() if line[:1].isdigit()]
    # the folder as given on the command line; the bases as their outputs recorded them
    assert headings == [f"1. merged model: {chain_folders['merged']}", "2. adapter: sft", "3. pretrained base: pretrain"]
    for expected in ("ab" * 32, "cd" * 32, sha256_records(chain_folders["corpus_files"]), "r 4", "lora_alpha 8",
                     "max_steps 30", build_metadata()["git_commit"] or "", "corpus.files 5000"):
        assert expected in text
    provenance_main(["show", str(chain_folders["merged"]), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed[0]["name"] == str(chain_folders["merged"])
    assert printed[1:] == read_chain(chain_folders["merged"])[1:]
    for output in (text.split("\n", 2)[2], json.dumps(printed[1:]),
                   *(p.read_text() for p in tmp_path.rglob("metadata.json"))):
        assert str(tmp_path) not in output and TOKEN not in output


MUON_SFT_ARGS = {"learning_rate": 0.0002, "optim": "adamw_torch", "use_muon": True, "matrix_lr": 0.0016,
                 "embedding_lr": 0.03, "unembedding_lr": 0.0004, "scalar_lr": 0.05, "smear_lr": 0.02,
                 "init_lr_frac": 0.8, "l3_table_lr": None, "max_steps": 20}


@pytest.mark.parametrize("recorded", ["training_args only", "optimizer section"])
def test_show_names_what_trained_each_link_muons_group_lrs_not_an_unused_learning_rate(tmp_path, capsys, monkeypatch,
                                                                                      recorded):
    optimizer = {"name": "MuonAdamW", "learning_rates": {"matrix": 0.00128, "embedding": 0.0277, "smear": 0.02},
                 "weight_decay": 0.0, "from_learning_rate": 0.0002}
    sections = {"optimizer": optimizer} if recorded == "optimizer section" else {}
    folder = write_output(tmp_path / "sft", build_metadata(base_model={"name_or_path": "HuggingFaceTB/SmolLM2"},
                                                           training_args=MUON_SFT_ARGS, **sections))
    monkeypatch.chdir("/")  # from the root directory, an absolute folder is printed with its leading /
    provenance_main(["show", str(folder)])
    printed = capsys.readouterr().out
    assert printed.splitlines()[1] == f"1. full SFT model: {folder}"
    text = " ".join(printed.split())  # the lines unwrapped
    assert "learning_rate 0.0002" not in text.replace("from_learning_rate 0.0002", "")  # not an LR no group used
    assert "optim adamw_torch" not in text and "use_muon" not in text
    if recorded == "optimizer section":  # the peak LR of every group, as the optimizer was built
        assert "optimizer: name MuonAdamW; learning_rates.matrix 0.00128; learning_rates.embedding 0.0277; " \
               "learning_rates.smear 0.02; weight_decay 0; from_learning_rate 0.0002" in text
    else:  # metadata written before the section: the group LR fields
        assert "optimizer: name MuonAdamW; matrix_lr 0.0016; embedding_lr 0.03; unembedding_lr 0.0004; scalar_lr " \
               "0.05; smear_lr 0.02; init_lr_frac 0.8" in text
    assert "training: max_steps 20" in text
    assert str(tmp_path).lstrip("/") not in (folder / "metadata.json").read_text()  # no local path written from /


def test_an_adamw_link_shows_its_optimizer_and_learning_rate(tmp_path, capsys):
    folder = write_output(tmp_path / "sft", build_metadata(
        base_model={"name_or_path": "HuggingFaceTB/SmolLM2"},
        training_args={"learning_rate": 2e-5, "optim": "adamw_torch", "use_muon": False, "max_steps": 20}))
    provenance_main(["show", str(folder)])
    assert "optimizer: optim adamw_torch; learning_rate 2e-05" in capsys.readouterr().out


def test_an_output_whose_base_predates_lineage_ends_the_chain_with_what_it_recorded(tmp_path):
    old = write_output(tmp_path / "old_adapter", build_metadata(
        lora={"r": 8}, data={"train_records_sha256": "cd" * 32},
        base_model={"name_or_path": str(tmp_path / "base"), "hub_id": "someone/base-model"}))
    new = write_output(tmp_path / "new", build_metadata(base_model={"name_or_path": str(old)},
                                                        lineage=base_lineage(str(old))))
    chain = read_chain(new)
    assert [link["kind"] for link in chain] == ["full SFT model", "adapter", "Hub model"]
    assert chain[2]["hub_id"] == "someone/base-model" and "not copied" in chain[2]["note"]


@pytest.mark.parametrize(
    "name, sections, kind, data",
    [
        ("converted nanochat checkpoint",
         {"nanochat_source": {"files": {"model_000650.pt": {"sha256": "aa" * 32, "bytes": 9}}, "step": 650},
          "conversion": {"dtype": "float32"}},
         "converted nanochat checkpoint", {"files_sha256": {"model_000650.pt": "aa" * 32}, "step": 650}),
        ("full SFT model", {"base_model": {"hub_id": "OWNER/NAME"}, "data": {"train_records_sha256": "cd" * 32}},
         "full SFT model", {"train_records_sha256": "cd" * 32}),
        ("other hfl3 metadata", {"data": {"shards": {"sha256": "ef" * 32, "rows": 3}, "note": "x"}},
         "model", {"shards.sha256": "ef" * 32}),  # its *sha256* values
    ],
)
def test_every_kind_of_output_is_named_with_the_data_that_identifies_it(tmp_path, name, sections, kind, data):
    (link,) = base_lineage(str(write_output(tmp_path / "out", build_metadata(**sections))))[:1]
    assert link["kind"] == kind and link.get("data", {}) == data


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache in tmp_path holding OWNER/NAME at commit SHA (refs/main -> SHA)."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no request can leave the test
    repo = cache / "models--OWNER--NAME"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen3"}')
    (snapshot / "model-q4.gguf").write_bytes(b"GGUF")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return snapshot


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("main resolved through refs", {"name_or_path": "OWNER/NAME"},
         {"kind": "Hub model", "name": "OWNER/NAME", "hub_id": "OWNER/NAME", "sha": SHA}),
        ("a commit asked for", {"name_or_path": "OWNER/NAME", "revision": SHA},
         {"kind": "Hub model", "name": "OWNER/NAME", "hub_id": "OWNER/NAME", "revision": SHA, "sha": SHA}),
        ("a GGUF file", {"name_or_path": "OWNER/NAME", "gguf_file": "model-q4.gguf"},
         {"kind": "Hub model", "name": "OWNER/NAME", "hub_id": "OWNER/NAME", "sha": SHA, "gguf_file": "model-q4.gguf"}),
    ],
)
def test_a_hub_base_resolves_its_commit_from_the_local_cache_offline(hub_cache, name, kwargs, expected):
    assert base_lineage(**kwargs) == [expected]


def test_hub_bases_from_a_cache_folder_with_hfl3_metadata_and_missing_from_the_cache(hub_cache, tmp_path):
    snapshot_link = base_lineage(str(hub_cache))  # from_pretrained given the snapshot folder itself
    assert [{k: link[k] for k in ("kind", "name", "hub_id", "sha")} for link in snapshot_link] == [
        {"kind": "Hub model", "name": "OWNER/NAME", "hub_id": "OWNER/NAME", "sha": SHA}]
    missing = base_lineage("OWNER/ELSEWHERE")
    assert missing[0]["kind"] == "Hub model" and "sha" not in missing[0] and "HF_HUB_OFFLINE" in missing[0]["note"]
    # an hfl3 model on the Hub: its own metadata.json (cached beside its weights) continues the chain
    pretrain = write_output(tmp_path / "pretrain", build_metadata(
        compute_optimal={"max_steps": 7}, data={"train_tokens_sha256": "ab" * 32}))
    shutil.copy(pretrain / "metadata.json", hub_cache / "metadata.json")
    (link,) = base_lineage("OWNER/NAME")
    assert (link["kind"], link["hub_id"], link["sha"], link["plan"]) == ("pretrained base", "OWNER/NAME", SHA,
                                                                         {"max_steps": 7})
    assert link["metadata_sha256"] == sha256_file(pretrain / "metadata.json")


def test_a_base_without_metadata_says_so(tmp_path):
    base = tmp_path / "downloaded"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen3"}')
    (link,) = base_lineage(str(base))
    assert (link["kind"], link["name"], link["model_type"]) == ("model without metadata", "downloaded", "qwen3")
    assert "no metadata.json" in link["note"] and str(tmp_path) not in json.dumps(link)


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"],
                         ids=["no metadata.json", "not JSON", "not an object"])
def test_show_on_a_folder_that_is_not_an_output_is_one_line_and_exit_status_2(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "metadata.json").write_text(content)
    with pytest.raises(SystemExit) as exit_info:  # argparse's exit, as for a bad argument: no traceback
        provenance_main(["show", str(tmp_path)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"python -m hfl3.provenance show: error: {tmp_path}")
    assert ("no metadata.json" if content is None else "metadata.json: ") in captured.err


def test_a_long_lineage_keeps_its_hashes_in_the_safetensors_header():
    lineage = [{"kind": "adapter", "metadata_sha256": f"{i:064x}", "note": "x" * 5000} for i in range(5)]
    header = json.loads(provenance_header({"lineage": lineage})["hfl3.lineage"])
    assert header == {f"{i}.metadata_sha256": f"{i:064x}" for i in range(5)}
