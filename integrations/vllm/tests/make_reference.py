"""Reference side of the serving tests: tiny L3GPT folders and transformers' greedy generations from them.

Runs in hfl3's environment (transformers 5.23; the serving environment has vLLM's older transformers and no hfl3):

    .venv/bin/python integrations/vllm/tests/make_reference.py OUT_DIR PART     # PART: generation, serve or lora

`conftest.py` runs each part once per test session, when a test first needs it.

`generation`: for each model kind, `OUT_DIR/<kind>/` (an L3GPT folder as hfl3 saves it: `config.json` with
`auto_map`, the remote code, `model.safetensors`, the tokenizer) and `OUT_DIR/<kind>.json` with:
- `prompts`: token ids of prompts of mixed lengths (Tiny Shakespeare, the folder's tokenizer);
- `tokens`: transformers' `generate` of them in one left-padded batch, float32, CPU, greedy, `NEW_TOKENS` new
  tokens each, never stopping at EOS (as vLLM's `ignore_eos`), no token suppressed;
- `first_logprobs`: per prompt, the log-softmax of the first new token's logits, top `TOP_K` `[[id, logprob]]`;
- `margins`: per prompt and step, the gap between the two largest logits (how close a tie came);
- `without`: per feature of the kind (smear, value embeddings, backout, L3 layers, sliding window), the tokens with
  that feature switched off: the guard that each one changes what is generated, so equal tokens test it.

Kinds: `dense` (nanochat master's core: value embeddings, smear, backout, GQA, sliding windows), `l3` (the same with
two L3 layers and an LZW allocation), `l3_untied` (those layers with separate key and value tables and
`l3_mix_input="residual"`), `legacy` (a `config.json` written before value embeddings, smear and backout,
loaded with them off) and `nanochat` (a nanochat master checkpoint converted by `convert_nanochat_to_hf`). Weights
are random and every matrix non-zero (fresh inits zero the output projections, `smear_lambda` and the L3 `mix_proj`,
which would make those paths vanish).

`serve`: `OUT_DIR/recipe/`, the folder `recipes/pretrain.py` writes with `recipes/configs/pretrain_tiny.yaml` (an
L3GPT with an L3 layer, value embeddings, smear, its BPE tokenizer and ChatML template), and `OUT_DIR/chat.json`:
a conversation, its prompt ids through the folder's chat template, and the greedy `CHAT_TOKENS` new tokens.

`lora`: for each base (`qwen3`: a tiny Qwen3 with the Qwen3 tokenizer of tests/fixtures; `l3gpt`: a tiny L3GPT as
in `generation`), `OUT_DIR/lora_<base>/base/`, the SFT recipe's adapter in `OUT_DIR/lora_<base>/adapter/` (LoRA on
q_proj and v_proj, `recipes/configs/sft_tiny.yaml`, on short Tiny Shakespeare chats, `--merge`), and
`OUT_DIR/lora_<base>.json`: chat prompts, the greedy tokens, first log-probabilities and margins of PEFT's merged
model (`adapter/merged/`) as in `generation`, and the base's greedy tokens (the guard: the adapter changes them).
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import torch

import hfl3  # noqa: F401  (registers L3GPT with the Auto classes)
from hfl3.models.l3gpt import L3GPTConfig, L3GPTForCausalLM, lzw_allocation
from hfl3.tokenization import train_tokenizer

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from nanochat_reference import Spec, random_weights, train_ranks, write_checkpoint, write_tokenizer_pickle  # noqa: E402

NEW_TOKENS = 64
CHAT_TOKENS = 16
TOP_K = 5
SEED = 0
# Prompt lengths (tokens): one below the sliding window, others across it; two share a 40-token prefix (prefix
# caching), one is the first half of another.
PROMPT_LENGTHS = (5, 19, 40, 71)
SLIDING_WINDOW = 24


def shakespeare() -> str:
    return (REPO / "tests" / "fixtures" / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")


def tiny_config(tokenizer, **fields) -> L3GPTConfig:
    """A 4-layer, 64-wide L3GPT over `tokenizer`'s vocabulary (head_dim 32: vLLM's CPU attention needs >= 32)."""
    return L3GPTConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, max_position_embeddings=256, window_pattern="SSL",
                       sliding_window=SLIDING_WINDOW, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **fields)


@torch.no_grad()
def randomize(model: L3GPTForCausalLM) -> None:
    """Every weight random and non-zero: matrices N(0, 1/fan_in) (lm_head wider, logits of std ~3, well inside the
    softcap of 15), `smear_lambda` 0.6; tables, gates and scalars keep their (non-zero) init."""
    generator = torch.Generator().manual_seed(SEED + 1)
    for name, param in model.named_parameters():
        if name.endswith(("proj.weight", "lm_head.weight")):
            std = (3.0 if name == "lm_head.weight" else 1.0) / param.shape[1] ** 0.5
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    if model.model.smear is not None:
        model.model.smear.smear_lambda.fill_(0.6)


def prompts(tokenizer) -> list[list[int]]:
    text = shakespeare()[:20_000]
    ids = tokenizer(text)["input_ids"]
    shared = ids[1000:1040]
    return [ids[:PROMPT_LENGTHS[0]], ids[500:500 + PROMPT_LENGTHS[1]], shared, shared + ids[2000:2031]]


@torch.no_grad()
def greedy(model, batch: list[list[int]], pad_id: int) -> tuple[list[list[int]], list, list]:
    """transformers' `generate`: one left-padded batch, greedy, `NEW_TOKENS` tokens, no EOS stop or suppression."""
    width = max(map(len, batch))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=NEW_TOKENS, min_new_tokens=0, eos_token_id=None, pad_token_id=pad_id,
                         suppress_tokens=None, begin_suppress_tokens=None, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[:, width:].tolist()
    logits = torch.stack(out.logits, dim=1).double()  # (B, NEW_TOKENS, V)
    top2 = logits.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).tolist()
    first = torch.log_softmax(logits[:, 0], dim=-1).topk(TOP_K, dim=-1)
    first_logprobs = [[[int(i), float(v)] for i, v in zip(ids, values)]
                      for ids, values in zip(first.indices.tolist(), first.values.tolist())]
    return tokens, first_logprobs, margins


def switched_off(model, feature: str):
    """A copy of `model` without `feature` (zeroed at its source), for the guard."""
    other = copy.deepcopy(model)
    base = other.model
    with torch.no_grad():
        if feature == "smear":
            base.smear.smear_lambda.zero_()
        elif feature == "value_embeddings":
            for table in base.value_embeddings.values():
                table.weight.zero_()
        elif feature == "backout":
            base.backout_lambda.zero_()
        elif feature == "l3_layers":
            for layer in base.l3_layers.values():
                layer.mix_proj.weight.zero_()
        elif feature == "sliding_window":
            other.config.sliding_window = 10_000  # the masks' window: longer than any sequence here
            for layer in base.layers:
                layer.self_attn.sliding_window = None
    return other


def features(config) -> list[str]:
    present = {"smear": config.use_smear_gate, "value_embeddings": bool(config.value_embedding_layers),
               "backout": config.use_backout, "l3_layers": bool(config.l3_after_layers),
               "sliding_window": "sliding_attention" in config.layer_types}
    return [name for name, on in present.items() if on]


def write_reference(folder: Path, model, tokenizer, batch: list[list[int]]) -> None:
    """`<folder>.json` as the module docstring lists it, for `model` in float32."""
    model = model.float().eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.bos_token_id
    tokens, first_logprobs, margins = greedy(model, batch, pad_id)
    without = {feature: greedy(switched_off(model, feature), batch, pad_id)[0] for feature in features(model.config)}
    reference = {"prompts": batch, "tokens": tokens, "first_logprobs": first_logprobs, "margins": margins,
                 "without": without, "new_tokens": NEW_TOKENS}
    folder.with_suffix(".json").write_text(json.dumps(reference))


def hfl3_model(out: Path, kind: str, tokenizer) -> Path:
    """The folder of `kind` (see the module docstring) in `out/kind`."""
    torch.manual_seed(SEED)
    fields = {}
    if kind.startswith("l3"):
        fields = dict(l3_after_layers=[1, 2], l3_n_emb=4 * len(tokenizer), l3_k_max=16, l3_d_up=64)
    if kind == "l3_untied":  # the other table and W_mix-input options (nanochat's L3 fork's)
        fields.update(l3_tie_kv=False, l3_mix_input="residual")
    if kind == "legacy":
        fields = dict(value_embedding_layers=[], use_smear_gate=False, use_backout=False)
    config = tiny_config(tokenizer, **fields)
    model = L3GPTForCausalLM(config)
    if kind.startswith("l3"):
        sample = tokenizer(shakespeare()[100_000:300_000])["input_ids"]
        model.set_l3_allocation(lzw_allocation([sample], config.vocab_size, config.l3_n_emb, config.l3_k_max))
    randomize(model)
    folder = out / kind
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if kind == "legacy":  # as written before the fields existed: the loader must read them as off
        config_file = folder / "config.json"
        saved = json.loads(config_file.read_text())
        for field in ("value_embedding_layers", "use_smear_gate", "use_backout", "smear_gate_channels",
                      "value_embedding_gate_channels"):
            saved.pop(field)
        config_file.write_text(json.dumps(saved, indent=2))
    return folder


def nanochat_model(out: Path) -> None:
    from hfl3.nanochat.convert_nanochat_to_hf import convert
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = Spec("master", vocab=500, sequence_len=256, n_head=2, n_kv_head=1)  # head_dim 32
    ranks = train_ranks(shakespeare()[:300_000], 491)
    work = out / "nanochat_source"
    write_tokenizer_pickle(work / "tokenizer", ranks)
    checkpoint = write_checkpoint(work / "base_checkpoints" / "d3", random_weights(spec, SEED), spec, 100)
    folder = convert(checkpoint, work / "tokenizer", out / "nanochat")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    write_reference(folder, AutoModelForCausalLM.from_pretrained(folder), tokenizer, prompts(tokenizer))


def generation(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer([shakespeare()[:300_000]], vocab_size=512)
    for kind in ("dense", "l3", "l3_untied", "legacy"):
        folder = hfl3_model(out, kind, tokenizer)
        write_reference(folder, AutoModelForCausalLM.from_pretrained(folder), tokenizer, prompts(tokenizer))
    nanochat_model(out)


def run_recipe(*arguments: str) -> None:
    """`python recipes/<arguments>` in this environment; raises with the recipe's output tail when it fails."""
    result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, cwd=REPO, timeout=900)
    if result.returncode:
        raise RuntimeError(f"{arguments[0]} failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")


@torch.no_grad()
def chat_tokens(model, prompt_ids: list[int]) -> list[int]:
    """Greedy `CHAT_TOKENS` new tokens, no EOS stop."""
    out = model.float().eval().generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=CHAT_TOKENS,
                                        eos_token_id=None, pad_token_id=0, suppress_tokens=None)
    return out[0, len(prompt_ids):].tolist()


def serve(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = out / "recipe"
    run_recipe("recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", "--output_dir", str(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the meaning of a def?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    tokens = chat_tokens(AutoModelForCausalLM.from_pretrained(folder), prompt_ids)
    (out / "chat.json").write_text(json.dumps({"messages": messages, "prompt_ids": prompt_ids, "tokens": tokens}))


def shakespeare_chats(n: int) -> list[dict]:
    """Short real chats: a line of Tiny Shakespeare asks, the next one answers."""
    lines = [line for line in shakespeare()[:50_000].splitlines() if len(line.split()) >= 4]
    return [{"messages": [{"role": "user", "content": lines[2 * i]},
                          {"role": "assistant", "content": lines[2 * i + 1]}]} for i in range(n)]


def qwen3_base(folder: Path) -> None:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REPO / "tests" / "fixtures" / "tokenizers" / "qwen3")
    torch.manual_seed(SEED)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # logits of std ~1 (the init's are ~0.02: every step would be a near tie)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def lora(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = out / "lora_chats.jsonl"
    train.write_text("".join(json.dumps(chat) + "\n" for chat in shakespeare_chats(32)))
    for base in ("qwen3", "l3gpt"):
        work = out / f"lora_{base}"
        if base == "qwen3":
            qwen3_base(work / "base")
        else:
            tokenizer = train_tokenizer([shakespeare()[:300_000]], vocab_size=512)
            hfl3_model(work, "base", tokenizer)
        run_recipe("recipes/sft_lora.py", "--config", "recipes/configs/sft_tiny.yaml", "--model_name_or_path",
                   str(work / "base"), "--train_file", str(train), "--num_train_epochs", "2", "--learning_rate",
                   "0.05", "--merge", "--output_dir", str(work / "adapter"))
        tokenizer = AutoTokenizer.from_pretrained(work / "base")
        prompts_ids = [tokenizer.apply_chat_template(chat["messages"][:1], add_generation_prompt=True, tokenize=True,
                                                     return_dict=False) for chat in shakespeare_chats(40)[-3:]]
        merged = AutoModelForCausalLM.from_pretrained(work / "adapter" / "merged").float().eval()
        base_model = AutoModelForCausalLM.from_pretrained(work / "base").float().eval()
        tokens, first_logprobs, margins = greedy(merged, prompts_ids, tokenizer.pad_token_id)
        reference = {"prompts": prompts_ids, "tokens": tokens, "first_logprobs": first_logprobs, "margins": margins,
                     "base_tokens": greedy(base_model, prompts_ids, tokenizer.pad_token_id)[0]}
        work.with_suffix(".json").write_text(json.dumps(reference))


PARTS = {"generation": generation, "serve": serve, "lora": lora}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, part = Path(sys.argv[1]), sys.argv[2]
    out_dir.mkdir(parents=True, exist_ok=True)
    PARTS[part](out_dir)
