"""The Trainer path around a pretraining step: no device→host synchronisation between logs (each one stalls the host behind the GPU; docs/design.md, decision 12), and
the token count and throughput it reports stay exact."""

import datasets
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.metrics import ThroughputConfig
from hfl3.trainers.pretraining.trainer import PretrainTrainer, PackedCollator
from hfl3.trainers.pretraining.config import PretrainConfig

SEQ_LEN, BATCH = 64, 4
# Tensor → Python conversions and copies to the host: each one waits for the device to finish all queued work.
SYNCING_CALLS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "cpu"}


@pytest.fixture(scope="module")
def rows(assets):
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]
    tokenizer = train_tokenizer([text], 512)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = SEQ_LEN - 1
    rows = [[tokenizer.bos_token_id, *ids[i : i + body]] for i in range(0, len(ids) - body, body)]
    return tokenizer, datasets.Dataset.from_dict({"input_ids": rows[: 16 * BATCH]})


class SyncRecorder(TorchFunctionMode):
    """Records the tensor→Python conversions made from the start of each step to the end of its `on_step_end`
    callbacks, except where the Trainer logs, evaluates, saves or stops (it reads the loss there on purpose, and hfl3
    its flags and token count: `BeforeLogSaveEvaluate`) and on optimizer step counters (0-D host tensors that torch's
    AdamW keeps on the CPU whatever the parameters' device)."""

    def __init__(self):
        super().__init__()
        self.active = False
        self.calls: list[tuple[int, str, object]] = []
        self.step = 0
        self.host_counters: list[torch.Tensor] = []

    def device_syncs(self, step: int) -> list[str]:
        return [name for s, name, tensor in self.calls
                if s == step and not any(tensor is counter for counter in self.host_counters)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.active and name in SYNCING_CALLS and args:
            self.calls.append((self.step, name, args[0]))
        return func(*args, **(kwargs or {}))


class OpRecorder(TorchDispatchMode):
    """The aten ops run inside the block, by name."""

    def __enter__(self):
        self.names = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class StepMarks(TrainerCallback):
    def __init__(self, recorder: SyncRecorder, trainer_ref: list):
        self.recorder, self.trainer_ref = recorder, trainer_ref

    def on_step_begin(self, args, state, control, **kwargs):
        self.recorder.step = state.global_step + 1
        self.recorder.active = True

    def on_step_end(self, args, state, control, **kwargs):
        # placed before hfl3's own callbacks, which read device values only where the Trainer syncs anyway
        if control.should_log or control.should_evaluate or control.should_save or control.should_training_stop:
            self.recorder.active = False

    def on_train_end(self, args, state, control, **kwargs):
        optimizer = self.trainer_ref[0].optimizer
        self.recorder.host_counters = [value for param_state in optimizer.state.values()
                                       for key, value in param_state.items() if key == "step" and torch.is_tensor(value)]


class StepEnd(TrainerCallback):
    """Added last: the recording stops after every callback of a step's end has run."""

    def __init__(self, recorder: SyncRecorder):
        self.recorder = recorder

    def on_step_end(self, args, state, control, **kwargs):
        self.recorder.active = False


class LogReporter(TrainerCallback):
    """Keeps a copy of every log it is handed, as a reporting integration (W&B, TensorBoard) sends it on."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def train(rows, tmp_path, l3_after_layers, optimizer, max_steps=7, logging_steps=3, attend_across_documents=True,
          reporters=(), throughput=ThroughputConfig(warmup_steps=1)):
    tokenizer, dataset = rows
    config = L3GPTConfig.from_depth(2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=SEQ_LEN, l3_after_layers=l3_after_layers,
                                    bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = L3GPTForCausalLM(config)
    args = PretrainConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=BATCH,
                          logging_steps=logging_steps, eval_strategy="no", report_to="none", optim=optimizer,
                          warmup_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                          attend_across_documents=attend_across_documents)
    recorder, trainer_ref = SyncRecorder(), []
    trainer = PretrainTrainer(model=model, args=args, train_dataset=dataset,
                           data_collator=PackedCollator(tokenizer.bos_token_id, attend_across_documents),
                           callbacks=[*reporters, StepMarks(recorder, trainer_ref)], throughput=throughput)
    trainer_ref.append(trainer)
    trainer.add_callback(StepEnd(recorder))
    with recorder:
        trainer.train()
    return trainer, recorder


@pytest.mark.parametrize(
    "l3_after_layers, optimizer, attend_across_documents, syncs_per_step",
    [([], "adamw_torch", True, 0), ([], "muon", True, 0),
     # the L3 routing's pair count is copied to the host without waiting (`pair_count_on_host`)
     ([0], "muon", True, 0),
     # block-causal rows: transformers' mask helpers check once per mask type (full, sliding) whether position_ids
     # mark packed documents (`find_packed_sequence_indices`; skipped under torch.compile)
     ([], "adamw_torch", False, 2)],
    ids=["dense-adamw", "dense-muon", "l3-muon", "packed-documents"],
)
def test_no_device_sync_between_logs(rows, tmp_path, l3_after_layers, optimizer, attend_across_documents,
                                     syncs_per_step):
    trainer, recorder = train(rows, tmp_path, l3_after_layers, optimizer,
                              attend_across_documents=attend_across_documents)
    assert trainer.state.global_step == 7
    per_step = {step: recorder.device_syncs(step) for step in range(1, 8)}
    assert all(len(calls) == syncs_per_step for calls in per_step.values()), per_step


def test_token_count_and_throughput_are_exact_without_per_step_sync(rows, tmp_path):
    reporter = LogReporter()
    throughput = ThroughputConfig(flops_per_token=1e6, warmup_steps=1, peak_flops=1e12)
    trainer, _ = train(rows, tmp_path, [], "adamw_torch", max_steps=7, logging_steps=3, reporters=[reporter],
                       throughput=throughput)
    assert trainer.state.num_input_tokens_seen == 7 * BATCH * SEQ_LEN
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["num_input_tokens_seen"] for entry in logged] == [3 * BATCH * SEQ_LEN, 6 * BATCH * SEQ_LEN]
    # the first log (step 3) opens the window; the second reports the tokens of steps 4–6 over its seconds
    assert "tok_per_sec" not in logged[0] and logged[1]["tok_per_sec"] > 0
    # MFU of the FLOPs per token over the peak FLOP/s (one process), rounded as logged
    assert logged[1]["mfu"] == round(100 * logged[1]["tok_per_sec"] * 1e6 / 1e12, 2)
    # one throughput per log, in what every callback reports (`TrainerHooks.log` adds it before any callback runs:
    # no callback order matters); transformers' session average is left out, its elapsed time kept
    reported = [entry for entry in reporter.logs if "loss" in entry]
    assert reported[1]["tok_per_sec"] == logged[1]["tok_per_sec"] and reported[1]["mfu"] == logged[1]["mfu"]
    assert all(e["train_runtime"] > 0 for e in reported)
    assert not any("train_tokens_per_second" in entry for entry in trainer.state.log_history + reporter.logs)
    # the peak memory, a record of its own after the end-of-training log
    assert trainer.state.log_history[-2]["train_loss"] > 0
    assert trainer.state.log_history[-1].keys() == {"step", "peak_memory_gb"}
    assert trainer.state.log_history[-1]["step"] == 7 and trainer.state.log_history[-1]["peak_memory_gb"] > 0


def test_throughput_window_skips_warmup_and_leaves_out_evaluation_and_saves(monkeypatch):
    """A log's window starts at the previous training log; windows that start before `warmup_steps` report nothing;
    `exclude_time` (a callback's evaluation) and `restart_window` (the Trainer's evaluation or save) leave their
    seconds out; logs without `loss` are left alone; `start` (a new `train()`) opens a new window."""
    from types import SimpleNamespace

    from hfl3.trainers import metrics

    clock = iter([0.0, 10.0, 20.0, 32.0, 50.0, 60.0, 70.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    throughput = metrics.Throughput(ThroughputConfig(flops_per_token=2.0, warmup_steps=2, peak_flops=100.0))
    state = SimpleNamespace(num_input_tokens_seen=0, global_step=0)

    def log(step, tokens, **extra):
        state.global_step, state.num_input_tokens_seen = step, tokens
        logs = {"loss": 1.0, **extra}
        throughput.add_to(logs, state, world_size=2)
        return {key: value for key, value in logs.items() if key in ("tok_per_sec", "mfu")}

    assert log(1, 100) == {}  # t=0: opens the window
    assert log(2, 200) == {}  # t=10: the window began at step 1 < warmup_steps
    throughput.exclude_time(4.0)  # 4 of the next seconds were a CORE evaluation
    assert log(3, 300) == {"tok_per_sec": 16.7, "mfu": 16.7}  # t=20: 100 tokens over 6 s; 16.7 × 2 / (100 × 2)
    throughput.restart_window()  # t=32: an evaluation or a save ended
    assert log(4, 480) == {"tok_per_sec": 10.0, "mfu": 10.0}  # t=50: 180 tokens over 18 s
    assert throughput.add_to(logs := {"eval_loss": 1.0}, state, 1) is None and logs == {"eval_loss": 1.0}
    throughput.start()
    assert log(5, 600) == {}  # t=60: a new train() opens a new window
    for bad in ({"warmup_steps": -1}, {"flops_per_token": 0.0}, {"peak_flops": float("nan")}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            ThroughputConfig(**bad)


def test_the_recorder_sees_the_syncs_transformers_would_make(rows, tmp_path):
    """Guard: with transformers' own NaN/inf filter and token counting back on, the recorder reports them, so a zero
    count above means absent, not unseen."""
    tokenizer, dataset = rows
    config = L3GPTConfig.from_depth(1, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=SEQ_LEN, bos_token_id=tokenizer.bos_token_id)
    args = PretrainConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=BATCH,
                          logging_steps=10, eval_strategy="no", report_to="none", logging_nan_inf_filter=True,
                          disable_tqdm=True)
    recorder, trainer_ref = SyncRecorder(), []
    trainer = PretrainTrainer(model=L3GPTForCausalLM(config), args=args, train_dataset=dataset,
                           data_collator=PackedCollator(tokenizer.bos_token_id),
                           callbacks=[StepMarks(recorder, trainer_ref)])
    trainer_ref.append(trainer)
    trainer._track_num_input_tokens = lambda inputs: super(PretrainTrainer, trainer)._track_num_input_tokens(inputs)
    with recorder:
        trainer.train()
    names = recorder.device_syncs(1)
    assert names.count("__bool__") >= 1 and names.count("item") >= 1, names


def test_auto_find_batch_size_is_refused_while_parsing(tmp_path):
    # the stream's state and the planned total batch would no longer match what is trained after a halving
    with pytest.raises(ValueError, match="auto_find_batch_size=True is not supported.*per_device_train_batch_size"):
        PretrainConfig(output_dir=str(tmp_path), auto_find_batch_size=True, report_to="none")


def test_fp8_without_compile_warns_at_start(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="hfl3.trainers.pretraining.config"):
        PretrainConfig(output_dir=str(tmp_path), fp8="tensorwise", report_to="none")
    assert "without torch_compile" in caplog.text and "--torch_compile true" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hfl3.trainers.pretraining.config"):
        PretrainConfig(output_dir=str(tmp_path), fp8="tensorwise", torch_compile=True, report_to="none")
    assert "without torch_compile" not in caplog.text


def test_nanochats_step_defaults_clip_nothing_with_muon_and_store_bf16_tables(tmp_path):
    """With `--optim muon` nothing is clipped (nanochat's base_train), otherwise transformers' 1.0; a value given
    is kept. `--embedding_dtype auto` stores the token and value-embedding tables in bf16 when training in bf16
    (nanochat's `init_weights`), float32 otherwise; `build_model` casts them and leaves the matrices float32."""
    from hfl3.trainers.pretraining.builder import build_model

    common = dict(output_dir=str(tmp_path), report_to="none")
    assert PretrainConfig(**common, optim="muon").max_grad_norm == 0.0
    assert PretrainConfig(**common).max_grad_norm == 1.0
    assert PretrainConfig(**common, optim="muon", max_grad_norm=0.5).max_grad_norm == 0.5
    for bad in ({"loss_implementation": "fused"}, {"embedding_dtype": "float16"}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}='"):
            PretrainConfig(**common, **bad)
    config = L3GPTConfig.from_depth(2, vocab_size=256, aspect_ratio=32, head_dim=32, max_position_embeddings=SEQ_LEN)
    for args, tables in ((PretrainConfig(**common, bf16=True, use_cpu=True), torch.bfloat16),
                         (PretrainConfig(**common, bf16=True, use_cpu=True, embedding_dtype="float32"), torch.float32),
                         (PretrainConfig(**common), torch.float32)):
        model = build_model(config, args)
        assert args.resolved_embedding_dtype() == tables
        assert model.model.embed_tokens.weight.dtype == tables
        assert {table.weight.dtype for table in model.model.value_embeddings.values()} == {tables}
        assert model.lm_head.weight.dtype == model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


def test_unclipped_gradient_norm_and_flops_equal_transformers_without_their_host_work(rows, tmp_path):
    """Without clipping the gradient norm is measured alone (transformers' `clip_grad_norm_(inf)` also rewrote every
    gradient), and `floating_point_ops` counts the parameters once; both equal what transformers computes."""
    trainer, _ = train(rows, tmp_path, [], "muon", max_steps=1)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    expected_flops = 6 * batch["input_ids"].numel() * trainer.model.num_parameters(exclude_embeddings=True)
    assert trainer.floating_point_ops(batch) == expected_flops
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, batch).backward()
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    with OpRecorder() as ops:
        norm = trainer._get_grad_norm(trainer.model)
    assert "aten._foreach_mul_" not in ops.names, ops.names  # transformers: every gradient multiplied by 1
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    for param, grad in zip([p for p in trainer.model.parameters() if p.grad is not None], grads):
        assert torch.equal(param.grad, grad)
