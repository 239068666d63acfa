"""Training helpers of the package that a saved model folder does not ship: the fine-tuning script
(`finetune.py`, behind `hybrid-linear-finetune` / `python -m hybrid_linear_cli.finetune`)."""
