"""hfl3.provenance and hfl3.atomic: record hashes, versions, git commit, atomic JSON, safetensors header metadata
(without rewriting the tensors), model card."""

import hashlib
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hfl3 import provenance
from hfl3.atomic import write_json_atomic
from hfl3.provenance.safetensors_header import _insert_blocks_at_start


def reference_sha256(chunks: list[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(len(chunk).to_bytes(8, "little") + chunk)
    return digest.hexdigest()


@pytest.mark.parametrize(
    "name, records, expected_bytes",
    [
        ("str", ["héllo", "wörld"], ["héllo".encode(), "wörld".encode()]),
        ("bytes", [b"\x00\xff", b""], [b"\x00\xff", b""]),
        ("dict canonical", [{"b": 1, "a": "é"}], ['{"a":"é","b":1}'.encode()]),
        ("list of messages", [[{"role": "user", "content": "x"}]], [b'[{"content":"x","role":"user"}]']),
        ("empty stream", [], []),
    ],
)
def test_sha256_records_matches_length_prefixed_reference(name, records, expected_bytes):
    assert provenance.sha256_records(records) == reference_sha256(expected_bytes)


def test_sha256_records_is_sensitive_to_boundaries_order_and_key_order_free():
    assert provenance.sha256_records(["ab", "c"]) != provenance.sha256_records(["a", "bc"])
    assert provenance.sha256_records(["a", "b"]) != provenance.sha256_records(["b", "a"])
    assert provenance.sha256_records([{"a": 1, "b": 2}]) == provenance.sha256_records([{"b": 2, "a": 1}])
    assert provenance.sha256_records(iter(["x"])) == provenance.sha256_records(["x"])
    with pytest.raises(TypeError, match="int"):
        provenance.sha256_records([3])


def test_sha256_file_equals_hashlib(tmp_path):
    data = bytes(range(256)) * 5000
    (tmp_path / "f.bin").write_bytes(data)
    assert provenance.sha256_file(tmp_path / "f.bin", chunk_bytes=1000) == hashlib.sha256(data).hexdigest()


def test_package_versions_lists_the_stack():
    import peft
    import transformers
    import trl

    versions = provenance.package_versions()
    assert versions["transformers"] == transformers.__version__
    assert versions["trl"] == trl.__version__
    assert versions["peft"] == peft.__version__
    assert versions["torch"] == torch.__version__
    assert {"hfl3", "python", "accelerate", "datasets", "safetensors", "tokenizers"} <= set(versions)


def test_git_commit_inside_and_outside_a_checkout(tmp_path, repo_root):
    head = subprocess.run(["git", "-C", str(repo_root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("the repository is not a git checkout here")
    assert provenance.git_commit(repo_root) == head.stdout.strip()
    assert provenance.git_commit(repo_root / "pyproject.toml") == head.stdout.strip()
    assert provenance.git_dirty(repo_root) in (True, False)
    assert provenance.git_commit(tmp_path) is None
    assert provenance.git_dirty(tmp_path) is None


def test_write_json_atomic_converts_values_and_leaves_no_temporary(tmp_path):
    path = write_json_atomic(
        tmp_path / "sub" / "m.json", {"p": Path("/x"), "dtype": torch.float32, "s": {2, 1}, "t": "é"}
    )
    assert json.loads(path.read_text(encoding="utf-8")) == {"p": "/x", "dtype": "torch.float32", "s": [1, 2], "t": "é"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.json"]
    assert path.stat().st_mode & 0o044 == 0o044  # readable like a normally written file


def test_build_metadata_has_sections_versions_and_commit():
    meta = provenance.build_metadata(data={"train_records_sha256": "ab"}, training_args={"lr": 1e-3})
    assert meta["data"] == {"train_records_sha256": "ab"}
    assert meta["training_args"] == {"lr": 1e-3}
    assert meta["versions"] == provenance.package_versions()
    assert meta["format_version"] == provenance.METADATA_FORMAT_VERSION
    assert "git_commit" in meta and "created_at" in meta
    json.dumps(meta)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copy"])
def test_add_safetensors_metadata_keeps_tensors_and_merges_header(tmp_path, in_place):
    file = tmp_path / "w.safetensors"
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(2, dtype=torch.bfloat16)}
    save_file(tensors, file, metadata={"format": "pt", "keep": "1"})
    provenance.add_safetensors_metadata(file, {"hfl3.sha256": "abc" * 400, "keep": "2", "ünï": "cödé"}, in_place)
    with safe_open(file, "pt") as f:
        assert f.metadata() == {"format": "pt", "keep": "2", "hfl3.sha256": "abc" * 400, "ünï": "cödé"}
    loaded = load_file(file)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)
    (header_size,) = struct.unpack("<Q", file.read_bytes()[:8])
    assert header_size % 8 == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_a_grown_header_moves_no_tensor_byte_where_the_file_system_inserts_blocks(tmp_path):
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 8192)
    with open(probe, "r+b") as f:
        if not _insert_blocks_at_start(f.fileno(), 1):
            pytest.skip("the temporary folder's file system cannot insert blocks (FALLOC_FL_INSERT_RANGE)")
    file = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(1000, 1000)}, file, metadata={"format": "pt"})
    (old_size,) = struct.unpack("<Q", file.read_bytes()[:8])
    data, inode = file.read_bytes()[8 + old_size:], file.stat().st_ino
    provenance.add_safetensors_metadata(file, {"hfl3.data": "d" * 5000})
    (new_size,) = struct.unpack("<Q", file.read_bytes()[:8])
    assert new_size > old_size + 5000 and (new_size - old_size) % os.statvfs(tmp_path).f_frsize == 0
    # the same file, its tensor bytes where the new header ends: remapped, never written
    assert file.stat().st_ino == inode and file.read_bytes()[8 + new_size:] == data
    with safe_open(file, "pt") as f:
        assert f.metadata()["hfl3.data"] == "d" * 5000


def test_a_header_that_fits_is_written_over_the_old_one(tmp_path):
    file = tmp_path / "w.safetensors"
    weight = torch.randn(4, 4)
    save_file({"w": weight}, file, metadata={"format": "pt", "note": "x" * 40})
    before, inode = file.read_bytes(), file.stat().st_ino
    provenance.add_safetensors_metadata(file, {"note": "short"})
    after = file.read_bytes()
    assert file.stat().st_ino == inode and after[:8] == before[:8] and after != before  # same header size
    assert load_file(file)["w"].equal(weight) and after[-64:] == before[-64:]
    with safe_open(file, "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "short"}


def test_add_safetensors_metadata_rejects_non_strings_and_non_safetensors(tmp_path):
    file = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(1)}, file)
    before = file.read_bytes()
    with pytest.raises(TypeError, match="str to str"):
        provenance.add_safetensors_metadata(file, {"n": 3})
    assert file.read_bytes() == before
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(ValueError, match="not a safetensors file"):
        provenance.add_safetensors_metadata(tmp_path / "bad.safetensors", {"a": "b"})


@pytest.mark.parametrize(
    "base_model, expected_in_front_matter",
    [("Qwen/Qwen3-0.6B", True), ("/local/folder/model", False), (None, False)],
)
def test_write_model_card_front_matter_and_provenance(tmp_path, base_model, expected_in_front_matter):
    meta = provenance.build_metadata(data={"train_records_sha256": "f" * 64, "eval_records_sha256": None})
    path = provenance.write_model_card(
        tmp_path, "My adapter", meta, "Some **usage**.", library_name="peft", tags=("hfl3", "sft"),
        base_model=base_model,
    )
    text = path.read_text(encoding="utf-8")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "peft" and front["tags"] == ["hfl3", "sft"]
    assert ("base_model" in front) == expected_in_front_matter
    assert "# My adapter" in text and "Some **usage**." in text
    assert f"| data.train_records_sha256 | `{'f' * 64}` |" in text
    assert f"| transformers | {meta['versions']['transformers']} |" in text
    assert json.loads(text.split("```json\n")[1].split("```")[0]) == meta


def test_push_folder_to_hub_uploads_the_folder_without_checkpoints(tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, repo_id, folder_path, commit_message, ignore_patterns):
            calls.append(("upload_folder", repo_id, folder_path, tuple(ignore_patterns)))
            return "https://huggingface.co/user/name/commit/0"

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert provenance.push_folder_to_hub(tmp_path, "user/name", private=True, token="t").endswith("/commit/0")
    assert calls[:2] == [("init", "t"), ("create_repo", "user/name", True, True)]
    assert calls[2][:3] == ("upload_folder", "user/name", str(tmp_path)) and "checkpoint-*" in calls[2][3]
