"""Data for the recipes. Pretraining text: `sources` (corpora as shards read in resumable batches), `packing`
(pieces and BOS-aligned best-fit packing), `streaming` (the training stream: hash split, per process and DataLoader
worker streams, bounded buffers, state for exact resume), `text` (small corpora in memory, for benchmarks). Chat
JSONL with assistant-only masks: `chat`."""
