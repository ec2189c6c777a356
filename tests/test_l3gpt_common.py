"""transformers' common model and configuration tests (`ModelTesterMixin`, `ConfigTester`, from the installed
version's sdist: `transformers_suite.py`) run against L3GPT as against a model in transformers' tree, through a tester
in the style of its decoder-only testers: a dense model, and one with an L3 layer and a non-uniform allocation."""

import unittest
from unittest import mock

import pytest
import torch
from transformers import initialization as init
from transformers.models.auto import modeling_auto

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.models.l3gpt import L3GPTModel, bounds_from_counts, lzw_allocation
from hfl3.models.l3gpt.modeling_l3gpt import L3GPTPreTrainedModel, L3GPTSmear
from transformers_suite import GenerationTesterMixin, SdistUnavailable, common_tests

try:
    test_modeling_common, test_configuration_common = common_tests()
except SdistUnavailable as error:  # offline: shown in the summary (-ra), never a silent pass
    pytest.skip(f"transformers' common tests not run: {error}", allow_module_level=True)
ModelTesterMixin, ids_tensor = test_modeling_common.ModelTesterMixin, test_modeling_common.ids_tensor
ConfigTester = test_configuration_common.ConfigTester


class L3GPTModelTester:
    """Tiny L3GPT configs and inputs for the common tests (the fields of transformers' `CausalLMModelTester`)."""

    config_class = L3GPTConfig
    base_model_class = L3GPTModel
    causal_lm_class = L3GPTForCausalLM
    all_model_classes = (L3GPTModel, L3GPTForCausalLM)

    def __init__(self, parent, l3: bool = False, batch_size=13, seq_length=7, is_training=True, vocab_size=99,
                 hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1):
        self.parent = parent
        self.l3 = l3
        self.config_overrides = {}
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2

    def get_config(self) -> L3GPTConfig:
        # l3_k_max of 100 keeps the config valid when a common test sets vocab_size to 4 after building it
        l3_fields = dict(l3_after_layers=[0], l3_n_emb=4 * self.vocab_size, l3_k_max=100, l3_d_up=48) if self.l3 else {}
        return L3GPTConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=37, max_position_embeddings=64, window_pattern="SL", sliding_window=4,
            smear_gate_channels=8, value_embedding_gate_channels=4, pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, **{**l3_fields, **self.config_overrides},
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # as CausalLMModelTester: row i keeps i + 1 tokens
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


def skewed_bounds(self: L3GPTModel) -> torch.LongTensor:
    """Stands in for `L3GPTModel.uniform_bounds` (the allocation a model starts with): LZW over a fixed sample
    concentrated on a third of the vocabulary, so the tables are shared out unevenly."""
    config = self.config
    if not config.l3_after_layers:
        return torch.zeros(config.vocab_size + 1, dtype=torch.long)
    sample = torch.randint(0, max(1, config.vocab_size // 3), (600,), generator=torch.Generator().manual_seed(0),
                           device="cpu")  # also under a meta-device context (the buffer is then filled by init)
    counts = lzw_allocation([sample.tolist()], config.vocab_size, config.l3_n_emb, config.l3_k_max)
    return bounds_from_counts(counts)


ORIGINAL_INIT_WEIGHTS = L3GPTPreTrainedModel._init_weights


@torch.no_grad()
def init_weights_for_tests(self, module):
    """nanochat's init, then non-zero values where it puts zeros (o_proj, down_proj, the L3 mix projection, the smear
    scalar): with nanochat's zeros, attention, MLP, smear and L3 add nothing to a fresh model and most numerical
    comparisons would pass without testing them."""
    ORIGINAL_INIT_WEIGHTS(self, module)
    if getattr(module, "hfl3_init", (None,))[0] == "zeros":
        init.normal_(module.weight, std=0.1)
    elif isinstance(module, L3GPTSmear):
        init.constant_(module.smear_lambda, 0.7)


class L3GPTGenerationTests(GenerationTesterMixin):
    """Generation checks in the spirit of transformers' `GenerationTesterMixin` (not shipped in its sdist): greedy
    and beam search with and without cache, left padding, continuing from `past_key_values`, static cache. In
    float64, so that no greedy or beam choice is a near-tie that round-off could flip between two paths."""

    def generation_model(self) -> L3GPTForCausalLM:
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        return L3GPTForCausalLM(config).double().eval()

    def prompts(self, batch_size: int = 3, length: int = 5) -> torch.LongTensor:
        return ids_tensor([batch_size, length], self.model_tester.vocab_size - 3) + 3  # no pad/bos/eos

    def generate(self, model, input_ids, **kwargs):
        kwargs = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0, **kwargs}
        return model.generate(input_ids, return_dict_in_generate=True, output_logits=True, **kwargs)

    def assert_same_generation(self, first, second):
        self.assertTrue(torch.equal(first.sequences, second.sequences))
        # float64 logits of the same tokens computed with and without a cache: round-off of ~1e-16 relative,
        # grown by a few layers; 1e-10 leaves six orders of margin and still catches any wrong cached state
        torch.testing.assert_close(torch.stack(first.logits), torch.stack(second.logits), rtol=1e-10, atol=1e-10)

    def recomputed_greedy(self, model, input_ids, steps: int = 6) -> torch.LongTensor:
        with torch.no_grad():
            for _ in range(steps):
                next_ids = model(input_ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                input_ids = torch.cat([input_ids, next_ids], dim=1)
        return input_ids

    def test_greedy_generate_with_and_without_cache(self):
        model, prompts = self.generation_model(), self.prompts()
        cached, uncached = self.generate(model, prompts), self.generate(model, prompts, use_cache=False)
        self.assert_same_generation(cached, uncached)
        self.assertTrue(torch.equal(cached.sequences, self.recomputed_greedy(model, prompts)))

    def test_beam_search_with_and_without_cache(self):
        model, prompts = self.generation_model(), self.prompts()
        kwargs = {"num_beams": 3, "num_return_sequences": 2}
        cached, uncached = self.generate(model, prompts, **kwargs), self.generate(model, prompts, use_cache=False,
                                                                                  **kwargs)
        self.assertTrue(torch.equal(cached.sequences, uncached.sequences))

    def test_left_padding_gives_each_prompt_its_own_generation(self):
        model, prompts = self.generation_model(), self.prompts(batch_size=2, length=6)
        padded = prompts.clone()
        padded[1, :3] = 0
        mask = (padded != 0).long()
        together = self.generate(model, padded, attention_mask=mask)
        alone = [self.generate(model, prompts[:1]), self.generate(model, prompts[1:, 3:])]
        self.assertTrue(torch.equal(together.sequences[0], alone[0].sequences[0]))
        self.assertTrue(torch.equal(together.sequences[1, 3:], alone[1].sequences[0]))
        # see `assert_same_generation` for the tolerance
        for row, single in enumerate(alone):
            torch.testing.assert_close(torch.stack(together.logits)[:, row], torch.stack(single.logits)[:, 0],
                                       rtol=1e-10, atol=1e-10)

    def test_generate_continues_from_past_key_values(self):
        model, prompts = self.generation_model(), self.prompts()
        first = self.generate(model, prompts, max_new_tokens=3)
        follow_up = torch.cat([first.sequences, self.prompts(length=2)], dim=1)  # the user's next turn
        continued = self.generate(model, follow_up, past_key_values=first.past_key_values)
        self.assert_same_generation(continued, self.generate(model, follow_up))

    def test_static_cache_gives_the_dynamic_caches_generation(self):
        model, prompts = self.generation_model(), self.prompts()
        self.assert_same_generation(self.generate(model, prompts, cache_implementation="static"),
                                    self.generate(model, prompts))
        padded = prompts.clone()
        padded[0, :2] = 0
        mask = (padded != 0).long()
        self.assert_same_generation(self.generate(model, padded, attention_mask=mask, cache_implementation="static"),
                                    self.generate(model, padded, attention_mask=mask))


class L3GPTCommonTests(ModelTesterMixin, L3GPTGenerationTests):
    """The common tests with L3GPT's tester; each override or skip says which design decision it follows. The
    skips left to transformers are for hardware (accelerator, several GPUs, flash-attn, kernels, MPS) or for
    architectures L3GPT is not (composite, mixture of experts, encoder-decoder, vision)."""

    all_model_classes = L3GPTModelTester.all_model_classes
    test_can_init_all_missing_weights_before_2023 = True  # L3GPT's `_init_weights` is meant to cover every weight
    l3 = False

    @classmethod
    def setUpClass(cls):
        # As for a model in transformers' tree: its auto-mapping names (hfl3 registers L3GPT with the Auto classes,
        # which the tests' name lookups do not see) and the tester's non-zero init.
        cls.patches = [
            mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {"l3gpt": "L3GPTModel"}),
            mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {"l3gpt": "L3GPTForCausalLM"}),
            mock.patch.object(L3GPTPreTrainedModel, "_init_weights", init_weights_for_tests),
            mock.patch.object(L3GPTModel, "uniform_bounds", skewed_bounds),
        ]
        for patch in cls.patches:
            patch.start()
        # Tiny models: a second OpenMP thread only adds barrier waits (this file took 143 s instead of 35 s with two
        # threads on the shared 2-core box)
        cls.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    @classmethod
    def tearDownClass(cls):
        torch.set_num_threads(cls.threads)
        for patch in reversed(cls.patches):
            patch.stop()

    def setUp(self):
        self.model_tester = L3GPTModelTester(self, l3=self.l3)
        self.config_tester = ConfigTester(self, config_class=L3GPTConfig, hidden_size=32, num_attention_heads=2)

    def test_config(self):
        self.config_tester.run_common_tests()

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # As for a causal LM in transformers' tree (whose class is in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES at import
        # time): labels of the inputs' shape
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is L3GPTForCausalLM:
            inputs["labels"] = torch.zeros_like(inputs["input_ids"])
        return inputs

    def test_inputs_embeds(self):
        """Overridden: value embeddings and L3 layers read rows by token id, so `inputs_embeds` alone is refused
        (checked here); the common test then runs on the same model without them."""
        self.assert_inputs_embeds_alone_is_refused()
        self.model_tester.config_overrides = {"value_embedding_layers": [], "l3_after_layers": []}
        super().test_inputs_embeds()

    def test_inputs_embeds_matches_input_ids(self):
        """Overridden as `test_inputs_embeds`."""
        self.model_tester.config_overrides = {"value_embedding_layers": [], "l3_after_layers": []}
        super().test_inputs_embeds_matches_input_ids()

    def assert_inputs_embeds_alone_is_refused(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = L3GPTModel(config)
        with self.assertRaisesRegex(ValueError, "read rows by token id: pass input_ids"):
            model(inputs_embeds=model.embed_tokens(inputs["input_ids"]))

    def test_sliding_window_mask(self):
        """Overridden: L3GPT sets its windows with `window_pattern` (nanochat's S/L letter per layer), not with
        Qwen2's `use_sliding_window` switch that the common test toggles. Same check: eager attention weights are
        zero beyond the window on S layers only."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        seq_len, window = self.model_tester.seq_length, 3
        positions = torch.arange(seq_len)
        beyond_window = positions[None, :] <= positions[:, None] - window  # (query, key): earlier than the window
        for pattern in ("SL", "L"):
            config.window_pattern, config.sliding_window = pattern, window
            config = L3GPTConfig(**config.to_diff_dict())
            model = L3GPTModel._from_config(config, attn_implementation="eager").eval()
            attentions = model(inputs["input_ids"], output_attentions=True).attentions
            for weights, layer_type in zip(attentions, config.layer_types):
                self.assertEqual(bool((weights[:, :, beyond_window] == 0).all()), layer_type == "sliding_attention")

    @unittest.skip("no tensor-parallel plan: L3GPT distributes with DDP, DeepSpeed ZeRO or FSDP2 (accelerate)")
    def test_tp_plan_matches_params(self):
        pass

    @unittest.skip("no tensor-parallel plan: L3GPT distributes with DDP, DeepSpeed ZeRO or FSDP2 (accelerate)")
    def test_tied_head_has_a_tp_plan_entry(self):
        pass

    @unittest.skip("no checkpoint key mapping: L3GPT checkpoints are written with its own state-dict keys")
    def test_reverse_loading_mapping(self):
        pass

    @unittest.skip("no checkpoint key mapping: L3GPT checkpoints are written with its own state-dict keys")
    def test_can_load_from_already_mapped_keys(self):
        pass

    @unittest.skip("no module kept in float32: the softcap and the loss upcast in the forward; norms have no weight")
    def test_keep_in_fp32_modules(self):
        pass

    @unittest.skip("no module kept in float32: the softcap and the loss upcast in the forward; norms have no weight")
    def test_keep_in_fp32_modules_exist(self):
        pass

    @unittest.skip("not a composite model: its SDPA/eager dispatch is test_sdpa_can_dispatch_non_composite_models")
    def test_sdpa_can_dispatch_composite_models(self):
        pass

    @unittest.skip("partial rotation is refused by L3GPTConfig: nanochat rotates whole heads")
    def test_model_rope_with_partial_rotation(self):
        pass

    def test_tester_weights_are_non_zero(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        model = L3GPTForCausalLM(config)
        zero = [name for name, param in model.named_parameters() if not param.any()]
        self.assertEqual(zero, [])
        counts = model.model.l3_counts()
        self.assertEqual(len(set(counts.tolist())) > 1, self.l3)


class L3GPTModelTest(L3GPTCommonTests, unittest.TestCase):
    pass


class L3GPTWithL3ModelTest(L3GPTCommonTests, unittest.TestCase):
    l3 = True
