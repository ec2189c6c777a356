"""Export an L3GPT folder whose architecture nanochat master has (the dense core: karpathy/nanochat 92d63d4) to a
nanochat checkpoint and tokenizer that nanochat's own loader (`checkpoint_manager.load_model`) and
`scripts/chat_cli.py` read, with the same logits.

```bash
python -m hfl3.nanochat.convert_hf_to_nanochat --model_dir nanochat-d20-hf --source sft \\
    --nanochat_base_dir ~/.cache/nanochat
NANOCHAT_BASE_DIR=~/.cache/nanochat python -m scripts.chat_cli -i sft   # in a nanochat checkout
```

Writes `<nanochat_base_dir>/{base,chatsft,chatrl}_checkpoints/<model_tag>/model_<step>.pt` + `meta_<step>.json`
(`--source` base, sft or rl; `--model_tag` defaults to nanochat's `d<depth>`; `--step` to the nanochat step the
folder was converted from, else 0) and `<nanochat_base_dir>/tokenizer/{tokenizer.pkl, token_bytes.pt}`. Each file is
written atomically; an existing checkpoint file, or a different existing tokenizer, is never overwritten.

The folder must be what nanochat's `GPT` computes (every mismatch is listed before anything is written): no L3
layer, value embeddings on nanochat's `has_ve` layers with 12 gate channels, smear (24 channels) and backout, q/k
scale 1.2, RoPE base 100000, softcap 15, MLP 4× wide, `head_dim = hidden_size / num_attention_heads`, untied
embeddings, `vocab_size` = the tokenizer's size padded to a multiple of 64, and on "S" layers a `sliding_window` of
nanochat's ⌈T/4/128⌉·128 + 1 (T = `max_position_embeddings`). A folder converted from nanochat master, or one
pretrained by hfl3 with these settings, qualifies. The tokenizer must be nanochat's (see
`convert_nanochat_tokenizer.encoding_from_tokenizer`). nanochat normalises with float32's epsilon: a model with
another `rms_norm_eps` is exported when its logits move by at most 1e-5 (relative) on a probe, and the move is
reported.

Not part of the remote code (see `convert_nanochat_to_hf.py`).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hfl3.atomic import atomic_path
from hfl3.models.l3gpt.configuration_l3gpt import L3GPTConfig
from hfl3.models.l3gpt.layers import L3GPTRMSNorm
from hfl3.models.l3gpt.modeling_l3gpt import L3GPTForCausalLM
from hfl3.provenance import package_versions, portable, sha256_file

from .convert_nanochat_tokenizer import PICKLE_NAME, TOKEN_BYTES_NAME, encoding_from_tokenizer, encoding_pickle_bytes
from .convert_nanochat_to_hf import NANOCHAT_RMS_NORM_EPS, NANOCHAT_VERSIONS, PAD_VOCAB_TO, weight_map

SOURCES = {"base": "base_checkpoints", "sft": "chatsft_checkpoints", "rl": "chatrl_checkpoints"}
MASTER = NANOCHAT_VERSIONS["master"]
PROBE_TOLERANCE = 1e-5  # relative logit change accepted from a different rms_norm_eps


def nanochat_model_config(config: L3GPTConfig, vocab: int) -> dict:
    """The `model_config` of nanochat's `meta_<step>.json` (its GPTConfig fields) for an L3GPT `config` and a
    tokenizer of `vocab` tokens.

    Raises:
        ValueError: listing every property nanochat master's GPT does not have.
    """
    layers, width = config.num_hidden_layers, config.hidden_size
    last = (layers - 1) % 2
    rope = config.rope_parameters or {}
    expected = {
        "l3_after_layers": ([], config.l3_after_layers),
        "value_embedding_layers": ([i for i in range(layers) if i % 2 == last], config.value_embedding_layers),
        "value_embedding_gate_channels": (MASTER.value_embedding_gate_channels, config.value_embedding_gate_channels),
        "use_smear_gate": (True, config.use_smear_gate),
        "smear_gate_channels": (24, config.smear_gate_channels),
        "use_backout": (True, config.use_backout),
        "qk_norm_scale": (MASTER.qk_norm_scale, config.qk_norm_scale),
        "rope_parameters": ({"rope_type": "default", "rope_theta": MASTER.rope_theta},
                            {"rope_type": rope.get("rope_type"), "rope_theta": rope.get("rope_theta")}),
        "final_logit_softcapping": (MASTER.softcap, config.final_logit_softcapping),
        "intermediate_size": (4 * width, config.intermediate_size),
        "head_dim": (width // config.num_attention_heads, config.head_dim),
        "hidden_size % num_attention_heads": (0, width % config.num_attention_heads),
        "tie_word_embeddings": (False, config.tie_word_embeddings),
        "vocab_size": (math.ceil(vocab / PAD_VOCAB_TO) * PAD_VOCAB_TO, config.vocab_size),
    }
    if "sliding_attention" in config.layer_types:
        expected["sliding_window"] = (MASTER.short_window(config.max_position_embeddings) + 1, config.sliding_window)
    problems = [f"{field}={actual!r} (nanochat: {wanted!r})" for field, (wanted, actual) in expected.items()
                if actual != wanted]  # fmt: skip
    if problems:
        raise ValueError("this L3GPT is not nanochat master's architecture: " + "; ".join(problems))
    return {"sequence_len": config.max_position_embeddings, "vocab_size": vocab, "n_layer": layers,
            "n_head": config.num_attention_heads, "n_kv_head": config.num_key_value_heads, "n_embd": width,
            "window_pattern": config.window_pattern}  # fmt: skip


def nanochat_state_dict(model: L3GPTForCausalLM, vocab: int) -> dict[str, torch.Tensor]:
    """nanochat master's state dict (its names; float32, contiguous) for an exportable `model`."""
    own = model.state_dict()
    return {key: weight.inverse(own[weight.name].detach().float()).contiguous()
            for key, weight in weight_map(model.config, MASTER, vocab).items()}  # fmt: skip


@torch.no_grad()
def probe_eps_change(model: L3GPTForCausalLM) -> float:
    """Change of the logits when `model`'s RMSNorms use nanochat's epsilon instead of its own, relative to their
    scale (max |Δ| / max |logit|; float32, a fixed probe of token ids); 0.0 when they already use it."""
    if model.config.rms_norm_eps == NANOCHAT_RMS_NORM_EPS:
        return 0.0
    model = model.float().eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, min(64, model.config.max_position_embeddings)),
                        generator=generator)  # fmt: skip
    before = model(ids).logits
    norms = [m for m in model.modules() if isinstance(m, L3GPTRMSNorm)]
    saved = [m.eps for m in norms]
    for norm in norms:
        norm.eps = NANOCHAT_RMS_NORM_EPS
    after = model(ids).logits
    for norm, eps in zip(norms, saved):
        norm.eps = eps
    return float((after - before).abs().max() / before.abs().max())


def export(model_dir: str | os.PathLike, nanochat_base_dir: str | os.PathLike, source: str,
           model_tag: str | None = None, step: int | None = None) -> dict:
    """Write the nanochat checkpoint and tokenizer of the L3GPT folder `model_dir` (see the module docstring).

    Returns:
        `{"files": [written paths], "eps_change": relative logit change from nanochat's epsilon}`.

    Raises:
        ValueError: a source other than base/sft/rl, an architecture or tokenizer nanochat does not have, or an
            epsilon change above `PROBE_TOLERANCE`.
        FileExistsError: the checkpoint files exist already, or a different tokenizer is in `nanochat_base_dir`.
    """
    if source not in SOURCES:
        raise ValueError(f"--source {source}: use one of {sorted(SOURCES)}")
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--model_dir {folder} has no config.json; give a folder save_pretrained wrote")
    model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    if model_type != L3GPTConfig.model_type:
        raise ValueError(f"--model_dir {folder} holds a {model_type!r} model; only L3GPT folders export to nanochat")
    config = L3GPTConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoding = encoding_from_tokenizer(tokenizer)
    model_config = nanochat_model_config(config, encoding.n_vocab)
    provenance = {}
    if (folder / "metadata.json").is_file():
        provenance = json.loads((folder / "metadata.json").read_text(encoding="utf-8")).get("nanochat_source") or {}
    step = int(provenance.get("step") or 0) if step is None else step
    target = Path(nanochat_base_dir) / SOURCES[source] / (model_tag or f"d{config.num_hidden_layers}")
    files = [target / f"model_{step:06d}.pt", target / f"meta_{step:06d}.json"]
    taken = [str(f) for f in files if f.exists()]
    if taken:
        raise FileExistsError(f"{taken} exist; pass another --step or --model_tag")
    tokenizer_dir = Path(nanochat_base_dir) / "tokenizer"
    pickled = encoding_pickle_bytes(encoding)
    if (tokenizer_dir / PICKLE_NAME).is_file() and (tokenizer_dir / PICKLE_NAME).read_bytes() != pickled:
        raise FileExistsError(f"{tokenizer_dir / PICKLE_NAME} holds another tokenizer; give another "
                              "--nanochat_base_dir")

    model = L3GPTForCausalLM.from_pretrained(folder, dtype=torch.float32)
    eps_change = probe_eps_change(model)
    if eps_change > PROBE_TOLERANCE:
        raise ValueError(f"rms_norm_eps={config.rms_norm_eps} → nanochat's {NANOCHAT_RMS_NORM_EPS}: the logits move "
                         f"by {eps_change:.2e} (relative) on a probe, more than {PROBE_TOLERANCE}")
    weights = [folder / name for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")]
    meta = {
        "step": step, "val_bpb": provenance.get("val_bpb"), "model_config": model_config,
        "user_config": provenance.get("user_config") or {},
        "hfl3_export": portable({"from": folder.name, "files": {f.name: sha256_file(f) for f in weights},
                                 "rms_norm_eps": config.rms_norm_eps, "eps_change": eps_change,
                                 "versions": package_versions()}),
    }  # fmt: skip
    buffer = io.BytesIO()
    torch.save(nanochat_state_dict(model, encoding.n_vocab), buffer)
    with atomic_path(files[0]) as tmp:
        tmp.write_bytes(buffer.getvalue())
    with atomic_path(files[1]) as tmp:
        tmp.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    lengths = [0] * encoding.n_vocab  # scripts/tok_train.py's token_bytes: bytes per token, specials 0
    for token, rank in encoding.mergeable_ranks.items():
        lengths[rank] = len(token)
    buffer = io.BytesIO()
    torch.save(torch.tensor(lengths, dtype=torch.int32), buffer)
    for name, data in ((PICKLE_NAME, pickled), (TOKEN_BYTES_NAME, buffer.getvalue())):
        with atomic_path(tokenizer_dir / name) as tmp:
            tmp.write_bytes(data)
    return {"files": [*files, tokenizer_dir / PICKLE_NAME, tokenizer_dir / TOKEN_BYTES_NAME], "eps_change": eps_change}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="L3GPT folder (e.g. from convert_nanochat_to_hf)")
    parser.add_argument("--nanochat_base_dir", required=True, help="nanochat's NANOCHAT_BASE_DIR to write into")
    parser.add_argument("--source", required=True, choices=sorted(SOURCES), help="nanochat checkpoint family")
    parser.add_argument("--model_tag", default=None, help="checkpoint folder name (default: d<depth>)")
    parser.add_argument("--step", type=int, default=None, help="step in the file names (default: the source's, or 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; a bad input prints one `error:` line and returns 2."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        result = export(args.model_dir, args.nanochat_base_dir, args.source, args.model_tag, args.step)
    except (OSError, ValueError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    if result["eps_change"]:
        print(f"rms_norm_eps differs from nanochat's: logits move by {result['eps_change']:.2e} (relative) on a probe")
    print("wrote " + ", ".join(str(f) for f in result["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
