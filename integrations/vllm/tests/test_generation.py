"""vLLM's greedy generations of L3GPT folders equal transformers' `generate`, token for token (float32, CPU).

One table of cases, each a folder of `make_reference.py generation` served by the plugin: four prompts of 5 to 71
tokens in one batch, 64 new tokens each, prefix caching on; the batch runs twice, and the second pass reads the
shared prefixes from the cache (for models with the smear, vLLM's `align` mode restores the smear's state with
them). The first new token's log-probabilities equal transformers' within float32 round-off. The guard: switching
off any one feature of the kind (smear, value embeddings, backout, L3 layers, sliding window) changes transformers'
tokens, so equal tokens mean vLLM computed each of them.
"""

import pytest
from conftest import assert_first_logprobs, engine, first_difference, read_reference

# (case id, kind of make_reference.py, vLLM class the plugin must pick, where the L3 tables live, LLM arguments)
CASES = [
    ("dense", "dense", "L3GPTSmearForCausalLM", None, {}),
    ("l3", "l3", "L3GPTSmearForCausalLM", "device", {}),
    ("l3-tables-in-cpu-memory", "l3", "L3GPTSmearForCausalLM", "cpu", {"hf_overrides": {"l3_offload": True}}),
    ("l3-untied-residual", "l3_untied", "L3GPTSmearForCausalLM", "device", {}),
    ("l3-untied-in-cpu-memory", "l3_untied", "L3GPTSmearForCausalLM", "cpu", {"hf_overrides": {"l3_offload": True}}),
    ("legacy", "legacy", "L3GPTForCausalLM", None, {}),
    ("nanochat", "nanochat", "L3GPTSmearForCausalLM", None, {}),
]


def l3_tables(model) -> list[tuple[bool, str]]:
    """(offloaded, device type) of every L3 table of a served model."""
    return [(layer.offload, layer.key_table.weight.device.type) for layer in model.model.l3_layers.values()]
# the prompts sharing a 40-token prefix (make_reference.PROMPT_LENGTHS): 32 of it fill a block
SHARED_PREFIX_PROMPTS = (2, 3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, architecture, tables, kwargs", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_greedy_tokens_equal_transformers(references, kind, architecture, tables, kwargs):
    from vllm import SamplingParams

    folder = references("generation") / kind
    reference = read_reference(folder.with_suffix(".json"))
    for feature, tokens in reference["without"].items():
        assert tokens != reference["tokens"], f"guard: switching off {feature} does not change transformers' tokens"
    params = SamplingParams(temperature=0.0, max_tokens=reference["new_tokens"], ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": ids} for ids in reference["prompts"]]
    with engine(folder, enable_prefix_caching=True, **kwargs) as llm:
        assert llm.llm_engine.model_config.architecture == architecture
        if tables is not None:  # offloaded tables stay in CPU memory (on this CPU machine, also the device's)
            (placement,) = llm.apply_model(l3_tables)
            assert placement and all(where == (tables == "cpu", "cpu") for where in placement), placement
        for repeat in range(2):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for output, want, margins in zip(outputs, reference["tokens"], reference["margins"]):
                got = list(output.outputs[0].token_ids)
                assert got == want, f"pass {repeat + 1}: " + first_difference(got, want, margins)
            for output, first_logprobs in zip(outputs, reference["first_logprobs"]):
                assert_first_logprobs(output, first_logprobs)
        cached = [outputs[i].num_cached_tokens for i in SHARED_PREFIX_PROMPTS]
        assert all(count >= 32 for count in cached), f"the second pass read no prefix from the cache: {cached}"
