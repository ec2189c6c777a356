"""nanochat checkpoints and tokenizers to L3GPT folders and back, with the same logits and ids
(`python -m hfl3.nanochat.convert_nanochat_to_hf`, `python -m hfl3.nanochat.convert_hf_to_nanochat`).

Developer-side tools beside the model, not in its Hub folder (`hfl3/models/l3gpt/` ships as remote code and imports
nothing of the rest of hfl3; these import hfl3's provenance and atomic writers)."""
