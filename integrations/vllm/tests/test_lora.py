"""The SFT recipe's LoRA adapters in vLLM (`enable_lora`, `LoRARequest`) give the greedy tokens of PEFT's merged model.

For a Qwen3 base (vLLM's own Qwen3) and an L3GPT base (this plugin: `SupportsLoRA`, q/k/v packed into `qkv_proj`),
`make_reference.py lora` trains an adapter with `recipes/sft_lora.py --merge` (LoRA on q_proj and v_proj) and
records transformers' greedy tokens of the merged model. The base is served once, the adapter applied per request;
without it, vLLM gives the base's tokens. The guard: the adapter changes transformers' tokens.
"""

import pytest
from conftest import assert_first_logprobs, engine, first_difference, read_reference

BASES = ["qwen3", "l3gpt"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("base", BASES)
def test_adapter_gives_the_merged_models_greedy_tokens(references, base):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    work = references("lora") / f"lora_{base}"
    reference = read_reference(work.with_suffix(".json"))
    assert reference["tokens"] != reference["base_tokens"], "guard: the adapter does not change the greedy tokens"
    params = SamplingParams(temperature=0.0, max_tokens=len(reference["tokens"][0]), ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": ids} for ids in reference["prompts"]]
    adapter = LoRARequest("sft", 1, str(work / "adapter"))
    with engine(work / "base", enable_lora=True, max_lora_rank=8, max_loras=1) as llm:
        for lora_request, want_tokens, all_margins in ((adapter, reference["tokens"], reference["margins"]),
                                                       (None, reference["base_tokens"], [[]] * len(prompts))):
            outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
            for output, want, margins in zip(outputs, want_tokens, all_margins):
                got = list(output.outputs[0].token_ids)
                assert got == want, f"adapter {lora_request is not None}: " + first_difference(got, want, margins)
            if lora_request is not None:
                for output, first_logprobs in zip(outputs, reference["first_logprobs"]):
                    assert_first_logprobs(output, first_logprobs)
