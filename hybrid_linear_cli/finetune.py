"""`hybrid-linear-finetune`: the fine-tuning front end, light enough that `--help` answers at once.

    hybrid-linear-finetune MODEL DATASET OUTPUT [script options] [any transformers TrainingArguments flag]

Why this module is apart from `hybrid_linear_models.training.finetune` (which does the work): importing that package imports
torch and transformers (seconds), and building transformers' parser of all ~110 `TrainingArguments` adds more. So the
script's own options live here, in a standard-library dataclass, beside a table of the `TrainingArguments` flags whose
defaults the script sets or that a newcomer needs first. `--help` formats both with argparse alone; the real parse
(`hybrid_linear_models.training.finetune.parse_arguments`) hands the same dataclass to transformers' `HfArgumentParser`
beside `TrainingArguments` and applies the same defaults, and `--help-training` prints that parser's full help.
"""

import argparse
import shutil
import sys
from dataclasses import dataclass, field, fields
from typing import Any

PROG = "hybrid-linear-finetune"

DESCRIPTION = """\
Fine-tune a hybrid model (or train LoRA adapters) on a text dataset with transformers.Trainer.

DATASET is a .jsonl, .json, .parquet, .csv or .txt file (a .txt file holds one document per line), a folder of such
files, or a dataset id on the Hugging Face Hub; documents are read from the column named by --text_column. With
--packing, documents are concatenated without padding (DataCollatorWithFlattening): every mixer keeps them apart.
Several GPUs: accelerate launch -m hybrid_linear_cli.finetune MODEL DATASET OUTPUT ... (DDP or FSDP2)."""

EPILOG = """\
Every flag of transformers' TrainingArguments is accepted as well (--lr_scheduler_type, --weight_decay,
--num_train_epochs, --optim, --fsdp, ...): --help-training lists them all (it takes a few seconds).
Flags may be spelled with dashes or underscores (--max-steps = --max_steps); a boolean flag alone means true
(--packing), or takes a value (--bf16 false).

Examples:
  hybrid-linear-finetune MODEL_DIR data.jsonl OUT_DIR --packing --activation_checkpointing
  hybrid-linear-finetune MODEL_DIR data.jsonl OUT_DIR --lora --merge_lora --max_steps 500 --save_steps 100
  hybrid-linear-finetune MODEL_DIR data.jsonl OUT_DIR --max_steps 500 --resume_from_checkpoint last"""

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


def option_strings(name: str) -> list[str]:
    """How --help spells a flag: `--name` and any old spelling that stands for it alone (the dashed spelling, also
    accepted, is said once in the epilog)."""
    return [f"--{name}"] + [old for old, new in OLD_SPELLINGS.items() if new == [f"--{name}"]]


def metavar(default: Any) -> str:
    if isinstance(default, bool):
        return "BOOL"
    return {int: "N", float: "X"}.get(type(default), "VALUE")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks, appends each option's default, and uses up to 120 columns."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40, width=min(120, shutil.get_terminal_size().columns))

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default == DERIVED:  # the help text says what it resolves to
            return action.help or ""
        return super()._get_help_string(action)


def add_help_option(group: argparse._ArgumentGroup, name: str, default: Any, text: str) -> None:
    """One option as --help shows it; a boolean flag alone means true, or takes a value."""
    nargs = "?" if isinstance(default, bool) or name in ("bf16", "use_cpu") else None
    group.add_argument(*option_strings(name), default=default, help=text, nargs=nargs,
                       metavar="BOOL" if nargs else metavar(default))


def build_help_parser() -> argparse.ArgumentParser:
    """The parser that formats --help (standard library only); it never parses a run."""
    parser = argparse.ArgumentParser(prog=PROG, usage=f"{PROG} MODEL DATASET OUTPUT [options]",
                                     description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("--help-training", action="store_true", default=argparse.SUPPRESS,
                        help="print every TrainingArguments flag with its default, then exit")
    add_positionals(parser)
    own = parser.add_argument_group("options of this script")
    for item in fields(FinetuneArguments):
        add_help_option(own, item.name, item.default, item.metadata["help"])
    training = parser.add_argument_group("TrainingArguments (a selection, with this script's defaults)")
    for name, (default, text) in TRAINING_FLAGS.items():
        add_help_option(training, name, default, text)
    return parser


def wants_help(argv: list[str]) -> bool:
    return "-h" in argv or "--help" in argv


def main(argv: list[str] | None = None) -> int:
    """The console script, `python -m hybrid_linear_cli.finetune` and `accelerate launch -m ...` all start here."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_help(argv):
        build_help_parser().print_help()
        return 0
    # torch and transformers load only once there is work to do
    from hybrid_linear_models.training.finetune import run

    return run(argv)

if __name__ == "__main__":
    sys.exit(main())
