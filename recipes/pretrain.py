"""Pretrain an L3GPT on text with the HF Trainer: tokenizer, LZW allocation, BOS-aligned packing, bpb eval.

    # the demo (Python stdlib sources, L3 on, ~8 minutes on 2 CPU cores)
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain.py --config recipes/configs/demo.yaml
    # the Gutenberg novels in ../shared/assets/text, Muon
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain.py \
        --config recipes/configs/gutenberg.yaml --optimizer muon
    # one GPU
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/pretrain.py \
        --config recipes/configs/gutenberg.yaml --depth 12 --bf16

Outputs in `--output_dir`: model.safetensors + config.json + remote code, tokenizer, metadata.json, README.md
(model card), all_results.json (eval_bpb), loss.png.
"""

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hfl3  # before transformers: keeps torchao's import-time warnings out of the launch (hfl3/fp8/ao.py)
import torch
from transformers import AutoModelForCausalLM, set_seed
from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config
from trl import TrlParser

from hfl3 import L3GPTConfig, L3GPTForCausalLM, fp8, provenance
from hfl3.callbacks import LossPlotCallback, SampleCallback, ThroughputCallback, flops_per_token
from hfl3.data import text
from hfl3.models.l3gpt import lzw_allocation
from hfl3.tokenization import load_tokenizer, token_bytes, train_tokenizer
from hfl3.trainers.launch import check_world_size, parse_recipe_args
from hfl3.trainers.pretrain import BitsPerByte, L3GPTTrainer, PackedCollator, PretrainConfig

logger = logging.getLogger("hfl3.pretrain")


@dataclass
class ScriptArguments:
    dataset: str = field(default="stdlib", metadata={"help": "stdlib, files/folders/globs (comma-separated), or a "
                                                     "datasets name/path"})
    text_column: str = field(default="text", metadata={"help": "text column of a datasets source"})
    dataset_split: str = field(default="train", metadata={"help": "split of a datasets source"})
    max_documents: int | None = field(default=None, metadata={"help": "use only the first N documents (seeded)"})
    skip_invalid_files: bool = field(default=False, metadata={"help": "skip non-UTF-8/empty files (counted)"})
    val_fraction: float = field(default=0.05, metadata={"help": "share of documents held out for validation"})
    max_eval_rows: int | None = field(default=None, metadata={"help": "cap on packed validation rows"})
    document_max_chars: int | None = field(default=None, metadata={"help": "cut documents into pieces of at most "
                                                                "this many characters (default: max_seq_len)"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "existing tokenizer; else train one"})
    vocab_size: int = field(default=32768, metadata={"help": "vocabulary of the trained BPE"})
    tokenizer_train_chars: int = field(default=20_000_000, metadata={"help": "characters to train the BPE on"})
    l3_sample_tokens: int = field(default=2_000_000, metadata={"help": "training tokens LZW-scanned for L3"})
    # No trailing space: BPE words carry their leading space (" foo"), so "def " would end on a lone-space token
    sample_prompts: list[str] = field(default_factory=lambda: ["def", "import", "class"],
                                      metadata={"help": "prompts for greedy samples at eval time"})


@dataclass
class ModelArguments:
    depth: int = field(default=4, metadata={"help": "decoder layers; sizes the model (nanochat --depth)"})
    aspect_ratio: int = field(default=64, metadata={"help": "hidden_size = depth * aspect_ratio (rounded)"})
    head_dim: int = field(default=128, metadata={"help": "attention head width"})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "GQA key/value heads"})
    max_seq_len: int = field(default=512, metadata={"help": "packed row length (tokens)"})
    window_pattern: str = field(default="SSSL", metadata={"help": "S = sliding window, L = full; last layer L"})
    l3_after_layers: list[int] = field(default_factory=list, metadata={"help": "L3 after these layers (empty: "
                                                                                "dense)"})
    l3_n_emb: int | None = field(default=None, metadata={"help": "total L3 rows (default 4 x vocab)"})
    l3_k_max: int = field(default=64, metadata={"help": "most L3 rows per token"})
    l3_d_up: int | None = field(default=None, metadata={"help": "L3 up-projection width (default 4 x hidden)"})
    l3_tie_kv: bool = field(default=True, metadata={"help": "one table for L3 keys and values"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa, eager or flash_attention_2"})


def make_parser() -> TrlParser:
    return TrlParser((ScriptArguments, PretrainConfig, ModelArguments))


def prepare_tokenizer(script_args: ScriptArguments, training_args: PretrainConfig, train_docs):
    """Load the given tokenizer, or train a BPE on the training documents (main process first, then shared)."""
    if script_args.tokenizer_name_or_path:
        return load_tokenizer(script_args.tokenizer_name_or_path)
    saved = Path(training_args.output_dir)
    with training_args.main_process_first(desc="train tokenizer"):
        if training_args.process_index == 0:
            budget, texts = script_args.tokenizer_train_chars, []
            for document in train_docs["text"]:
                texts.append(document[:budget])
                budget -= len(texts[-1])
                if budget <= 0:
                    break
            train_tokenizer(texts, script_args.vocab_size).save_pretrained(saved)
        return load_tokenizer(str(saved))


def first_tokens(tokens, budget: int) -> list[list[int]]:
    """The first tokenized documents holding `budget` tokens: the LZW allocation sample."""
    sample = []
    for ids in tokens["input_ids"]:
        sample.append(ids)
        budget -= len(ids)
        if budget <= 0:
            break
    return sample


def main(script_args: ScriptArguments, training_args: PretrainConfig, model_args: ModelArguments) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    set_seed(training_args.seed)
    # The finished folder is uploaded once at the end (the Trainer's own push would contact the Hub at start,
    # re-save the weights without our metadata and replace the model card).
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False
    check_world_size(training_args)
    corpus, corpus_report = text.load_corpus(
        script_args.dataset, script_args.text_column, script_args.dataset_split, script_args.skip_invalid_files
    )
    if script_args.max_documents and len(corpus) > script_args.max_documents:
        corpus = corpus.shuffle(seed=training_args.seed).select(range(script_args.max_documents))
    train_docs, val_docs = text.split_documents(corpus, script_args.val_fraction, training_args.seed)
    logger.info("documents: %d train, %d validation (seed %d)", len(train_docs), len(val_docs), training_args.seed)
    tokenizer = prepare_tokenizer(script_args, training_args, train_docs)
    max_chars = script_args.document_max_chars or model_args.max_seq_len
    packed, reports = {}, {}
    for name, docs in (("train", train_docs), ("validation", val_docs)):
        tokens = text.tokenize_documents(text.chunk_documents(docs, max_chars), tokenizer)
        if name == "train":
            allocation_sample = first_tokens(tokens, script_args.l3_sample_tokens)
        packed[name], reports[name] = text.pack_best_fit(tokens, model_args.max_seq_len)
        logger.info("%s packing: %s (cropped %.2f%%)", name, reports[name], 100 * reports[name].cropped_share)
    if script_args.max_eval_rows:
        packed["validation"] = packed["validation"].select(range(min(len(packed["validation"]),
                                                                      script_args.max_eval_rows)))
    if not len(packed["train"]) or not len(packed["validation"]):
        raise ValueError(f"no full row of {model_args.max_seq_len} tokens: train {reports['train']}, "
                         f"validation {reports['validation']}; add data or lower --max_seq_len")

    config = L3GPTConfig.from_depth(
        model_args.depth, vocab_size=len(tokenizer), aspect_ratio=model_args.aspect_ratio,
        head_dim=model_args.head_dim, max_position_embeddings=model_args.max_seq_len,
        window_pattern=model_args.window_pattern, num_key_value_heads=model_args.num_key_value_heads,
        l3_after_layers=model_args.l3_after_layers, l3_n_emb=model_args.l3_n_emb, l3_k_max=model_args.l3_k_max,
        l3_d_up=model_args.l3_d_up, l3_tie_kv=model_args.l3_tie_kv, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        attn_implementation=model_args.attn_implementation,
    )
    model = L3GPTForCausalLM(config)
    if config.l3_after_layers:
        model.set_l3_allocation(lzw_allocation(allocation_sample, config.vocab_size, config.l3_n_emb, config.l3_k_max))
        counts = model.model.l3_counts().float()
        logger.info("L3 allocation: mean %.1f, max %d, tokens at k_max %d", counts.mean(), counts.max(),
                    int((counts == config.l3_k_max).sum()))
    ao_fp8 = fp8.check_ao_backend(training_args, model)  # accelerate's torchao backend (fp8_ao.yaml), or None
    if ao_fp8:
        logger.info("fp8 through accelerate's torchao backend: %s", ao_fp8)
    if training_args.fp8:
        fp8.convert_to_float8_training(model, recipe=training_args.fp8)  # logs the converted layers
    logger.info("model: %.2fM parameters (%.2fM in L3 tables)", model.num_parameters() / 1e6,
                sum(p.numel() for n, p in model.named_parameters() if "_table" in n) / 1e6)

    bpb = BitsPerByte(token_bytes(tokenizer))
    trainer = L3GPTTrainer(
        model=model, args=training_args, train_dataset=packed["train"], eval_dataset=packed["validation"],
        data_collator=PackedCollator(tokenizer.bos_token_id, training_args.attend_across_documents),
        processing_class=tokenizer, compute_metrics=bpb,
        preprocess_logits_for_metrics=BitsPerByte.preprocess_logits_for_metrics,
        callbacks=[ThroughputCallback(flops_per_token(config, model_args.max_seq_len)),
                   LossPlotCallback(("loss", "eval_bpb"))],
    )
    if is_deepspeed_zero3_enabled():  # SampleCallback generates on rank 0 alone; ZeRO-3 needs every rank's shards
        logger.info("ZeRO-3: no samples at evaluation (SampleCallback generates on the main process only)")
    else:
        trainer.add_callback(SampleCallback(tokenizer, script_args.sample_prompts))
    # The step-0 evaluation runs inside train(): evaluate() before train() would leave the model without DDP (no
    # gradient all-reduce: accelerate marks it prepared for evaluation) and breaks DeepSpeed ZeRO
    training_args.eval_on_start = not training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    metrics["initial_eval_bpb"] = next((e["eval_bpb"] for e in trainer.state.log_history
                                        if e["step"] == 0 and "eval_bpb" in e), None)
    metrics["train_loss"] = next((e["train_loss"] for e in reversed(trainer.state.log_history)
                                  if "train_loss" in e), None)
    trainer.save_metrics("all", metrics)
    trainer.save_model(training_args.output_dir)  # every rank: under ZeRO-3 the weights are gathered collectively
    if is_deepspeed_zero3_enabled():  # training is over: finish_folder's reload on the main process alone must not
        unset_hf_deepspeed_config()  # partition the model with zero.Init (a collective: it would hang or crash)
    if trainer.is_world_process_zero():
        metadata = provenance.build_metadata(
            data={"source": script_args.dataset, "corpus": asdict(corpus_report),
                  "train_tokens_sha256": text.sha256_of_token_rows(packed["train"]),
                  "split": {"seed": training_args.seed, "val_fraction": script_args.val_fraction,
                            "train_documents": len(train_docs), "validation_documents": len(val_docs)},
                  "packing": {name: asdict(r) | {"cropped_share": r.cropped_share} for name, r in reports.items()}},
            model=config.to_dict(), script_args=asdict(script_args), model_args=asdict(model_args),
            training_args=training_args.to_dict(), results=metrics,
        )
        finish_folder(training_args.output_dir, metadata, metrics, (script_args.sample_prompts or ["def"])[0])
    if push_to_hub and trainer.is_world_process_zero():
        provenance.push_folder_to_hub(training_args.output_dir, training_args.hub_model_id,
                                      private=training_args.hub_private_repo, token=training_args.hub_token)
    return metrics


def finish_folder(output_dir: str, metadata: dict, metrics: dict, prompt: str) -> None:
    """metadata.json (replacing the Trainer's pickled training_args.bin), the safetensors header and the model
    card, then a reload with `AutoModelForCausalLM` that
    continues `prompt` (greedy, 40 tokens; the folder that `push_to_hub` uploads is exactly this one)."""
    provenance.write_json_atomic(Path(output_dir) / "metadata.json", metadata)
    (Path(output_dir) / "training_args.bin").unlink(missing_ok=True)  # pickle; metadata.json has the arguments
    data = metadata["data"]
    provenance.add_safetensors_metadata(Path(output_dir) / "model.safetensors", {
        "hfl3_train_tokens_sha256": data["train_tokens_sha256"], "hfl3_version": hfl3.__version__,
        "hfl3_git_commit": str(metadata.get("git_commit")),
    })
    summary = (f"L3GPT pretrained with hfl3 on `{data['source']}`: validation bpb {metrics.get('eval_bpb'):.4f} "
               f"(from {metrics.get('initial_eval_bpb') or float('nan'):.4f} at step 0).\n\n"
               "Load with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` (or `import hfl3`).")
    provenance.write_model_card(output_dir, "L3GPT (hfl3)", metadata, summary, tags=("hfl3", "l3gpt"))
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = load_tokenizer(output_dir)
    ids = [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    print("reloaded from", output_dir, "->", repr(tokenizer.decode(output[0, 1:], skip_special_tokens=True)))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*parse_recipe_args(make_parser()))
