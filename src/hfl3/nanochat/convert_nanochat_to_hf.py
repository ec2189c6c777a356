"""Convert a nanochat checkpoint and tokenizer into an L3GPT folder that `AutoModelForCausalLM` and `AutoTokenizer`
load (remote code included), with the same logits on the same ids.

```bash
python -m hfl3.nanochat.convert_nanochat_to_hf \\
    --checkpoint_dir ~/.cache/nanochat/chatsft_checkpoints/d20 --tokenizer_dir ~/.cache/nanochat/tokenizer \\
    --output_dir nanochat-d20-hf
```

Input: nanochat's `checkpoint_manager.save_checkpoint` files, `model_<step>.pt` (the model's `state_dict`, `_orig_mod.`
prefixes of a compiled model allowed) and `meta_<step>.json` (its `model_config`), base or SFT; `--step` defaults to
the largest step present (nanochat's `find_last_step`); optimizer files are not read. The tokenizer folder holds
`tokenizer.pkl` (`convert_nanochat_tokenizer.py`). The `.pt` file is read with `torch.load(weights_only=True)`.

Two nanochat versions are understood (`NANOCHAT_VERSIONS`), each by the forward of the commit named:
- `master` (karpathy/nanochat 92d63d4; forward unchanged since a825e63, 2026-03-14): value embeddings with
  3·sigmoid gates on 12 channels, smear, backout, q/k scaled by 1.2 after their norm, RoPE base 100000, short window
  ⌈T/4/128⌉·128;
- `l3_fork` (nanochat PR #559, b7629ef, on upstream 194c98a): the dense core of upstream from 2026-01-16 to
  2026-03-01 (value-embedding gates 2·sigmoid on 32 channels, no smear/backout/q-k scale, RoPE base 10000, short
  window T//2) plus L3 layers (`--l3-after-layers`): tied `kv_weight` or `k_weight`/`v_weight` tables, `w_up`,
  `w_mix` and per-layer allocation `bounds`, added after their decoder layer.
The version is read from the checkpoint (smear parameters: master; L3 tables or L3 fields in the meta: l3_fork)
or given with `--nanochat_version`; a checkpoint that could be from another version is refused.

Conventions matched (tests/test_nanochat_core.py shows each on nanochat's formulas):
- rotary: nanochat rotates by -θ: the second half of every q/k head's projection rows is negated;
- sliding window: nanochat's window W (FA3 `(W, 0)`) sees W + 1 keys, so `sliding_window` = W + 1; its "L" layers
  see `sequence_len` + 1 keys, all of them up to `max_position_embeddings` (nanochat slides them beyond it);
- RMSNorm epsilon: `F.rms_norm` without eps uses float32's eps (2^-23, also in bf16 compute, whose norm runs in
  float32), so `rms_norm_eps` = 2^-23; q/k are normed before rotary instead of after (rotation keeps their RMS);
- vocabulary padded to a multiple of 64 (nanochat's `pad_vocab_size_to`): `vocab_size` is the padded size, the
  padded ids are suppressed in `generation_config.json` (nanochat crops its logits), and an L3 table gains one zero
  row per padded id (every token owns ≥ 1 row);
- l3_fork: `value_embeds` scaled by 2/3 (gate range 2 in a 3·sigmoid gate); the L3 scores are not divided by √C,
  so keys are scaled by √C (with tied tables `w_up` by 1/√C, which `Norm(W_up(·))` then sees unchanged) and
  `l3_mix_input="residual"` (`w_mix` reads the un-normed h).
nanochat keeps its rotary tables in the compute dtype (bf16 on GPUs; the L3 fork always): L3GPT computes them in
float32, a difference of bf16's rounding (2^-9) that a bf16-trained model never saw as exact anyway.

Output (written under a temporary name, renamed when complete): `model.safetensors` (+ modeling files and
`config.json` with `auto_map`), the tokenizer, `generation_config.json` (stops at `<|assistant_end|>` or `<|bos|>`,
as nanochat's Engine), and provenance (`metadata.json`, safetensors header, README.md) naming the source files
by name with their sha256 (no local path). `--push_to_hub --hub_model_id USER/NAME` uploads that folder.

Not part of the remote code: it lives beside the model's folder (`hfl3/models/l3gpt/`), not in it, and imports
hfl3's provenance writers as transformers' own conversion scripts import transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

from hfl3.models.l3gpt.allocation import bounds_from_counts
from hfl3.models.l3gpt.configuration_l3gpt import L3GPTConfig
from hfl3.models.l3gpt.modeling_l3gpt import VALUE_EMBEDDING_GATE_RANGE, L3GPTForCausalLM
from hfl3.provenance import build_metadata, push_folder_to_hub, sha256_file, stamp_folder

from .convert_nanochat_tokenizer import (
    BOS_TOKEN, END_OF_TURN, PICKLE_NAME, load_nanochat_encoding, tokenizer_from_encoding,
)  # fmt: skip

PAD_VOCAB_TO = 64  # nanochat GPT(pad_vocab_size_to=64)
NANOCHAT_RMS_NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm(eps=None) in float32 or bf16 compute
_STEP_FILE = re.compile(r"^model_(\d+)\.pt$")


@dataclass(frozen=True)
class NanochatVersion:
    """What changes between nanochat versions in a forward pass (the `model_config` in `meta_<step>.json` gives
    the sizes). `short_window(sequence_len)` is the FA3 window W of "S" layers."""

    name: str
    source: str
    rope_theta: float
    qk_norm_scale: float
    value_embedding_gate_range: float
    value_embedding_gate_channels: int
    smear_and_backout: bool
    softcap: float
    short_window_divisor: int
    short_window_multiple: int

    def short_window(self, sequence_len: int) -> int:
        unit = self.short_window_multiple
        return -(-sequence_len // self.short_window_divisor // unit) * unit


NANOCHAT_VERSIONS = {
    "master": NanochatVersion(
        name="master", source="karpathy/nanochat 92d63d4 (forward as of a825e63)", rope_theta=100000.0,
        qk_norm_scale=1.2, value_embedding_gate_range=3.0, value_embedding_gate_channels=12, smear_and_backout=True,
        softcap=15.0, short_window_divisor=4, short_window_multiple=128,
    ),
    "l3_fork": NanochatVersion(
        name="l3_fork", source="karpathy/nanochat PR #559 b7629ef (L3 fork on upstream 194c98a)", rope_theta=10000.0,
        qk_norm_scale=1.0, value_embedding_gate_range=2.0, value_embedding_gate_channels=32, smear_and_backout=False,
        softcap=15.0, short_window_divisor=2, short_window_multiple=1,
    ),
}


def checkpoint_files(checkpoint_dir: str | os.PathLike, step: int | None) -> tuple[Path, Path]:
    """`(model_<step>.pt, meta_<step>.json)` in `checkpoint_dir`; `step=None` takes the largest step there.

    Raises:
        FileNotFoundError: naming the folder and the steps it does have.
    """
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"--checkpoint_dir {folder} is not a folder (nanochat writes "
                                "NANOCHAT_BASE_DIR/base_checkpoints/d<depth> and chatsft_checkpoints/d<depth>)")
    steps = sorted(int(m.group(1)) for f in folder.iterdir() if (m := _STEP_FILE.match(f.name)))
    if step is None and not steps:
        raise FileNotFoundError(f"--checkpoint_dir {folder} has no model_<step>.pt file")
    step = steps[-1] if step is None else step
    files = folder / f"model_{step:06d}.pt", folder / f"meta_{step:06d}.json"
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found (steps present: {steps or 'none'}); pass --step")
    return files


def load_checkpoint(model_file: Path, meta_file: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The state dict (prefix `_orig_mod.` removed, as nanochat's `build_model` does) and the meta dict.

    Raises:
        ValueError: a file that is not a nanochat checkpoint (not a dict of tensors, no `model_config`).
    """
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises UnpicklingError, RuntimeError or OSError depending on the damage
        raise ValueError(f"{model_file}: not a loadable tensor checkpoint ({type(error).__name__}: "
                         f"{str(error).splitlines()[0]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{model_file}: expected nanochat's model state_dict (names → tensors)")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{meta_file}: not JSON ({error})") from None
    if not isinstance(meta.get("model_config"), dict):
        raise ValueError(f"{meta_file}: no model_config (nanochat's checkpoint_manager writes it)")
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}, meta


def detect_version(state: dict, meta: dict, where: str) -> NanochatVersion:
    """The nanochat version that wrote this checkpoint, when the tensors or the meta tell it for certain.

    Raises:
        ValueError: when they do not (naming `--nanochat_version`).
    """
    if "smear_gate.weight" in state:
        return NANOCHAT_VERSIONS["master"]
    if any(k.startswith("l3_layers.") for k in state) or "l3_after_layers" in meta["model_config"]:
        return NANOCHAT_VERSIONS["l3_fork"]
    raise ValueError(f"{where}: no smear gate and no L3 fields, so the nanochat version is not certain (between "
                     "2026-01-16 and 2026-03-14 upstream changed gates, RoPE base, windows and the softcap); pass "
                     "--nanochat_version l3_fork for upstream before 2026-03-02 (aba30cb) or the L3 fork")


def l3gpt_config(meta: dict, state: dict, version: NanochatVersion, vocab: int, where: str) -> L3GPTConfig:
    """The L3GPT config of a nanochat model (`vocab`: the tokenizer's size). Raises `ValueError` naming the file and
    the field when the meta, the tensors and the tokenizer disagree."""
    config = meta["model_config"]
    try:
        n_embd, n_head, n_layer = int(config["n_embd"]), int(config["n_head"]), int(config["n_layer"])
        n_kv_head, sequence_len = int(config.get("n_kv_head", n_head)), int(config["sequence_len"])
        meta_vocab = int(config["vocab_size"])
    except KeyError as error:
        raise ValueError(f"{where}: model_config lacks {error}") from None
    if meta_vocab != vocab:
        raise ValueError(f"{where}: model_config.vocab_size={meta_vocab} but the tokenizer has {vocab} tokens; pass "
                         "the tokenizer this model was trained with")
    padded = math.ceil(vocab / PAD_VOCAB_TO) * PAD_VOCAB_TO
    l3_layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("l3_layers.")})
    l3 = {}
    if l3_layers:
        first = f"l3_layers.{l3_layers[0]}"
        tied = f"{first}.kv_weight" in state
        try:
            rows = state[f"{first}.kv_weight" if tied else f"{first}.k_weight"].shape[0]
            d_up = state[f"{first}.w_up.weight"].shape[0]
        except KeyError as error:
            raise ValueError(f"{where}: L3 layer {first} has no {error}") from None
        k_max = config.get("l3_k_max") or max(1, int(counts_from_bounds(state, l3_layers, where).max()))
        l3 = dict(l3_after_layers=l3_layers, l3_n_emb=rows + padded - vocab, l3_tie_kv=tied, l3_d_up=d_up,
                  l3_mix_input="residual", l3_k_max=int(k_max))
    values = dict(
        vocab_size=padded, hidden_size=n_embd, intermediate_size=4 * n_embd, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_kv_head, head_dim=n_embd // n_head,
        max_position_embeddings=sequence_len, rms_norm_eps=NANOCHAT_RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": version.rope_theta},
        qk_norm_scale=version.qk_norm_scale, window_pattern=config.get("window_pattern", "L"),
        sliding_window=version.short_window(sequence_len) + 1, final_logit_softcapping=version.softcap,
        value_embedding_layers=sorted(int(k.split(".")[1]) for k in state if k.startswith("value_embeds.")),
        value_embedding_gate_channels=version.value_embedding_gate_channels,
        use_smear_gate=version.smear_and_backout, use_backout=version.smear_and_backout, tie_word_embeddings=False,
    )  # fmt: skip
    try:
        return L3GPTConfig(**values, **l3)
    except ValueError as error:  # the config's own checks, e.g. a window_pattern letter
        raise ValueError(f"{where}: {error}") from None


def counts_from_bounds(state: dict, l3_layers: list[int], where: str) -> torch.LongTensor:
    """Rows per token `(vocab,)` from the L3 layers' `bounds` buffers, which must all be equal (nanochat's
    base_train sets one allocation on every layer). Raises `ValueError` otherwise."""
    bounds = [state[f"l3_layers.{i}.bounds"].long() for i in l3_layers if f"l3_layers.{i}.bounds" in state]
    if len(bounds) != len(l3_layers):
        return torch.zeros(1, dtype=torch.long)  # reported as missing keys by `l3gpt_state_dict`
    if any(b.shape != bounds[0].shape or not torch.equal(b, bounds[0]) for b in bounds):
        raise ValueError(f"{where}: the L3 layers' bounds differ; L3GPT shares one allocation across layers")
    return bounds[0][1:] - bounds[0][:-1]


@dataclass(frozen=True)
class Weight:
    """Where one nanochat tensor goes: the L3GPT `name`, `forward` (nanochat → L3GPT values; None: unchanged) and
    `inverse` (None when the map cannot be undone, as for L3 tables that gain padding rows), `added_rows` (rows
    appended by `forward`)."""

    name: str
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None
    inverse: Callable[[torch.Tensor], torch.Tensor] | None = None
    added_rows: int = 0

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.forward(tensor) if self.forward else tensor


def scaled(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: w * factor


def weight_map(config: L3GPTConfig, version: NanochatVersion, vocab: int) -> dict[str, Weight]:
    """nanochat state-dict name → `Weight`, for an L3GPT `config` converted from `version` (`vocab`: tokenizer size).
    The L3 layers' `bounds` are not in it (`l3gpt_state_dict` turns them into the shared `model.l3_bounds`)."""
    head_dim, width = config.head_dim, config.hidden_size
    flip = torch.ones(head_dim, 1)
    flip[head_dim // 2 :] = -1  # -θ rotary → +θ: negate the second half of each head's rows

    def heads_flipped(weight: torch.Tensor) -> torch.Tensor:  # its own inverse
        return (weight.view(-1, head_dim, width) * flip.to(weight.dtype)).reshape(weight.shape)

    same = lambda w: w  # noqa: E731
    mapping = {
        "transformer.wte.weight": Weight("model.embed_tokens.weight", None, same),
        "lm_head.weight": Weight("lm_head.weight", None, same),
        "resid_lambdas": Weight("model.resid_lambdas", None, same),
        "x0_lambdas": Weight("model.x0_lambdas", None, same),
    }
    if version.smear_and_backout:
        mapping.update({"smear_gate.weight": Weight("model.smear.gate.weight", None, same),
                        "smear_lambda": Weight("model.smear.smear_lambda", None, same),
                        "backout_lambda": Weight("model.backout_lambda", None, same)})
    gate_scale = version.value_embedding_gate_range / VALUE_EMBEDDING_GATE_RANGE
    for i in config.value_embedding_layers:
        mapping[f"value_embeds.{i}.weight"] = Weight(f"model.value_embeddings.{i}.weight", scaled(gate_scale),
                                                     scaled(1 / gate_scale))
    for i in range(config.num_hidden_layers):
        block, layer = f"transformer.h.{i}", f"model.layers.{i}"
        mapping.update({
            f"{block}.attn.c_q.weight": Weight(f"{layer}.self_attn.q_proj.weight", heads_flipped, heads_flipped),
            f"{block}.attn.c_k.weight": Weight(f"{layer}.self_attn.k_proj.weight", heads_flipped, heads_flipped),
            f"{block}.attn.c_v.weight": Weight(f"{layer}.self_attn.v_proj.weight", None, same),
            f"{block}.attn.c_proj.weight": Weight(f"{layer}.self_attn.o_proj.weight", None, same),
            f"{block}.mlp.c_fc.weight": Weight(f"{layer}.mlp.up_proj.weight", None, same),
            f"{block}.mlp.c_proj.weight": Weight(f"{layer}.mlp.down_proj.weight", None, same),
        })  # fmt: skip
        if i in config.value_embedding_layers:
            mapping[f"{block}.attn.ve_gate.weight"] = Weight(f"{layer}.self_attn.value_embedding_gate.weight", None,
                                                             same)
    pad_rows = config.vocab_size - vocab
    root_c = math.sqrt(width)  # nanochat's L3 scores are <x, k>; L3GPT's are <x, k>/√C

    def table(scale: float):
        return lambda w: torch.cat([w * scale, w.new_zeros(pad_rows, w.shape[1])])

    for i in config.l3_after_layers:
        nano, ours = f"l3_layers.{i}", f"model.l3_layers.{i}"
        if config.l3_tie_kv:
            mapping[f"{nano}.kv_weight"] = Weight(f"{ours}.key_table.weight", table(root_c), None, pad_rows)
        else:
            mapping[f"{nano}.k_weight"] = Weight(f"{ours}.key_table.weight", table(root_c), None, pad_rows)
            mapping[f"{nano}.v_weight"] = Weight(f"{ours}.value_table.weight", table(1.0), None, pad_rows)
        up_scale = 1 / root_c if config.l3_tie_kv else 1.0  # tied values come scaled by √C too
        mapping[f"{nano}.w_up.weight"] = Weight(f"{ours}.up_proj.weight", scaled(up_scale), scaled(1 / up_scale))
        mapping[f"{nano}.w_mix.weight"] = Weight(f"{ours}.mix_proj.weight", None, same)
    return mapping


def l3gpt_state_dict(state: dict, config: L3GPTConfig, version: NanochatVersion, vocab: int, where: str,
                     shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """nanochat's tensors under L3GPT's names, in float32, transformed as the module docstring lists; `shapes`: the
    L3GPT state dict's shapes.

    Raises:
        ValueError: naming every nanochat key left unused or expected but absent, or a tensor of the wrong shape.
    """
    mapping = weight_map(config, version, vocab)
    bounds = {f"l3_layers.{i}.bounds" for i in config.l3_after_layers}
    unknown, missing = sorted(set(state) - set(mapping) - bounds), sorted((set(mapping) | bounds) - set(state))
    if unknown or missing:
        raise ValueError(f"{where}: keys this converter does not know: {unknown or 'none'}; keys missing: "
                         f"{missing or 'none'} (nanochat version {version.name}, {version.source})")
    wrong = [f"{key} {tuple(state[key].shape)}" for key, weight in mapping.items()
             if (state[key].shape[0] + weight.added_rows, *state[key].shape[1:]) != tuple(shapes[weight.name])]
    if wrong:
        raise ValueError(f"{where}: tensors whose shapes do not fit meta's model_config: {wrong}")
    converted = {weight.name: weight.apply(state[key].float()) for key, weight in mapping.items()}
    if config.l3_after_layers:
        pad_rows = config.vocab_size - vocab
        counts = torch.cat([counts_from_bounds(state, config.l3_after_layers, where),
                            torch.ones(pad_rows, dtype=torch.long)])  # fmt: skip
        if counts.shape != (config.vocab_size,) or int(counts.min()) < 1 or int(counts.max()) > config.l3_k_max:
            raise ValueError(f"{where}: L3 bounds give {counts.numel() - pad_rows} counts in [{int(counts.min())}, "
                             f"{int(counts.max())}]; expected {vocab} tokens owning 1..l3_k_max={config.l3_k_max} rows")
        converted["model.l3_bounds"] = bounds_from_counts(counts)
    else:
        converted["model.l3_bounds"] = torch.zeros(config.vocab_size + 1, dtype=torch.long)
    return converted


def meta_model(config: L3GPTConfig) -> L3GPTForCausalLM:
    """An L3GPT without storage (meta device): its state dict gives names and shapes, `load_state_dict(...,
    assign=True)` fills it without a second copy of the weights."""
    with torch.device("meta"):
        return L3GPTForCausalLM(config)


def nanochat_to_l3gpt(model_file: Path, meta_file: Path, vocab: int,
                      nanochat_version: str | None = None) -> tuple[L3GPTForCausalLM, NanochatVersion, dict]:
    """Read and map one nanochat checkpoint: `(model in float32, eval mode; its nanochat version; the meta dict)`.

    Raises:
        ValueError: the checkpoint cannot be converted exactly (the message names the file and the reason).
    """
    state, meta = load_checkpoint(model_file, meta_file)
    where = str(model_file)
    version = NANOCHAT_VERSIONS[nanochat_version] if nanochat_version else detect_version(state, meta, where)
    config = l3gpt_config(meta, state, version, vocab, where)
    model = meta_model(config)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    model.load_state_dict(l3gpt_state_dict(state, config, version, vocab, where, shapes), strict=True, assign=True)
    rotary = model.model.rotary_emb  # its non-persistent buffers are still on the meta device
    inv_freq, _ = rotary.rope_init_fn(config)
    rotary.inv_freq, rotary.original_inv_freq = inv_freq, inv_freq.clone()
    return model.eval(), version, meta


def convert(checkpoint_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, output_dir: str | os.PathLike,
            step: int | None = None, nanochat_version: str | None = None, dtype: str = "float32") -> Path:
    """Write the L3GPT folder of a nanochat checkpoint (see the module docstring); returns `output_dir`.

    Raises:
        FileExistsError: `output_dir` exists and is not empty (checked first).
        FileNotFoundError, ValueError, pickle.UnpicklingError: unreadable or unconvertible inputs, named.
    """
    output = Path(output_dir)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output_dir {output} exists and is not empty; give a new folder")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype {dtype}: use float32 (exact) or bfloat16")
    model_file, meta_file = checkpoint_files(checkpoint_dir, step)
    tokenizer = tokenizer_from_encoding(load_nanochat_encoding(tokenizer_dir))
    model, version, meta = nanochat_to_l3gpt(model_file, meta_file, len(tokenizer), nanochat_version)
    bos, end = tokenizer.convert_tokens_to_ids([BOS_TOKEN, END_OF_TURN])
    model.config.update({"bos_token_id": bos, "eos_token_id": end, "pad_token_id": bos})
    padded_ids = list(range(len(tokenizer), model.config.vocab_size))
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[end, bos], pad_token_id=bos,
                                               suppress_tokens=padded_ids or None)
    sources = [model_file, meta_file, Path(tokenizer_dir) / PICKLE_NAME]
    metadata = build_metadata(
        nanochat_source={
            "files": {path.name: {"sha256": sha256_file(path), "bytes": path.stat().st_size} for path in sources},
            "step": meta.get("step"), "version": version.name, "version_source": version.source,
            "model_config": meta["model_config"], "val_bpb": meta.get("val_bpb"),
            "user_config": meta.get("user_config"),
        },
        conversion={"converter": __spec__.name, "dtype": dtype},
    )  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp"))
    try:
        model.to(getattr(torch, dtype)).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        stamp_folder(staging, metadata, model_card(output.name, version, meta))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's folders are private; the output is an ordinary folder
        if output.exists():
            output.rmdir()
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def model_card(name: str, version: NanochatVersion, meta: dict) -> dict:
    """`write_model_card` arguments of a converted folder: what it came from and how to load it."""
    bpb = meta.get("val_bpb")
    text = (f"A nanochat model ({version.source}) converted to L3GPT by hfl3's `python -m {__spec__.name}`: same "
            "logits on the same token ids, same tokenizer ids, nanochat's chat format as the chat template."
            + (f" nanochat's validation bpb at step {meta.get('step')}: {bpb:.4f}." if isinstance(bpb, float) else "")
            + "\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained({name!r}, trust_remote_code=True)  # or import hfl3\n"
            f"tokenizer = AutoTokenizer.from_pretrained({name!r}, trust_remote_code=True)\n```")
    return {"title": f"{name} (nanochat → L3GPT)", "extra_markdown": text, "tags": ("hfl3", "l3gpt", "nanochat")}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_dir", required=True,
                        help="nanochat folder with model_<step>.pt + meta_<step>.json")
    parser.add_argument("--step", type=int, default=None, help="step to convert (default: the largest present)")
    parser.add_argument("--tokenizer_dir", required=True, help="nanochat's tokenizer folder (with tokenizer.pkl)")
    parser.add_argument("--output_dir", required=True, help="new folder for the L3GPT model and tokenizer")
    parser.add_argument("--nanochat_version", choices=sorted(NANOCHAT_VERSIONS), default=None,
                        help="nanochat version that wrote the checkpoint (default: read from it when certain)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the weights")
    parser.add_argument("--push_to_hub", action="store_true", help="upload the output folder to --hub_model_id")
    parser.add_argument("--hub_model_id", default=None, help="Hub repository USER/NAME for --push_to_hub")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; a bad input prints one `error:` line and returns 2."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if args.push_to_hub and not args.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id USER/NAME")
        folder = convert(args.checkpoint_dir, args.tokenizer_dir, args.output_dir, args.step, args.nanochat_version,
                         args.dtype)
    except (OSError, ValueError, pickle.UnpicklingError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {folder}")
    if args.push_to_hub:
        print(f"pushed: {push_folder_to_hub(folder, args.hub_model_id)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
