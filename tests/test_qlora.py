"""QLoRA: `--load_in_4bit` / `--load_in_8bit` load the base as TRL does (`hfl3.trainers.sft.base_model`), LoRA trains on
it through `ChatSFTTrainer`, the adapter reloads on a base quantized the same way, the merge equals the adapter
model, an L3GPT keeps its tables, embeddings and gates in high precision, and bad combinations stop before any work.
Tiny models from configs, the fixture Qwen3 tokenizer, GSM8K chats; bitsandbytes' CPU backend."""

import json

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, Qwen3Config, Qwen3ForCausalLM
from trl import get_peft_config

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data.chat import read_chat_jsonl, write_chat_jsonl
from hfl3.data.sft import load_sft_data
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.sft import base_model
from hfl3.trainers.sft.base_model import (
    check_quantization_arguments,
    load_base_model,
    merge_adapter,
    quantization_metadata,
)
from hfl3.evaluate.chatcore import chatcore_eval_results
from hfl3.provenance.card import sft_model_card
from hfl3.trainers.sft.trainer import ChatSFTTrainer
from hfl3.trainers.sft.config import ChatSFTConfig, SFTModelArguments

bnb = pytest.importorskip("bitsandbytes", reason="the qlora extra: pip install 'hfl3[qlora]'")

BF16_EPS = 2.0**-8  # bfloat16's unit round-off (8 significant bits)


def training_args(tmp_path, **kwargs) -> ChatSFTConfig:
    return ChatSFTConfig(output_dir=str(tmp_path / "out"), report_to="none", disable_tqdm=True, seed=0, **kwargs)


def model_args(folder, **kwargs) -> SFTModelArguments:
    return SFTModelArguments(model_name_or_path=str(folder), lora_r=4, lora_alpha=8, lora_dropout=0.0, **kwargs)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, assets):
    """A tiny Qwen3 (tied embeddings, every projection 64 wide or more: whole 64-weight NF4 blocks) with the real
    Qwen3 tokenizer, saved in float32."""
    folder = tmp_path_factory.mktemp("qwen3_base")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gsm8k_ids(qwen3_folder, assets):
    """The first 32 tokens of two GSM8K questions and answers as Qwen3 token ids, (2, 32)."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    records = read_chat_jsonl(assets / "chat" / "gsm8k_messages_train.jsonl")[:2]
    return torch.tensor([tokenizer(r.messages[1]["content"] + r.messages[2]["content"])["input_ids"][:32]
                         for r in records])


def lora_on(model, target_modules=("q_proj", "v_proj", "up_proj")):
    """LoRA with random (non-zero) B, so the adapter changes the output."""
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules),
                                                  task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    return peft_model


def linear_layers(model) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def repacked_layers(model) -> list[str]:
    """The 4-bit layers whose weights bitsandbytes repacked for its CPU kernel (`hfl3.trainers.sft.base_model`)."""
    return [name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)
            and getattr(module.weight.quant_state, "packing_format_for_cpu", False)]


# ---- loading -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_load_in_4bit_gives_nf4_layers_with_the_load_dtype_as_compute_dtype(qwen3_folder, tmp_path, dtype):
    # --dtype float32 (TRL's default) or auto, and model_init_kwargs' bfloat16: model_init_kwargs wins, as in `trl sft`
    args = model_args(qwen3_folder, load_in_4bit=True, use_bnb_nested_quant=True, dtype=dtype)
    train = training_args(tmp_path, model_init_kwargs={"dtype": "bfloat16"})
    assert check_quantization_arguments(args, train) == 4
    model = load_base_model(args, train)
    layers = linear_layers(model)
    quantized = {name for name, layer in layers.items() if isinstance(layer, bnb.nn.Linear4bit)}
    assert quantized == set(layers) - {"lm_head"} and len(quantized) == 14  # 2 layers × (4 attention + 3 MLP)
    state = model.model.layers[0].self_attn.q_proj.weight.quant_state
    assert state.quant_type == "nf4" and state.dtype == torch.bfloat16 and state.nested
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.is_loaded_in_4bit


def test_model_init_kwargs_dtype_acts_without_quantization(qwen3_folder, tmp_path):
    # before: --model_init_kwargs '{"dtype": "bfloat16"}' was ignored and the base trained in float32
    args = model_args(qwen3_folder)
    model = load_base_model(args, training_args(tmp_path, model_init_kwargs={"dtype": "bfloat16"}))
    assert check_quantization_arguments(args, training_args(tmp_path)) is None
    assert model.dtype == torch.bfloat16 and quantization_metadata(model) is None
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_load_in_8bit_trains_lora_through_int8_layers(qwen3_folder, tmp_path, gsm8k_ids):
    model = load_base_model(model_args(qwen3_folder, load_in_8bit=True), training_args(tmp_path))
    assert isinstance(model.model.layers[1].mlp.down_proj, bnb.nn.Linear8bitLt)
    peft_model = lora_on(model)
    peft_model(input_ids=gsm8k_ids, labels=gsm8k_ids).loss.backward()
    gradients = [p.grad for name, p in peft_model.named_parameters() if "lora_A" in name]
    assert gradients and all(g is not None and g.abs().sum() > 0 and torch.isfinite(g).all() for g in gradients)
    assert quantization_metadata(model)["quant_type"] == "llm_int8"


# ---- refusals before any work --------------------------------------------------------------------------------------

REFUSALS = [  # (name, model arguments, model_init_kwargs, bitsandbytes installed, message)
    ("4-bit and 8-bit", dict(load_in_4bit=True), None, True, "--load_in_4bit and --load_in_8bit: choose one"),
    ("quant type without 4-bit", dict(bnb_4bit_quant_type="fp4"), None, True,
     "--bnb_4bit_quant_type fp4: 4-bit options without --load_in_4bit"),
    ("nested without 4-bit", dict(load_in_8bit=True, use_bnb_nested_quant=True), None, True,
     "--use_bnb_nested_quant True: 4-bit options without --load_in_4bit"),
    ("storage without 4-bit", dict(bnb_4bit_quant_storage="bfloat16"), None, True,
     "--bnb_4bit_quant_storage bfloat16: 4-bit options without --load_in_4bit"),
    ("bitsandbytes missing", dict(load_in_4bit=True), None, False, r"pip install 'hfl3\[qlora\]'"),
    ("full fine-tuning", dict(load_in_8bit=True, use_peft=False), None, True,
     "--load_in_8bit with --use_peft false: a quantized base cannot be fully fine-tuned"),
    ("GGUF", dict(load_in_4bit=True, gguf_file="model.gguf"), None, True,
     "--load_in_4bit with --gguf_file model.gguf"),
    ("quantization twice", dict(load_in_4bit=True), {"quantization_config": {"load_in_4bit": True}}, True,
     "a quantization_config in --model_init_kwargs"),
    ("auto dtype", dict(load_in_4bit=True, dtype="auto"), None, True, "--load_in_4bit with dtype 'auto'"),
    ("auto dtype from model_init_kwargs", dict(load_in_4bit=True), {"dtype": "auto"}, True,
     "--load_in_4bit with dtype 'auto'"),
    ("storage dtype", dict(load_in_4bit=True, bnb_4bit_quant_storage="int4"), None, True,
     "--bnb_4bit_quant_storage int4: expected one of"),
]


@pytest.mark.parametrize("arguments, init_kwargs, installed, message", [case[1:] for case in REFUSALS],
                         ids=[case[0] for case in REFUSALS])
def test_quantization_arguments_are_refused_in_one_line(tmp_path, monkeypatch, arguments, init_kwargs, installed,
                                                        message):
    monkeypatch.setattr(base_model, "is_bitsandbytes_available", lambda: installed)
    args = model_args(tmp_path, **arguments)
    if arguments.get("load_in_4bit") and message.startswith("--load_in_4bit and --load_in_8bit"):
        args.load_in_8bit = True  # TRL's ModelConfig refuses both at construction; a changed object gets here
    with pytest.raises(ValueError, match=message) as refused:
        check_quantization_arguments(args, training_args(tmp_path, model_init_kwargs=init_kwargs))
    assert "\n" not in str(refused.value)


# ---- training, saving, reloading -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(qwen3_folder, assets, tmp_path_factory):
    """Four LoRA steps on the NF4 base through ChatSFTTrainer (GSM8K chats, assistant-only labels), the adapter
    saved: (trainer, adapter folder, metadata, 4-bit weights before training)."""
    work = tmp_path_factory.mktemp("qlora_run")
    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    chats = write_chat_jsonl([{"messages": list(r.messages)} for r in
                              read_chat_jsonl(assets / "chat" / "gsm8k_messages_train.jsonl")[:8]],
                             work / "train.jsonl")
    data = load_sft_data(tokenizer, chats, seed=0, max_length=64)
    args = model_args(qwen3_folder, load_in_4bit=True, dtype="bfloat16", lora_target_modules=["q_proj", "v_proj"])
    train = training_args(work, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
                          eval_strategy="no", load_best_model_at_end=False, save_strategy="no", max_length=64)
    check_quantization_arguments(args, train)
    model = load_base_model(args, train)
    metadata = quantization_metadata(model)
    before = {name: module.weight.data.clone() for name, module in linear_layers(model).items()
              if isinstance(module, bnb.nn.Linear4bit)}
    trainer = ChatSFTTrainer(model=model, args=train, train_dataset=data.train, processing_class=tokenizer,
                             peft_config=get_peft_config(args))
    trainer.train()
    adapter = work / "adapter"
    trainer.model.save_pretrained(adapter)
    return trainer, adapter, metadata, before


def test_lora_trains_on_the_4bit_base_and_leaves_it_unchanged(trained):
    trainer, _, _, before = trained
    lora = {name: p for name, p in trainer.model.named_parameters() if "lora_" in name}
    assert lora and all(p.requires_grad for p in lora.values())
    assert all(p.abs().sum() > 0 for name, p in lora.items() if "lora_B" in name)  # B starts at zero: it moved
    base = trainer.model.get_base_model()
    # TRL's k-bit handling only: adapters cast to bfloat16; no prepare_model_for_kbit_training, which would have
    # upcast the (tied) embedding to float32
    assert {p.dtype for p in lora.values()} == {torch.bfloat16}
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16
    for name, weight in before.items():
        layer = base.get_submodule(name.replace("q_proj", "q_proj.base_layer").replace("v_proj", "v_proj.base_layer"))
        assert isinstance(layer, bnb.nn.Linear4bit) and torch.equal(layer.weight.data, weight), name


def test_the_adapter_reloads_on_a_base_quantized_as_the_metadata_says(trained, gsm8k_ids):
    trainer, adapter, metadata, _ = trained
    model = trainer.model.eval()
    with torch.no_grad():
        expected = model(input_ids=gsm8k_ids).logits.float()
    reloaded = AutoPeftModelForCausalLM.from_pretrained(
        adapter, quantization_config=BitsAndBytesConfig(**metadata["bitsandbytes_config"]), dtype=metadata["dtype"])
    assert isinstance(reloaded.get_base_model().model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    with torch.no_grad():
        logits = reloaded(input_ids=gsm8k_ids).logits.float()
    # the same NF4 weights and adapter: equal but for the adapter's bfloat16 values reloaded in float32
    tolerance = 4 * BF16_EPS * expected.abs().max()
    assert (logits - expected).abs().max() <= tolerance
    plain = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=metadata["dtype"])  # guard: unquantized base
    with torch.no_grad():
        assert (plain(input_ids=gsm8k_ids).logits.float() - expected).abs().max() > 4 * tolerance


def test_metadata_and_card_say_how_to_quantize_the_base_again(trained):
    _, _, metadata, _ = trained
    assert json.loads(json.dumps(metadata)) == metadata
    assert {key: metadata[key] for key in ("method", "bits", "quant_type", "compute_dtype", "nested_quantization",
                                           "storage_dtype", "dtype", "quantized_linear_modules",
                                           "unquantized_linear_modules")} == {
        "method": "bitsandbytes", "bits": 4, "quant_type": "nf4", "compute_dtype": "bfloat16",
        "nested_quantization": False, "storage_dtype": "uint8", "dtype": "bfloat16", "quantized_linear_modules": 14,
        "unquantized_linear_modules": ["lm_head"]}
    assert metadata["bitsandbytes_config"] == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                               "bnb_4bit_compute_dtype": "bfloat16"}
    run = {"base_model": {"name_or_path": "/models/qwen3", "quantization": metadata}}
    adapter_card = sft_model_card(run, "outputs/sft", adapter=True, model_index=chatcore_eval_results)["extra_markdown"]
    assert ("AutoPeftModelForCausalLM.from_pretrained('outputs/sft', quantization_config=BitsAndBytesConfig("
            "load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype='bfloat16'), dtype='bfloat16')"
            in adapter_card)
    merged_card = sft_model_card(run | {"merged": True}, "outputs/sft/merged", adapter=False,
                                 model_index=chatcore_eval_results)["extra_markdown"]
    assert "merged into its dequantized weights, in bfloat16" in merged_card and "BitsAndBytesConfig" not in merged_card


# ---- merging -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_into_the_dequantized_base_equals_the_adapter_model(qwen3_folder, tmp_path, gsm8k_ids, dtype):
    model = load_base_model(model_args(qwen3_folder, load_in_4bit=True, dtype=dtype), training_args(tmp_path))
    peft_model = lora_on(model)
    # PEFT's own merge, on a copy of the same model: each merged weight is rounded to NF4 again
    copy = lora_on(load_base_model(model_args(qwen3_folder, load_in_4bit=True, dtype=dtype), training_args(tmp_path)))
    copy.load_state_dict({key: value for key, value in peft_model.state_dict().items() if "lora_" in key}, strict=False)
    with torch.no_grad():
        expected = peft_model(input_ids=gsm8k_ids).logits.float()
        peft_merge = copy.merge_and_unload()(input_ids=gsm8k_ids).logits.float()
    # The tolerance below is for bitsandbytes' dequantize-and-matmul path in the compute dtype, which load_base_model
    # keeps on every CPU. On one with AVX512-BF16 this forward used to repack the weights for bitsandbytes' bfloat16
    # CPU kernel, and the merge then dequantized the down projections with transposed scales (float32: logits 0.061
    # off, 3.6 % of the largest, against 0.0002; that kernel's own bfloat16 round-off, which a wider tolerance would
    # have covered, is 0.4-0.6 % of the largest logit)
    assert not repacked_layers(peft_model)
    merged = merge_adapter(peft_model)
    assert not [name for name, layer in linear_layers(merged).items() if isinstance(layer, bnb.nn.Linear4bit)]
    assert merged.dtype == getattr(torch, dtype) and getattr(merged.config, "quantization_config", None) is None
    with torch.no_grad():
        logits = merged(input_ids=gsm8k_ids).logits.float()
    # float32: the same products summed in another order; bfloat16: W + ΔW rounded once more (one ulp of a weight)
    eps = torch.finfo(torch.float32).eps * 1e3 if dtype == "float32" else 4 * BF16_EPS
    tolerance = eps * expected.abs().max()
    assert (logits - expected).abs().max() <= tolerance
    assert (peft_merge - expected).abs().max() > 4 * tolerance  # guard: a requantized merge would fail this test
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(reloaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=gsm8k_ids).logits.float(), logits)


@pytest.mark.parametrize("nested", [False, True])
def test_merge_undoes_bitsandbytes_cpu_repacking(qwen3_folder, tmp_path, nested):
    # A base not loaded by load_base_model, run in eval mode on a CPU with AVX512-BF16, has its 4-bit weights repacked
    # for bitsandbytes' CPU kernel (base_model's docstring); the repacking is applied here as Linear4bit.forward does
    # (a layout change in plain torch, so on any CPU) and the merge must equal the merge of the same model unrepacked.
    # Nested scales too: bitsandbytes' own inverse quantizes them again, hfl3's keeps them as the kernel used them
    pack = getattr(bnb.functional, "_convert_weight_packed_for_cpu", None)
    if pack is None:
        pytest.skip("this bitsandbytes has no CPU repacking (bitsandbytes PR #1804)")
    quantized = model_args(qwen3_folder, load_in_4bit=True, use_bnb_nested_quant=nested)
    plain = lora_on(load_base_model(quantized, training_args(tmp_path)))
    repacked = lora_on(load_base_model(quantized, training_args(tmp_path)))
    repacked.load_state_dict({key: value for key, value in plain.state_dict().items() if "lora_" in key}, strict=False)
    for layer in repacked.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            before = layer.weight.data.clone()
            layer.weight.data, layer.weight.quant_state = pack(layer.weight.data, layer.weight.quant_state)
            assert not torch.equal(layer.weight.data.view(-1), before.view(-1))  # guard: the layout did change
    assert len(repacked_layers(repacked)) == 14
    expected = {name: layer.weight for name, layer in linear_layers(merge_adapter(plain)).items()}
    merged = {name: layer.weight for name, layer in linear_layers(merge_adapter(repacked)).items()}
    assert merged.keys() == expected.keys()
    for name, weight in expected.items():
        # the repacking rounded each block's scale to bfloat16: each dequantized weight moves by at most that rounding
        assert (merged[name] - weight).abs().max() <= BF16_EPS * weight.abs().max(), name


def test_evaluation_leaves_the_4bit_layers_trainable(qwen3_folder, tmp_path, gsm8k_ids, monkeypatch):
    # Linear4bit asks has_avx512bf16() when it is built; answering yes makes every layer behave as on such a CPU,
    # where bitsandbytes repacks it at its first eval-mode forward and then computes it, in training too, with a kernel
    # that has no backward: after the Trainer's step-0 evaluation every adapter here had a zero gradient
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    peft_model = lora_on(load_base_model(model_args(qwen3_folder, load_in_4bit=True, dtype="bfloat16"),
                                         training_args(tmp_path)))
    peft_model.eval()
    with torch.no_grad():
        peft_model(input_ids=gsm8k_ids)
    assert not repacked_layers(peft_model)
    peft_model.train()
    peft_model(input_ids=gsm8k_ids, labels=gsm8k_ids).loss.backward()
    gradients = {name: p.grad for name, p in peft_model.named_parameters() if "lora_A" in name}
    assert len(gradients) == 6 and all(g is not None and g.abs().sum() > 0 for g in gradients.values())


def test_8bit_merge_adds_the_update_to_the_dequantized_int8_weights(qwen3_folder, tmp_path):
    model = load_base_model(model_args(qwen3_folder, load_in_8bit=True), training_args(tmp_path))
    peft_model = lora_on(model, ["down_proj"])
    layer = peft_model.get_base_model().model.layers[1].mlp.down_proj
    int8 = layer.base_layer.weight
    expected = int8.data.float() * int8.SCB.view(-1, 1) / 127 + layer.get_delta_weight("default")
    merged = merge_adapter(peft_model)
    torch.testing.assert_close(merged.model.layers[1].mlp.down_proj.weight, expected, rtol=0, atol=1e-6)


# ---- L3GPT ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def l3gpt_folder(tmp_path_factory, assets):
    folder = tmp_path_factory.mktemp("l3gpt_base")
    tokenizer = train_tokenizer([(assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]], vocab_size=512)
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(
        2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32, max_position_embeddings=128,
        window_pattern="L", l3_after_layers=[0], l3_n_emb=4 * len(tokenizer), l3_k_max=16, l3_d_up=64,
    )
    model = L3GPTForCausalLM(config)
    with torch.no_grad():  # the zero-initialised projections a pretrained model would not have (nanochat's init)
        for parameter in model.parameters():
            if parameter.ndim == 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_l3gpt_keeps_tables_embeddings_and_gates_in_high_precision_and_trains(l3gpt_folder, tmp_path, assets):
    model = load_base_model(model_args(l3gpt_folder, load_in_4bit=True, dtype="bfloat16"), training_args(tmp_path))
    kept = {"lm_head", "model.smear.gate", "model.layers.1.self_attn.value_embedding_gate"}
    layers = linear_layers(model)
    assert {name for name, layer in layers.items() if not isinstance(layer, bnb.nn.Linear4bit)} == kept
    assert {"model.l3_layers.0.up_proj", "model.l3_layers.0.mix_proj", "model.layers.0.mlp.up_proj"} < set(layers)
    tables = (model.model.embed_tokens, model.model.value_embeddings["1"], model.model.l3_layers["0"].key_table)
    for embedding in tables:
        assert type(embedding) is torch.nn.Embedding and embedding.weight.dtype == torch.bfloat16
    assert quantization_metadata(model)["unquantized_linear_modules"] == sorted(kept)
    tokenizer = AutoTokenizer.from_pretrained(l3gpt_folder)
    ids = torch.tensor([tokenizer((assets / "text" / "tinyshakespeare.txt").read_text()[:400])["input_ids"][:48]])
    peft_model = lora_on(model, ["q_proj", "v_proj", "mix_proj"])
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    gradients = {name: p.grad for name, p in peft_model.named_parameters() if "lora_A" in name}
    assert len(gradients) == 5 and all(g.abs().sum() > 0 and torch.isfinite(g).all() for g in gradients.values())
