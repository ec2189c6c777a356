"""Trainer callbacks of the recipes: greedy samples at evaluation (`SampleCallback`). The numbers of each step (the
throughput, MFU, peak memory, the loss tally) and the loss plot are `hfl3.trainers.metrics`', held by the trainer."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import TrainerCallback


class SampleCallback(TrainerCallback):
    """Prints greedy continuations of fixed prompts after every evaluation (main process), so a run shows what
    the model has learned; the samples are also kept in `self.samples` (step → list of texts)."""

    def __init__(self, tokenizer, prompts: Sequence[str], max_new_tokens: int = 32):
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.samples: dict[int, list[str]] = {}

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        import torch

        if not state.is_world_process_zero or model is None or not self.prompts:
            return
        from hfl3.fp8 import float8_disabled

        was_training = model.training
        model.eval()
        texts = []
        with torch.no_grad(), float8_disabled(model):
            for prompt in self.prompts:
                ids = [self.tokenizer.bos_token_id, *self.tokenizer(prompt, add_special_tokens=False)["input_ids"]]
                input_ids = torch.tensor([ids], device=model.device)
                output = model.generate(
                    input_ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                )
                texts.append(prompt + self.tokenizer.decode(output[0, len(ids):], skip_special_tokens=True))
        model.train(was_training)
        self.samples[state.global_step] = texts
        print(f"--- samples at step {state.global_step} ---")
        for text in texts:
            print(repr(text))
