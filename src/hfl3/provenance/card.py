"""The model card (`README.md`) of every hfl3 output, in one module: how it is written (`write_model_card`:
`huggingface_hub.ModelCard.from_template` with `ModelCardData` for the YAML front matter and hfl3's Jinja template
`model_card_template.md` for the text: title, usage, provenance table, the full metadata) and what the trainers'
outputs say (`l3gpt_model_card` for a pretrained L3GPT, `sft_model_card` for a LoRA adapter or its merged model).
Each content builder takes the metadata and the name the output is loaded by, and returns `write_model_card`'s
arguments: the title, the usage text and the `ModelCardData` fields (`eval_results` with `model_name` for a
`model-index`); one more field there goes into the card's front matter. The `model-index` entries are built by the
evaluation that produced the results (`hfl3.evaluate.core_eval_results`, `chatcore_eval_results`), passed in as
`model_index`: provenance sits below evaluation in the layers (docs/design.md, Layers)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hfl3.atomic import atomic_path, to_json_safe
from hfl3.provenance.portable import portable
from hfl3.provenance.safetensors_header import find_hashes

TEMPLATE = Path(__file__).with_name("model_card_template.md")
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ModelIndex = Callable[[Mapping[str, Any]], list]
"""An evaluation's summary -> the card's `model-index` entries (`huggingface_hub.EvalResult`s)."""


def write_model_card(
    output_dir: str | os.PathLike,
    title: str,
    metadata: Mapping[str, Any],
    extra_markdown: str = "",
    *,
    library_name: str = "transformers",
    tags: Sequence[str] = ("hfl3",),
    base_model: str | None = None,
    **card_data: Any,
) -> Path:
    """Write `output_dir/README.md`: `ModelCard.from_template` with hfl3's template. The YAML front matter is a
    `ModelCardData` of `library_name`, `tags`, `base_model` when it is a Hub repository id rather than a local path
    (the Hub validates it) and any other `ModelCardData` field given in `card_data` (e.g. `eval_results` with
    `model_name`, which the Hub shows as `model-index`); the text holds the title, `extra_markdown`, a provenance
    table (every `*sha256*` value found in `metadata`, the git commit, the package versions) and the full `metadata`
    as JSON. Local paths and tokens are removed first (`portable`).

    Args:
        output_dir: folder of the artifact (created if missing).
        title: first-level heading.
        metadata: provenance dict, usually from `build_metadata`.
        extra_markdown: free text placed after the title (usage, results).
        library_name: `transformers` for full models, `peft` for adapters.
        tags: Hub tags.
        base_model: the model this one was fine-tuned from, if any.
        **card_data: further `huggingface_hub.ModelCardData` fields.

    Returns:
        The path of the README written (atomically).
    """
    from huggingface_hub import ModelCard, ModelCardData

    metadata = portable(to_json_safe(dict(metadata)))
    hub_base = base_model if base_model and _HUB_REPO_ID.match(base_model) and not Path(base_model).exists() else None
    data = ModelCardData(library_name=library_name, tags=list(tags), base_model=hub_base, **card_data)
    card = ModelCard.from_template(
        data, template_path=str(TEMPLATE), title=portable(title), summary=portable(extra_markdown.strip()),
        hashes=list(find_hashes(metadata)), git_commit=metadata.get("git_commit"),
        versions=metadata.get("versions", {}), metadata_json=json.dumps(metadata, indent=2, ensure_ascii=False),
    )
    path = Path(output_dir) / "README.md"
    with atomic_path(path) as tmp:
        card.save(tmp)
    return path


def l3gpt_model_card(metadata: Mapping[str, Any], name: str, model_index: ModelIndex) -> dict:
    """`write_model_card` arguments for a pretrained L3GPT loaded as `name`: the data source, the validation bits per
    byte at the end and at step 0 (`metadata["results"]`), the CORE metric when it was evaluated
    (`metadata["evaluation"]["core"]`: in the text, and as `eval_results` for the card's `model-index`, built by
    `model_index`, `hfl3.evaluate.core_eval_results`), the snippet that loads it."""
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
        card.update(eval_results=model_index(core), model_name=Path(name).name)
    return card


def sft_model_card(metadata: Mapping[str, Any], name: str, adapter: bool, model_index: ModelIndex) -> dict:
    """`write_model_card` arguments for an SFT output loaded as `name` (a Hub id, or a folder relative to the working
    directory): the snippet that loads it, the results, ChatCORE when it was evaluated (`metadata["evaluation"]
    ["chatcore"]`, as `eval_results` for the card's `model-index`, built by `model_index`,
    `hfl3.evaluate.chatcore_eval_results`). The base is named by its Hub id when known
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
    if quantized := base.get("quantization"):  # QLoRA (hfl3.trainers.sft.base_model.quantization_metadata)
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
        card.update(eval_results=model_index(chatcore), model_name=Path(name).name)
    return card
