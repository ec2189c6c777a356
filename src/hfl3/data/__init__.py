"""Data for the recipes: pretraining text (`text`: corpora, split, BOS-aligned best-fit packing); chat JSONL
(`chat`: read, validate, write), assistant-only masks (`masks`), SFT datasets with provenance (`sft`), demo chats
from the Python stdlib's docstrings (`stdlib`); `python -m hfl3.data.inspect` shows the masks."""
