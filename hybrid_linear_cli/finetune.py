"""`hybrid-linear-finetune`: the fine-tuning front end, light enough that `--help` answers at once.

    hybrid-linear-finetune MODEL DATASET OUTPUT [script options] [any transformers TrainingArguments flag]

Why this module is apart from `hybrid_linear_models.training.finetune` (which does the work): importing that package
imports torch and transformers (seconds), and building transformers' parser of all ~110 `TrainingArguments` adds more.
So the script's arguments are plain data (`finetune_arguments`: a standard-library dataclass of its own options and a
table of the `TrainingArguments` flags whose defaults it sets or that a newcomer needs first). `--help` formats them
here with argparse alone; the real parse (`hybrid_linear_models.training.finetune.parse_arguments`) hands the same
dataclass to transformers' `HfArgumentParser` beside `TrainingArguments` and applies the same defaults, and
`--help-training` prints that parser's full help. This module reaches the run only inside `main`, once there is work
to do; the run imports `finetune_arguments`, never this module.
"""

import argparse
import shutil
import sys
from dataclasses import fields
from typing import Any

from hybrid_linear_cli.finetune_arguments import (
    DERIVED,
    OLD_SPELLINGS,
    PROG,
    TRAINING_FLAGS,
    FinetuneArguments,
    add_positionals,
)

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
