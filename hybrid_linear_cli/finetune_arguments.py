"""The fine-tuning script's arguments as plain data, shared by its light front end (`hybrid_linear_cli.finetune`,
whose `--help` formats them with argparse alone) and the run (`hybrid_linear_models.training.finetune`, which hands
them to transformers' `HfArgumentParser`): the positional paths, the script's own options, the `TrainingArguments`
flags whose defaults the script sets or that a newcomer needs first, and the other spellings it accepts. Standard
library only, and importing nothing of either side, so both import it and neither imports the other at import time.
"""

import argparse
from dataclasses import dataclass, field
from typing import Any

PROG = "hybrid-linear-finetune"

# The three paths, positional: a command then reads like a copy (`MODEL DATASET OUTPUT`).
POSITIONALS = {
    "model": "model folder (config, weights and tokenizer) or hub id",
    "dataset": ".jsonl/.json/.parquet/.csv/.txt file, a folder of them, or a hub dataset id",
    "output": "where the fine-tuned model (with --lora and without --merge_lora: the adapter) is written",
}


@dataclass
class FinetuneArguments:
    """The script's own options (everything else is a `TrainingArguments` field)."""

    text_column: str = field(default="text", metadata={"help": "dataset column holding the documents' text"})
    dataset_config: str | None = field(default=None, metadata={"help": "hub datasets: the configuration name"})
    dataset_split: str = field(default="train", metadata={"help": "hub datasets and folders: the split to train on"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder or hub id, if not MODEL's"})
    max_length: int = field(default=2048, metadata={"help": "documents are truncated to this many tokens"})
    packing: bool = field(default=False, metadata={"help": "padding-free packing (DataCollatorWithFlattening)"})
    lora: bool = field(default=False, metadata={"help": "train LoRA adapters (needs peft) instead of all weights"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / rank)"})
    merge_lora: bool = field(default=False, metadata={"help": "with --lora: merge the adapters into the saved model"})


# Defaults that depend on the run; `hybrid_linear_models.training.finetune` resolves a None left by the parse.
DERIVED = "derived"

# TrainingArguments flags shown by --help: name -> (default, help). The parse applies these defaults, so an entry
# either changes transformers' default (for the reason given) or repeats it (tests/test_finetune_cli.py checks that
# the rest still match transformers'); DERIVED ones are resolved after parsing, as the help says.
TRAINING_FLAGS: dict[str, tuple[Any, str]] = {
    "per_device_train_batch_size": (8, "documents per device and step"),
    "gradient_accumulation_steps": (1, "steps whose gradients are summed before each update"),
    "max_steps": (100, "optimizer steps (-1: --num_train_epochs decides)"),
    "learning_rate": (1e-4, "peak learning rate"),
    "warmup_steps": (0, "linear warm-up steps"),
    "logging_steps": (10, "log the loss every N steps"),
    "seed": (0, "seed of the data order and LoRA's initialisation"),
    "bf16": (DERIVED, "bfloat16 mixed precision (default: on when CUDA is available)"),
    "use_cpu": (DERIVED, "train on the CPU (default: on when CUDA is not available)"),
    "activation_checkpointing": (False, "recompute activations in the backward pass (saves memory)"),
    "activation_checkpointing_kwargs": ({"use_reentrant": False}, "non-reentrant: works with frozen inputs (LoRA)"),
    "output_dir": (DERIVED, "checkpoints folder (default: OUTPUT/checkpoints)"),
    "save_strategy": ("steps", "when to write checkpoints: steps, epoch, no (steps: also at the end)"),
    "save_steps": (500, "write a checkpoint every N steps"),
    "save_total_limit": (None, "keep at most N checkpoints"),
    "resume_from_checkpoint": (None, "a checkpoint folder, or 'last' for the newest in --output_dir"),
    "report_to": ("none", "where to log: none, tensorboard, wandb, ..."),
    "remove_unused_columns": (False, "the collators take the tokenized documents as they are"),
    "ddp_find_unused_parameters": (False, "every parameter takes part in each step: no extra graph traversal"),
}

# Other spellings this script accepts that are not TrainingArguments' own: spelling -> the tokens it stands for.
OLD_SPELLINGS = {
    "--batch-size": ["--per_device_train_batch_size"],
    "--gradient-checkpointing": ["--activation_checkpointing"],
    "--no-bf16": ["--bf16", "false"],
    "--text-field": ["--text_column"],
}


def expand_old_spellings(argv: list[str]) -> list[str]:
    """`argv` with the old spellings replaced (also in the `--flag=value` form)."""
    expanded = []
    for token in argv:
        flag, equals, value = token.partition("=")
        if flag in OLD_SPELLINGS:
            expanded += OLD_SPELLINGS[flag] + ([value] if equals else [])
        else:
            expanded.append(token)
    return expanded


def add_positionals(parser: argparse.ArgumentParser) -> None:
    for name, text in POSITIONALS.items():
        parser.add_argument(name, metavar=name.upper(), help=text)
