"""nanochat's file formats and formulas, re-written for the tests (not vendored: karpathy/nanochat 92d63d4 and its L3
fork, PR #559 b7629ef, are not installed in CI). dev/LOG.md records the one-off check of the converters against
nanochat's own code; these references stand in for it here.

- Tokenizer: a rank table trained on real text, `tokenizer.pkl` as `pickle.dump` writes a tiktoken `Encoding`
  (through a stand-in `tiktoken.core.Encoding` whose `__getstate__` is tiktoken's), tiktoken's encoding procedure
  (split regex; a piece that is a token is returned whole, else the lowest-rank adjacent pair is merged, leftmost
  first) and `RustBPETokenizer.render_conversation`.
- Model: `Spec` (sizes and version), nanochat's parameter names, the forward in float64 (`forward`), and
  `model_<step>.pt` / `meta_<step>.json` as `checkpoint_manager.save_checkpoint` writes them.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
import types
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import regex
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)  # nanochat/tokenizer.py SPLIT_PATTERN
SPECIAL_TOKENS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                  "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]  # fmt: skip
RMS_EPS = torch.finfo(torch.float32).eps  # F.rms_norm(eps=None) on float32 (and bf16: its norm runs in float32)


# ---------------------------------------------------------------------------------------------------------- tokenizer
def train_ranks(text: str, n_ranks: int) -> dict[bytes, int]:
    """A tiktoken rank table of `n_ranks` tokens trained on `text`: the 256 bytes (rank = byte value, as rustbpe),
    then one token per BPE merge in training order (merges learned by `tokenizers`' trainer)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=n_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator([text], trainer)
    from_unicode = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(backend.to_str())["model"]["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        token = bytes(from_unicode[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def special_ids(ranks: dict[bytes, int]) -> dict[str, int]:
    return {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}


def write_tokenizer_pickle(folder: Path, ranks: dict[bytes, int], state: object = None) -> Path:
    """`folder/tokenizer.pkl` as nanochat's `RustBPETokenizer.save` writes it (`pickle.dump(enc, f)` of a tiktoken
    Encoding: the class by reference, `__getstate__`'s dict as its state); `state` replaces that dict."""
    module = types.ModuleType("tiktoken.core")

    class Encoding:
        def __getstate__(self):
            if state is not None:
                return state
            return {"name": "rustbpe", "pat_str": SPLIT_PATTERN, "mergeable_ranks": ranks,
                    "special_tokens": special_ids(ranks)}

    Encoding.__module__, Encoding.__qualname__, module.Encoding = "tiktoken.core", "Encoding", Encoding
    saved = {name: sys.modules.get(name) for name in ("tiktoken", "tiktoken.core")}
    sys.modules.update({"tiktoken": types.ModuleType("tiktoken"), "tiktoken.core": module})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "tokenizer.pkl", "wb") as f:
            pickle.dump(Encoding(), f)
    finally:
        for name, previous in saved.items():
            sys.modules.pop(name) if previous is None else sys.modules.__setitem__(name, previous)
    return folder / "tokenizer.pkl"


def tiktoken_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's `encode_ordinary` (special-token text is plain text)."""

    @lru_cache(maxsize=None)
    def piece_ids(piece: bytes) -> tuple[int, ...]:
        if piece in ranks:
            return (ranks[piece],)
        parts = [piece[i : i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                     if parts[i] + parts[i + 1] in ranks]  # fmt: skip
            if not pairs:
                break
            _, i = min(pairs)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return tuple(ranks[p] for p in parts)

    return [i for piece in regex.findall(SPLIT_PATTERN, text) for i in piece_ids(piece.encode("utf-8"))]


def render_conversation(messages: list[dict], ranks: dict[bytes, int]) -> tuple[list[int], list[int]]:
    """nanochat's `RustBPETokenizer.render_conversation`: `(ids, mask)`, mask 1 on supervised tokens."""
    special = special_ids(ranks)
    if messages[0]["role"] == "system":
        messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]},
                    *messages[2:]]  # fmt: skip
    ids, mask = [special["<|bos|>"]], [0]

    def add(tokens: list[int], supervised: int):
        ids.extend(tokens)
        mask.extend([supervised] * len(tokens))

    for message in messages:
        if message["role"] == "user":
            add([special["<|user_start|>"], *tiktoken_encode(message["content"], ranks), special["<|user_end|>"]], 0)
            continue
        add([special["<|assistant_start|>"]], 0)
        parts = message["content"] if isinstance(message["content"], list) else [
            {"type": "text", "text": message["content"]}]  # fmt: skip
        for part in parts:
            text = tiktoken_encode(part["text"], ranks)
            if part["type"] == "text":
                add(text, 1)
            elif part["type"] == "python":
                add([special["<|python_start|>"], *text, special["<|python_end|>"]], 1)
            else:
                add([special["<|output_start|>"], *text, special["<|output_end|>"]], 0)
        add([special["<|assistant_end|>"]], 1)
    return ids, mask


# -------------------------------------------------------------------------------------------------------------- model
@dataclass
class Spec:
    """A nanochat model: `version` "master" (92d63d4) or "l3_fork" (b7629ef), sizes as in its GPTConfig (`vocab`:
    the tokenizer's size; tables are padded to a multiple of 64), and the fork's L3 settings."""

    version: str
    vocab: int
    sequence_len: int
    n_layer: int = 3
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    window_pattern: str = "SL"
    l3_after_layers: list[int] = field(default_factory=list)
    l3_n_emb: int = 0
    l3_k_max: int = 8
    l3_d_up: int = 32
    l3_tie_kv: bool = True

    @property
    def padded(self) -> int:
        return math.ceil(self.vocab / 64) * 64

    @property
    def master(self) -> bool:
        return self.version == "master"

    def model_config(self) -> dict:
        """meta_<step>.json's `model_config` (asdict of the version's GPTConfig)."""
        config = dict(sequence_len=self.sequence_len, vocab_size=self.vocab, n_layer=self.n_layer, n_head=self.n_head,
                      n_kv_head=self.n_kv_head, n_embd=self.n_embd, window_pattern=self.window_pattern)  # fmt: skip
        if not self.master:
            config.update(l3_after_layers=",".join(map(str, self.l3_after_layers)), l3_n_emb=self.l3_n_emb,
                          l3_d_up=self.l3_d_up, l3_k_max=self.l3_k_max, l3_tie_kv=self.l3_tie_kv)
        return config

    def windows(self) -> list[int]:
        """Keys each layer's query sees, minus one (FA3's left window W); the last layer full."""
        short = -(-self.sequence_len // 4 // 128) * 128 if self.master else self.sequence_len // 2
        letters = [self.window_pattern[i % len(self.window_pattern)] for i in range(self.n_layer)]
        letters[-1] = "L"
        return [short if letter == "S" else self.sequence_len for letter in letters]


def has_ve(layer: int, n_layer: int) -> bool:
    return layer % 2 == (n_layer - 1) % 2


def random_weights(spec: Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """nanochat's state dict for `spec` (names, shapes), random and non-zero so every path matters, in float64 with
    values exact in the dtype the checkpoint stores: bf16 for `wte` and `value_embeds` (nanochat's COMPUTE_DTYPE on
    GPUs), float32 otherwise. Value embeddings are multiples of 3·2^-10 with ≤ 7 significant bits, so that the L3
    fork's 2/3 rescale stays exact, and the fork's L3 bounds are an allocation with counts in [1, l3_k_max]."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=0.3, mean=0.0, dtype=torch.float32):
        return (mean + torch.randn(*shape, generator=generator, dtype=torch.float64) * std).to(dtype).double()

    c, head_dim, v = spec.n_embd, spec.n_embd // spec.n_head, spec.padded
    kv_dim = spec.n_kv_head * head_dim
    w = {"transformer.wte.weight": randn(v, c, std=0.8, dtype=torch.bfloat16), "lm_head.weight": randn(v, c),
         "resid_lambdas": randn(spec.n_layer, mean=1.1, std=0.05),
         "x0_lambdas": randn(spec.n_layer, mean=0.1, std=0.05)}
    if spec.master:
        w.update({"smear_gate.weight": randn(1, 24), "smear_lambda": torch.tensor([0.625], dtype=torch.float64),
                  "backout_lambda": torch.tensor([0.25], dtype=torch.float64)})
    for i in range(spec.n_layer):
        block = f"transformer.h.{i}"
        w[f"{block}.attn.c_q.weight"] = randn(spec.n_head * head_dim, c)
        w[f"{block}.attn.c_k.weight"] = randn(kv_dim, c)
        w[f"{block}.attn.c_v.weight"] = randn(kv_dim, c)
        w[f"{block}.attn.c_proj.weight"] = randn(c, c, std=0.1)
        w[f"{block}.mlp.c_fc.weight"] = randn(4 * c, c, std=0.2)
        w[f"{block}.mlp.c_proj.weight"] = randn(c, 4 * c, std=0.05)
        if has_ve(i, spec.n_layer):
            w[f"{block}.attn.ve_gate.weight"] = randn(spec.n_kv_head, 12 if spec.master else 32)
            steps = torch.randint(-40, 41, (v, kv_dim), generator=generator).double()
            w[f"value_embeds.{i}.weight"] = steps * 3 / 1024 * 4
    for i in spec.l3_after_layers:
        layer = f"l3_layers.{i}"
        tables = ["kv_weight"] if spec.l3_tie_kv else ["k_weight", "v_weight"]
        w.update({f"{layer}.{name}": randn(spec.l3_n_emb, c, std=0.2) for name in tables})
        w[f"{layer}.w_up.weight"] = randn(spec.l3_d_up, c)
        w[f"{layer}.w_mix.weight"] = randn(c, spec.l3_d_up + c, std=0.1)
    if spec.l3_after_layers:
        counts, popularity = torch.ones(spec.vocab, dtype=torch.long), torch.rand(spec.vocab, generator=generator)
        for _ in range(spec.l3_n_emb - spec.vocab):  # skewed: popular tokens own more rows, up to l3_k_max
            token = int(torch.multinomial(popularity ** 4 * (counts < spec.l3_k_max), 1, generator=generator))
            counts[token] += 1
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        w.update({f"l3_layers.{i}.bounds": bounds for i in spec.l3_after_layers})
    return w


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)


def forward(w: dict, spec: Spec, ids: torch.LongTensor) -> torch.Tensor:
    """nanochat's `GPT.forward(ids)` of `spec.version` from its formulas, float64: logits `(B, T, vocab)`, cropped to
    the tokenizer's vocabulary and softcapped (15·tanh(·/15))."""
    batch, seq = ids.shape
    head_dim, c = spec.n_embd // spec.n_head, spec.n_embd
    x = rms_norm(w["transformer.wte.weight"][ids])
    if spec.master:  # smear: x_t += λ·σ(w·x_t[:24])·x_{t-1} for t ≥ 1
        gate = w["smear_lambda"] * torch.sigmoid(x[:, 1:, :24] @ w["smear_gate.weight"].T)
        x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
    x0 = x
    base = 100000 if spec.master else 10000
    inv_freq = (1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))).double()
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    half = head_dim // 2

    def rotate(t):  # nanochat's apply_rotary_emb: by -θ
        t1, t2 = t[..., :half], t[..., half:]
        return torch.cat([t1 * cos + t2 * sin, -t1 * sin + t2 * cos], dim=-1)

    offset = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]  # query − key
    backout = None
    for i, window in enumerate(spec.windows()):
        block = f"transformer.h.{i}"
        x = w["resid_lambdas"][i] * x + w["x0_lambdas"][i] * x0
        h = rms_norm(x)
        q = (h @ w[f"{block}.attn.c_q.weight"].T).view(batch, seq, spec.n_head, head_dim)
        k = (h @ w[f"{block}.attn.c_k.weight"].T).view(batch, seq, spec.n_kv_head, head_dim)
        v = (h @ w[f"{block}.attn.c_v.weight"].T).view(batch, seq, spec.n_kv_head, head_dim)
        if has_ve(i, spec.n_layer):
            channels, scale = (12, 3) if spec.master else (32, 2)
            gate = scale * torch.sigmoid(h[..., :channels] @ w[f"{block}.attn.ve_gate.weight"].T)
            v = v + gate[..., None] * w[f"value_embeds.{i}.weight"][ids].view(batch, seq, spec.n_kv_head, head_dim)
        qk_scale = 1.2 if spec.master else 1.0
        q, k = rms_norm(rotate(q)) * qk_scale, rms_norm(rotate(k)) * qk_scale
        k, v = (t.repeat_interleave(spec.n_head // spec.n_kv_head, dim=2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        allowed = (offset >= 0) & (offset <= window)
        y = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
        x = x + y.reshape(batch, seq, c) @ w[f"{block}.attn.c_proj.weight"].T
        x = x + F.relu(rms_norm(x) @ w[f"{block}.mlp.c_fc.weight"].T).square() @ w[f"{block}.mlp.c_proj.weight"].T
        if i in spec.l3_after_layers:
            x = x + l3_delta(w, spec, f"l3_layers.{i}", x, ids)
        if spec.master and i == spec.n_layer // 2:
            backout = x
    if backout is not None:
        x = x - w["backout_lambda"] * backout
    logits = rms_norm(x) @ w["lm_head.weight"].T
    return 15 * torch.tanh(logits[..., : spec.vocab] / 15)


def l3_delta(w: dict, spec: Spec, name: str, x: torch.Tensor, ids: torch.LongTensor) -> torch.Tensor:
    """The L3 fork's `L3Layer.forward` (nanochat/l3.py at b7629ef): scores `K_t·Norm(x)` (no 1/√C), softmax over the
    token's rows, `w_mix[Norm(w_up(V_tᵀ p)); x]` with the un-normed x."""
    keys = w[f"{name}.kv_weight" if spec.l3_tie_kv else f"{name}.k_weight"]
    values = w[f"{name}.kv_weight" if spec.l3_tie_kv else f"{name}.v_weight"]
    bounds = w[f"{name}.bounds"]
    x_norm, out = rms_norm(x), torch.zeros_like(x)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            rows = slice(int(bounds[ids[b, t]]), int(bounds[ids[b, t] + 1]))
            probs = torch.softmax(keys[rows] @ x_norm[b, t], dim=0)
            out[b, t] = probs @ values[rows]
    up = rms_norm(out @ w[f"{name}.w_up.weight"].T)
    return torch.cat([up, x], dim=-1) @ w[f"{name}.w_mix.weight"].T


def write_checkpoint(folder: Path, weights: dict, spec: Spec, step: int, prefix: str = "") -> Path:
    """`model_<step>.pt` and `meta_<step>.json` as nanochat's `save_checkpoint` writes them (`torch.save` of the state
    dict; `wte` / `value_embeds` in bf16, the rest float32; `prefix="_orig_mod."` as a compiled model's keys)."""
    folder.mkdir(parents=True, exist_ok=True)
    stored = {}
    for name, tensor in weights.items():
        if name.endswith("bounds"):
            stored[prefix + name] = tensor
        elif name.startswith(("transformer.wte", "value_embeds")):
            stored[prefix + name] = tensor.to(torch.bfloat16)
        else:
            stored[prefix + name] = tensor.float()
    torch.save(stored, folder / f"model_{step:06d}.pt")
    meta = {"step": step, "val_bpb": 1.25, "model_config": spec.model_config(), "user_config": {"depth": spec.n_layer}}
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))
    return folder

