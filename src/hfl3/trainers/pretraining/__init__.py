"""Pretraining L3GPT: the recipe's arguments (`config`), its data (`data`), the compute-optimal plan (`compute_optimal`), the builder (`builder`) and `PretrainTrainer` (`trainer`)."""
