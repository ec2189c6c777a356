"""GGUF input: a tiny Qwen3 and its tokenizer, written to a GGUF file by the `gguf` package as llama.cpp lays it out
(Q8_0 matrices, F32 norms, the tokenizer in the metadata), loads through the SFT recipe's loader as a dense model whose
weights are the file's dequantized values, trains a LoRA step, and `python -m hfl3.data.inspect --gguf_file` reads the
file's tokenizer."""

import re

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hfl3.data import inspect as inspect_cli
from hfl3.data.chat import read_chat_jsonl, write_chat_jsonl
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.sft.config import ChatSFTConfig
from hfl3.trainers.sft.builder import build_sft_trainer

GGUF_NAME = "tiny-qwen3-Q8_0.gguf"
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def write_qwen3_gguf(model: Qwen3ForCausalLM, tokenizer_dir, path) -> dict[str, torch.Tensor]:
    """Write `model` (tied embeddings) and the byte-level BPE tokenizer saved in `tokenizer_dir` to a GGUF file.

    Returns:
        What a reader must get back, by transformers parameter name: the dequantized Q8_0 blocks of each matrix and
        the float32 norms.
    """
    config, tokenizer = model.config, AutoTokenizer.from_pretrained(tokenizer_dir)
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("llama-bpe")  # the split closest to hfl3's (digit runs of up to 3 instead of 2)
    vocab = {index: token for token, index in tokenizer.get_vocab().items()}
    special = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    writer.add_token_list([vocab[index] for index in range(len(tokenizer))])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL for index in range(len(tokenizer))]
    )
    gguf.SpecialVocab(tokenizer_dir, load_merges=True).add_to_gguf(writer, quiet=True)  # merges, BOS/EOS, template
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output.weight then
            continue
        data, gguf_name = tensor.numpy(), names.get_name(name, try_suffixes=(".weight",))
        if data.ndim == 2:
            blocks = gguf.quantize(data, Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=Q8_0)
            data = gguf.dequantize(blocks, Q8_0)
        else:
            writer.add_tensor(gguf_name, data)
        expected[name] = torch.from_numpy(data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory, assets):
    """`(folder holding only the GGUF file, original model, expected weights, tokenizer, chat file)`."""
    work = tmp_path_factory.mktemp("gguf")
    text = (assets / "text" / "tinyshakespeare.txt").read_text()
    tokenizer = train_tokenizer([text[:60_000]], vocab_size=512)
    tokenizer.save_pretrained(work / "tokenizer")
    torch.manual_seed(0)
    # head_dim 128: transformers 5.23 reads Qwen3 GGUF configs without `attention.key_length` (Qwen3's default is 128)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    (work / "model").mkdir()
    expected = write_qwen3_gguf(model, work / "tokenizer", work / "model" / GGUF_NAME)
    lines = [line for line in text[200_000:220_000].splitlines() if len(line.split()) >= 4]
    chats = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
             for question, answer in zip(lines[0:24:2], lines[1:24:2])]
    return work / "model", model, expected, tokenizer, write_chat_jsonl(chats, work / "chats.jsonl")


def test_gguf_loads_dense_equal_to_the_file_and_trains_lora(gguf_model, tmp_path, sft_recipe):
    folder, original, expected, _, chats = gguf_model
    # What the loader must undo: transformers keeps its GGUF quantizer on the model, and the Trainer refuses that
    assert AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME).is_quantized
    args = ChatSFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, max_length=64, learning_rate=1e-2,
        eval_strategy="no", load_best_model_at_end=False, save_strategy="no", report_to="none", disable_tqdm=True,
    )
    model_args = sft_recipe.SFTModelArguments(
        model_name_or_path=str(folder), gguf_file=GGUF_NAME, lora_r=4, lora_alpha=8, lora_dropout=0.0
    )
    run = build_sft_trainer(sft_recipe.SFTScriptArguments(train_file=str(chats)), args, model_args)
    trainer, metadata = run.trainer, run.metadata
    base = trainer.model.get_base_model()
    assert not base.is_quantized and getattr(base, "hf_quantizer", None) is None
    assert getattr(base.config, "quantization_config", None) is None
    assert metadata["base_model"]["gguf_file"] == GGUF_NAME
    loaded = {name.replace(".base_layer", ""): p.detach().clone() for name, p in base.named_parameters()}
    for name, value in expected.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], value), name
        reference = original.state_dict()[name]
        if value.ndim == 2:  # Q8_0 rounds each weight to within half a step of its 32-weight block's scale
            assert not torch.equal(value, reference) and (value - reference).abs().max() <= reference.abs().max() / 127
    # Same function as a Qwen3 built from the config with the dequantized weights (config read back correctly too)
    reference_model = Qwen3ForCausalLM(original.config).eval()
    reference_model.load_state_dict(expected, strict=False)
    ids = torch.tensor([trainer.train_dataset[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(input_ids=ids).logits, reference_model(input_ids=ids).logits)
    trainer.train()
    trained = {name.replace(".base_layer", ""): p for name, p in base.named_parameters()}
    lora_b = [p for name, p in trained.items() if "lora_B" in name]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: one step moved every adapter
    assert all(torch.equal(trained[name], loaded[name]) for name in expected)  # the base stays frozen


def test_gguf_tokenizer_drives_the_recipe_and_inspect(gguf_model, capsys):
    folder, _, _, tokenizer, chats = gguf_model
    from_gguf = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    messages = list(read_chat_jsonl(chats)[0].messages)
    assert from_gguf.chat_template == tokenizer.chat_template
    assert from_gguf.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    text = " ".join(message["content"] for record in read_chat_jsonl(chats) for message in record.messages)
    assert from_gguf(text)["input_ids"] == tokenizer(text)["input_ids"]
    arguments = ["--tokenizer", str(folder), "--gguf_file", GGUF_NAME, "--data", str(chats), "--n", "2"]
    assert inspect_cli.main(arguments) == 0
    out = capsys.readouterr().out  # not a terminal: markers, no ANSI codes
    assert "\033[" not in out
    replies = [record.messages[-1]["content"] + "<|im_end|>" for record in read_chat_jsonl(chats)[:2]]
    assert re.findall(r"\[\[(.*?)\]\]", out, flags=re.S) == replies
