"""What the model cards of hfl3's outputs say: `write_model_card` arguments (`hfl3.provenance.card`) for a pretrained
L3GPT (`l3gpt_model_card`) and for a LoRA adapter or its merged model (`sft_model_card`). Each returns the title, the
usage text and the `ModelCardData` fields (`eval_results` with `model_name` for a `model-index`); one more field here
goes into the card's front matter."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfl3.evaluate.chatcore import chatcore_eval_results
from hfl3.evaluate.core import core_eval_results
from hfl3.provenance import portable


def usage_name(trainer, folder: str | os.PathLike | None = None) -> str:
    """The name a card's snippet loads the output by: `hub_model_id` when the run pushes, else the output folder (or
    `folder`) as a path relative to the working directory (`portable`). `trainer` is an
    `hfl3.trainers.hooks.TrainerHooks` trainer."""
    if trainer.push_at_end:
        return trainer.args.hub_model_id
    return portable(str(Path(folder if folder is not None else trainer.final_output_dir)))


def l3gpt_model_card(metadata: Mapping[str, Any], name: str) -> dict:
    """`write_model_card` arguments for a pretrained L3GPT loaded as `name`: the data source, the validation bits per
    byte at the end and at step 0 (`metadata["results"]`), the CORE metric when it was evaluated
    (`metadata["evaluation"]["core"]`: in the text, and as `eval_results` for the card's `model-index`), the snippet
    that loads it."""
    results = metadata.get("results") or {}
    bpb = results.get("eval_bpb")
    start = results.get("eval_before_bpb")
    core = (metadata.get("evaluation") or {}).get("core")
    text = (f"L3GPT pretrained with hfl3 on `{portable(str(metadata.get('data', {}).get('source')))}`"
            + (f": validation bpb {bpb:.4f}" if bpb is not None else "")
            + (f" (from {start:.4f} at step 0)" if start is not None else "")
            + (f"; CORE {core['core_metric']:.4f} over {len(core['results'])} tasks" if core else "") + ".\n\n"
            f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained({name!r}, trust_remote_code=True)  "
            f"# or `import hfl3` first\n"
            "# AutoTokenizer reads config.json, whose auto_map names remote code: say so, or it asks [y/N]\n"
            "# (PreTrainedTokenizerFast.from_pretrained reads the tokenizer alone, without remote code)\n"
            f"tokenizer = AutoTokenizer.from_pretrained({name!r}, trust_remote_code=True)\n```")
    card = {"title": "L3GPT (hfl3)", "extra_markdown": text, "tags": ("hfl3", "l3gpt")}
    if core:  # the model-index of the Hub's evaluation results
        card.update(eval_results=core_eval_results(core), model_name=Path(name).name)
    return card


def sft_model_card(metadata: Mapping[str, Any], name: str, adapter: bool) -> dict:
    """`write_model_card` arguments for an SFT output loaded as `name` (a Hub id, or a folder relative to the working
    directory): the snippet that loads it, the results, ChatCORE when it was evaluated (`metadata["evaluation"]
    ["chatcore"]`, as `eval_results` for the card's `model-index`). The base is named by its Hub id when known
    (`metadata["base_model"]["hub_id"]`), else as the local folder it was."""
    base = metadata.get("base_model") or {}
    hub_id = base.get("hub_id")
    shown = hub_id or portable(str(base.get("name_or_path")))
    register = ("import hfl3  # registers L3GPT; without hfl3 pass trust_remote_code=True to from_pretrained\n"
                if base.get("model_type") == "l3gpt" else "")
    if adapter:
        usage = (f"LoRA adapter of `{shown}`{'' if hub_id else ' (a local folder)'}, trained with hfl3's "
                 f"`recipes/sft_lora.py` (loss on assistant tokens only).\n\n```python\n{register}"
                 f"from peft import AutoPeftModelForCausalLM\n"
                 f"model = AutoPeftModelForCausalLM.from_pretrained({name!r})\n```")
        if not hub_id:
            usage += ("\n\n`adapter_config.json` names the base folder by its absolute path (PEFT resolves a relative "
                      "one against the working directory), so the adapter loads from any working directory on this "
                      "machine; if the base folder moves, update `base_model_name_or_path` there.")
    else:
        usage = (f"Full model: `{shown}` with the LoRA adapter merged in, trained with hfl3's `recipes/sft_lora.py`."
                 f"\n\n```python\n{register}from transformers import AutoModelForCausalLM\n"
                 f"model = AutoModelForCausalLM.from_pretrained({name!r})\n```")
    if quantized := base.get("quantization"):  # QLoRA (hfl3.trainers.base_model.quantization_metadata)
        usage += (f"\n\nTrained on the base quantized by bitsandbytes ({quantized['bits']}-bit "
                  f"{quantized['quant_type']}, the rest in {quantized['dtype']}); " + (
                      "load it quantized the same way (on the unquantized base the adapter meets weights it was not "
                      "trained with):\n\n```python\nfrom transformers import BitsAndBytesConfig\nmodel = "
                      f"AutoPeftModelForCausalLM.from_pretrained({name!r}, quantization_config=BitsAndBytesConfig("
                      + ", ".join(f"{key}={value!r}" for key, value in quantized["bitsandbytes_config"].items())
                      + f"), dtype={quantized['dtype']!r})\n```" if adapter
                      else f"the adapter is merged into its dequantized weights, in {quantized['dtype']}."))
    results = metadata.get("results")
    if results:
        usage += "\n\n## Results\n\n" + "\n".join(f"- {k}: {v}" for k, v in sorted(results.items()))
    card = {"title": f"{Path(name).name} (LoRA SFT of {Path(shown).name if not hub_id else hub_id})",
            "extra_markdown": usage, "library_name": "peft" if adapter else "transformers",
            "tags": ("hfl3", "sft", "lora", "trl"), "base_model": hub_id}
    if chatcore := (metadata.get("evaluation") or {}).get("chatcore"):
        card.update(eval_results=chatcore_eval_results(chatcore), model_name=Path(name).name)
    return card
