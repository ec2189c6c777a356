"""Data for the recipes. Pretraining text: `sources` (corpora as shards read in resumable batches), `packing`
(pieces and BOS-aligned best-fit packing), `streaming` (the training stream: hash split, per process and DataLoader
worker streams, bounded buffers, state for exact resume). Chat: `chat` (read, validate, write JSONL), `masks`
(assistant-only masks), `sft` (SFT datasets with provenance), `stdlib` (demo chats from the Python stdlib's
docstrings); `python -m hfl3.data.inspect` shows the masks."""
