"""A pretraining run, built in one place for the recipe, the benchmarks and the GPU suite: the L3GPT (`build_model`),
its trainer (`build_trainer`), the whole run the recipe trains (`build_pretraining`: data, tokenizer, plan, model,
trainer) and its output folder (`finish_pretraining`). A benchmark arm calls `build_model` and `build_trainer` with a
`PretrainConfig` and changes only what it measures (the config's shape and L3 layers, `fp8`, `torch_compile`, its
data and its own clock callbacks), so what it times is the path `recipes/pretrain.py` runs."""

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

import datasets
import numpy as np
import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

from hfl3 import L3GPTConfig, L3GPTForCausalLM, fp8, provenance
from hfl3.callbacks import SampleCallback
from hfl3.data.streaming import PackedStream
from hfl3.distributed import from_main
from hfl3.evaluate import CoreMetricCallback, core_bundle_for_training
from hfl3.models.l3gpt import lzw_allocation
from hfl3.tokenization import load_tokenizer, token_bytes
from hfl3.trainers.cli.arguments import RunSetup, apply_evaluation
from hfl3.trainers.pretraining.compute_optimal import (REFERENCE_DEPTH, ComputeOptimalPlan, apply_plan, compute_optimal_plan,
                                          parameter_counts)
from hfl3.trainers.metrics import ThroughputConfig
from hfl3.trainers.optimizers import OptimizerSetup
from hfl3.trainers.outputs import OutputConfig, OutputFolder, RunOutputs
from hfl3.trainers.pretraining.trainer import (
    BitsPerByte,
    DataLoaderConfig,
    PackedCollator,
    PretrainTrainer,
    StreamedTrainingData,
)
from hfl3.trainers.pretraining.config import L3GPTModelArguments, PretrainConfig, PretrainScriptArguments
from hfl3.trainers.pretraining.data import (
    PretrainData,
    data_metadata,
    open_data,
    prepare_data,
    prepare_tokenizer,
)

logger = logging.getLogger(__name__)


def plan_run(model_args: L3GPTModelArguments, training_args: PretrainConfig, vocab_size: int,
             show: bool = True) -> ComputeOptimalPlan:
    """nanochat's compute-optimal plan for this model at `vocab_size` (reference: the same model arguments at depth
    12 without L3 layers, nanochat's `build_model_meta(12)`), computed by global rank 0 for every rank, its table
    logged by the main process when `show`. Raises `PlanError` for a batch or budget that cannot be planned."""
    max_length = training_args.max_length
    reference = replace(model_args, depth=REFERENCE_DEPTH, l3_after_layers=None).config(vocab_size, max_length)
    plan = from_main(lambda: compute_optimal_plan(model_args.config(vocab_size, max_length), reference, training_args))
    if show and training_args.process_index == 0:
        logger.info("%s", plan.table())
    return plan


def plan_only(script_args: PretrainScriptArguments, training_args: PretrainConfig,
              model_args: L3GPTModelArguments) -> ComputeOptimalPlan:
    """`--dry_run`: the plan alone, logged, with no data read: the vocabulary is `--tokenizer_name_or_path`'s, else the
    BPE's `--vocab_size`."""
    vocab_size = len(load_tokenizer(script_args.tokenizer_name_or_path)) if script_args.tokenizer_name_or_path \
        else script_args.vocab_size
    return plan_run(model_args, training_args, vocab_size)


def build_model(config: L3GPTConfig, training_args: PretrainConfig,
                allocation_sample: Callable[[], Iterable[Sequence[int]]] | None = None,
                device: str | torch.device | None = None, allocation: torch.LongTensor | None = None
                ) -> L3GPTForCausalLM:
    """A fresh L3GPT of `config` (the recipe's: `L3GPTModelArguments.config`; a benchmark's: its arm's shape), its L3
    allocation computed from `allocation_sample()` (token sequences; by global rank 0 for every rank), or the given
    `allocation` (`lzw_allocation`'s rows per token, `(vocab_size,)`; a benchmark computes it once for its arms);
    neither: the uniform one, or the one a resumed checkpoint brings. Converted to FP8 when `training_args.fp8` asks,
    or checked for accelerate's torchao backend; its training loss set by `--loss_implementation`; its token and
    value-embedding tables stored in `training_args.resolved_embedding_dtype()`. Initialised on `device` (default:
    the CPU; the Trainer moves it).

    Raises:
        ValueError: an FP8 setup `hfl3.fp8` refuses.
    """
    with torch.device(device or "cpu"):
        model = L3GPTForCausalLM(config)
    if config.l3_after_layers and (allocation is not None or allocation_sample is not None):
        model.set_l3_allocation(allocation if allocation is not None else from_main(lambda: lzw_allocation(
            allocation_sample(), config.vocab_size, config.l3_n_emb, config.l3_k_max)))
        counts = model.model.l3_counts().float()
        logger.info("L3 allocation: mean %.1f, max %d, tokens at k_max %d", counts.mean(), counts.max(),
                    int((counts == config.l3_k_max).sum()))
    ao_fp8 = fp8.check_ao_backend(training_args, model)  # accelerate's torchao backend (fp8_ao.yaml), or None
    if ao_fp8:
        logger.info("fp8 through accelerate's torchao backend: %s", ao_fp8)
    if training_args.fp8:
        fp8.convert_to_float8_training(model, recipe=training_args.fp8)  # logs the converted layers
    model.set_loss_implementation(training_args.loss_implementation)
    embedding_dtype = training_args.resolved_embedding_dtype()
    if embedding_dtype != torch.float32:
        model.model.embed_tokens.to(embedding_dtype)
        model.model.value_embeddings.to(embedding_dtype)
        logger.info("token and value embeddings stored in %s (--embedding_dtype %s)",
                    str(embedding_dtype).removeprefix("torch."), training_args.embedding_dtype)
    counts = parameter_counts(model)
    logger.info("model: %.2fM parameters, %.2fM scaling (matrices and lm_head), %.2fM in L3 tables",
                counts["total"] / 1e6, counts["scaling"] / 1e6, counts["l3_table"] / 1e6)
    return model


def build_trainer(model: L3GPTForCausalLM, training_args: PretrainConfig, train_dataset,
                  flops_per_token: float | None, *,
                  tokenizer=None, bos_token_id: int | None = None, eval_rows: np.ndarray | None = None,
                  output: OutputFolder | None = None, sample_prompts: Sequence[str] = (), core_bundle=None,
                  callbacks: Sequence[TrainerCallback] = (),
                  optimizer_setup: OptimizerSetup | None = None) -> PretrainTrainer:
    """The recipe's `PretrainTrainer` around `model`: `PackedCollator` (BOS of `tokenizer`, else `bos_token_id`) and,
    over a stream, the streamed data the trainer holds (`StreamedTrainingData` with `DataLoaderConfig.from_args`),
    bits-per-byte evaluation on `eval_rows` (`(rows, max_length)` token ids; needs `tokenizer`), the throughput at
    `flops_per_token` (`ThroughputConfig`: training FLOPs per token; None: no MFU), greedy samples of `sample_prompts`
    at evaluation (not under ZeRO-3), the CORE metric every `--core_metric_every` steps with `core_bundle`, and
    `callbacks` (a benchmark's clock). `train_dataset`: the recipe's `PackedStream`, or packed rows (`datasets.Dataset`
    of `input_ids`). `output`: the output folder the recipe's arguments resolved (`RunSetup.output`), which the
    trainer's `outputs` (`RunOutputs`, with the output and Hub arguments of `training_args`) writes;
    `optimizer_setup`: the run's optimizer, built from `training_args` (None: built by the trainer from them)."""
    bos = tokenizer.bos_token_id if tokenizer is not None else bos_token_id
    evaluating = eval_rows is not None and len(eval_rows) > 0
    collator = PackedCollator(bos, training_args.attend_across_documents)
    streamed_data = StreamedTrainingData(train_dataset, collator, DataLoaderConfig.from_args(training_args)) \
        if isinstance(train_dataset, PackedStream) else None  # rows: the Trainer's own DataLoader
    trainer = PretrainTrainer(
        model=model, args=training_args, train_dataset=train_dataset, data_collator=collator,
        streamed_data=streamed_data,
        eval_dataset=datasets.Dataset.from_dict({"input_ids": eval_rows}) if evaluating else None,
        processing_class=tokenizer, compute_metrics=BitsPerByte(token_bytes(tokenizer)) if evaluating else None,
        preprocess_logits_for_metrics=BitsPerByte.preprocess_logits_for_metrics if evaluating else None,
        callbacks=list(callbacks), throughput=ThroughputConfig(flops_per_token),
        outputs=RunOutputs(OutputConfig.from_args(training_args), output), optimizer_setup=optimizer_setup,
    )
    if sample_prompts and tokenizer is not None and evaluating:
        if is_deepspeed_zero3_enabled():  # SampleCallback generates on rank 0 alone; ZeRO-3 needs every rank's shards
            logger.info("ZeRO-3: no samples at evaluation (SampleCallback generates on the main process only)")
        else:
            trainer.add_callback(SampleCallback(tokenizer, sample_prompts))
    if core_bundle is not None:
        trainer.add_callback(CoreMetricCallback(trainer, core_bundle, training_args.core_metric_every))
    return trainer


@dataclass
class PretrainRun:
    """What `build_pretraining` built: the trainer, the data and the plan, with the arguments they came from."""

    trainer: PretrainTrainer
    data: PretrainData
    plan: ComputeOptimalPlan
    script_args: PretrainScriptArguments
    model_args: L3GPTModelArguments


def build_pretraining(script_args: PretrainScriptArguments, training_args: PretrainConfig,
                      model_args: L3GPTModelArguments, setup: RunSetup) -> PretrainRun:
    """The recipe's run, each piece of work once: the CORE bundle (read or downloaded before the data), the corpus
    and its validation side, the tokenizer, the compute-optimal plan (sized before any row is packed, and applied to
    `training_args`), the evaluation `setup` decided, the training stream and validation rows, the model and its
    trainer. `setup` is what the arguments' checks resolved (`hfl3.trainers.cli.arguments.check_pretrain_inputs`).

    Raises:
        PlanError: a batch or budget the dial cannot plan (before the BPE is trained when it would be).
        InputError: bad data (`hfl3.data.sources`, no validation row).
    """
    output = setup.output
    optimizer_setup = OptimizerSetup(training_args)  # Muon's refusals, before any data work
    core_bundle = core_bundle_for_training(training_args)  # --core_metric_every: read (or downloaded) before the data
    documents = open_data(script_args, training_args.seed)
    if not (script_args.tokenizer_name_or_path or output.resume_checkpoint):
        plan_run(model_args, training_args, script_args.vocab_size, show=False)  # its errors before the BPE is trained
    tokenizer = prepare_tokenizer(script_args, output, documents[0])
    plan = plan_run(model_args, training_args, len(tokenizer))
    apply_plan(training_args, plan)
    apply_evaluation(training_args, setup.evaluation)
    data = prepare_data(script_args, documents, tokenizer, training_args.max_length,
                        evaluate=setup.evaluation.enabled)
    config = model_args.config(len(tokenizer), training_args.max_length, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    resumed = output.resume_checkpoint is not None  # the checkpoint brings its L3 allocation
    model = build_model(config, training_args,
                        None if resumed else lambda: data.train.sample_documents(script_args.l3_sample_tokens))
    trainer = build_trainer(model, training_args, data.train, plan.flops_per_token, tokenizer=tokenizer,
                            eval_rows=data.eval_rows, output=output, sample_prompts=script_args.sample_prompts,
                            core_bundle=core_bundle, optimizer_setup=optimizer_setup)
    return PretrainRun(trainer, data, plan, script_args, model_args)


def finish_pretraining(run: PretrainRun, results: dict) -> None:
    """The output folder of a trained run: `metadata.json` (data, model, arguments, plan, results, CORE), committed
    whole with the weights, tokenizer, card, `all_results.json`, `loss.png` and (`--save_optimizer`) the optimizer
    state `optimizer/optimizer.safetensors`; then reloaded on the main process
    (`reload_and_generate`) and pushed with `--push_to_hub`. Call on every rank."""
    trainer, core = run.trainer, run.trainer.core_metric
    trainer.provenance = provenance.build_metadata(
        data=data_metadata(run.script_args, run.data, trainer.streamed_data.summary()),  # every rank: what each read
        model=trainer.model.config.to_dict(), script_args=asdict(run.script_args), model_args=asdict(run.model_args),
        training_args=trainer.args.to_dict(), compute_optimal=run.plan.as_dict(), results=results,
        optimizer=trainer.optimizer_setup.metadata(trainer.accelerator.unwrap_model(trainer.model)),
        evaluation={"core": core.latest.summary()} if core and core.latest else {},
    )
    with trainer.finish_output():  # staged, committed whole: weights, tokenizer, metadata.json, card, results, plot
        trainer.save_metrics("all", results)
        trainer.save_loss_plot(("loss", "eval_bpb"))
        trainer.save_model()  # every rank: under ZeRO-3 the weights are gathered collectively
        if trainer.args.save_optimizer:  # for a chat SFT's warm start (--load_optimizer), as nanochat keeps it
            trainer.save_optimizer_state()
    reload_and_generate(trainer, (run.script_args.sample_prompts or ["def"])[0])
    trainer.push_output()


def reload_and_generate(trainer: PretrainTrainer, prompt: str) -> None:
    """On the main process, reload the finished folder with `AutoModelForCausalLM` and continue `prompt` (greedy, 40
    tokens): the folder that `--push_to_hub` uploads is exactly this one."""
    if is_deepspeed_zero3_enabled():  # training is over: the reload on the main process alone must not
        unset_hf_deepspeed_config()  # partition the model with zero.Init (a collective: it would hang or crash)
    if not trainer.is_world_process_zero():
        return
    output_dir = trainer.args.output_dir
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = load_tokenizer(output_dir)
    ids = [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    logger.info("reloaded from %s -> %r", output_dir, tokenizer.decode(output[0, 1:], skip_special_tokens=True))
