"""Fine-tune a hybrid model folder on a text dataset with `transformers.Trainer` (`hybrid-linear-finetune`).

    hybrid-linear-finetune MODEL DATASET OUTPUT [--packing] [--lora [--merge_lora]] [any TrainingArguments flag]
    accelerate launch -m hybrid_linear_cli.finetune MODEL DATASET OUTPUT ...     # several GPUs: DDP or FSDP2

Design:
- Arguments: the script's own options (`hybrid_linear_cli.finetune.FinetuneArguments`) and every `TrainingArguments`
  field go through one `HfArgumentParser`, so any Trainer setting (schedulers, checkpointing, FSDP, ...) is a flag
  and nothing is hard-coded. The arguments and the defaults this script changes are plain data in
  `hybrid_linear_cli.finetune_arguments`; the `--help` that needs no torch is the light front end
  `hybrid_linear_cli.finetune`, where every way in (console script, `python -m`, `accelerate launch -m`) starts.
- Data: the `datasets` library reads every format (json/jsonl, parquet, csv, text, a folder, a hub id), imported
  here lazily so that `import hybrid_linear_models` never needs it; documents are tokenized with `Dataset.map`
  (streamed through Arrow on disk, not held as Python lists).
- Bad input (missing peft or datasets, a missing column, a checkpoint that is not there) is found before the model
  loads where it can be, and ends the run with one line naming the input and the fix (`FinetuneError`).
- Checkpoints: Trainer's own (`--save_strategy`, `--save_steps`, ...) under OUTPUT/checkpoints by default;
  `--resume_from_checkpoint PATH|last` continues a run where it stopped, with the same result as an unbroken one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

import hybrid_linear_models  # noqa: F401  (registers the model family)
from hybrid_linear_models.lora import lora_target_modules, lora_target_parameters
from hybrid_linear_models.mixer_registry import lora_targets as mixer_lora_targets
from hybrid_linear_models.mlp_registry import lora_targets as mlp_lora_targets
from hybrid_linear_cli.finetune_arguments import (
    DERIVED,
    PROG,
    TRAINING_FLAGS,
    FinetuneArguments,
    add_positionals,
    expand_old_spellings,
)

__all__ = ["LORA_TARGET_MODULES", "FinetuneError", "load_documents", "parse_arguments", "run"]

# Every linear projection of the family, as LoRA targets: attention, MLP, Gated DeltaNet and Kimi Delta Attention.
# every mixer's and MLP's projections, as their registrations name them (mixer_registry, mlp_registry)
LORA_TARGET_MODULES = list(dict.fromkeys([*mixer_lora_targets(), *mlp_lora_targets()]))

# A local dataset file's suffix -> the `datasets` builder that reads it.
DATASET_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
INSTALL_HINT = 'pip install "hybrid_linear_models[train]" (or pip install {package})'


class FinetuneError(ValueError):
    """Bad input to the fine-tuning script: `run` prints the message as one line and exits with status 2."""


def shown(value: Any, limit: int = 100) -> str:
    """`value` for an error message: quoted, and cut to `limit` characters (user input can be any length)."""
    text = str(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def one_line(error: BaseException, limit: int = 120) -> str:
    """An error's message on one line, followed by its direct cause's when there is one (datasets' "An error
    occurred while generating the dataset" says what went wrong only in its cause), cut to `limit` characters:
    library messages can run over paragraphs and repeat the user's input."""
    text = " ".join(str(error).split()) or type(error).__name__
    if error.__cause__ is not None:
        text = f"{text} ({one_line(error.__cause__, limit)})"
    return text if len(text) <= limit else text[:limit] + "..."


def is_main_process() -> bool:
    """Rank 0 (or a single process): the one that reports, read from the launcher's environment."""
    return int(os.environ.get("RANK", "0")) == 0


def report(message: str) -> None:
    if is_main_process():
        print(f"{PROG}: {message}", flush=True)


# ---------------------------------------------------------------- arguments


def build_parser() -> HfArgumentParser:
    """The full parser: positionals, the script's options and every TrainingArguments flag, with this script's
    defaults (a DERIVED default parses to None and is resolved by `resolve_derived_defaults`)."""
    parser = HfArgumentParser((FinetuneArguments, TrainingArguments), prog=PROG,
                              usage=f"{PROG} MODEL DATASET OUTPUT [options]")
    add_positionals(parser)
    parser.set_defaults(**{name: None if default == DERIVED else default
                           for name, (default, _) in TRAINING_FLAGS.items()})
    parser.add_argument("--help-training", action="help", help="show this list of every flag, then exit")
    return parser


def resolve_derived_defaults(values: dict[str, Any], output: Path) -> None:
    """Fills the run-dependent defaults that the parse left as None (see TRAINING_FLAGS)."""
    cuda = torch.cuda.is_available()
    derived = {"bf16": cuda, "use_cpu": not cuda,  # several CPU processes then train with DDP over gloo
               "output_dir": str(output / "checkpoints")}
    for name, value in derived.items():
        if values.get(name) is None:
            values[name] = value


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, FinetuneArguments, TrainingArguments]:
    """(model, dataset, output), the script's options and the TrainingArguments of a command line."""
    parser = build_parser()
    values = vars(parser.parse_args(expand_old_spellings(argv)))
    paths = argparse.Namespace(model=values.pop("model"), dataset=values.pop("dataset"), output=Path(values.pop("output")))
    resolve_derived_defaults(values, paths.output)
    options = FinetuneArguments(**{f.name: values[f.name] for f in dataclasses.fields(FinetuneArguments)})
    try:
        training = TrainingArguments(**{f.name: values[f.name] for f in dataclasses.fields(TrainingArguments) if f.init})
    except ValueError as error:  # TrainingArguments' own checks, e.g. an unknown --save_strategy
        raise FinetuneError(f"invalid training arguments: {one_line(error)}") from None
    return paths, options, training


# ---------------------------------------------------------------- checks before the model loads


def require(package: str, needed_for: str) -> None:
    """Imports an optional package, or stops with how to install it."""
    try:
        importlib.import_module(package)
    except ImportError:
        raise FinetuneError(f"{needed_for} needs the {package} package: {INSTALL_HINT.format(package=package)}") from None


def check_options(options: FinetuneArguments) -> None:
    if options.merge_lora and not options.lora:
        raise FinetuneError("--merge_lora merges LoRA adapters: add --lora, or drop --merge_lora")
    if options.lora:
        require("peft", "--lora")
    require("datasets", "reading the dataset")


def resolve_model_reference(model: str) -> str:
    """An existing local folder as an absolute path (so that adapters and configs record where the base model is,
    wherever they are loaded from later); a hub id ("name" or "owner/name") as given."""
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FinetuneError(f"model folder {shown(model)} has no config.json: give a model folder or a hub id")
        return str(path.resolve())
    if model.startswith((".", "/", "~")) or model.count("/") > 1:  # a path, not a hub id
        raise FinetuneError(f"model folder {shown(model)} does not exist")
    return model


def resolve_checkpoint(value: str | None, output_dir: str) -> str | None:
    """The checkpoint folder that --resume_from_checkpoint names: a path, or last/true for the newest one in
    --output_dir; None to start afresh."""
    if value is None or value.lower() in ("false", "none", ""):
        return None
    if value.lower() in ("last", "true"):
        latest = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if latest is None:
            raise FinetuneError(f"--resume_from_checkpoint {value}: no checkpoint-N folder in {shown(output_dir)} "
                                "(give a checkpoint folder, or the --output_dir of the earlier run)")
        return latest
    if not (Path(value) / "trainer_state.json").is_file():
        raise FinetuneError(f"--resume_from_checkpoint: {shown(value)} is not a checkpoint folder (it has no "
                            "trainer_state.json); give OUTPUT/checkpoints/checkpoint-N, or 'last'")
    return value


# ---------------------------------------------------------------- data


def read_dataset(source: str, options: FinetuneArguments):
    """The dataset `source` names, through `datasets`: a local file (by suffix), a local folder or a hub id."""
    import datasets

    path = Path(source).expanduser()
    builder = DATASET_BUILDERS.get(path.suffix.lower())
    try:
        if path.is_file():
            if builder is None:
                raise FinetuneError(f"dataset {shown(source)}: unknown file type; use one of "
                                    f"{', '.join(DATASET_BUILDERS)} (or a folder of them, or a hub dataset id)")
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if builder is not None:  # a file name, not a hub id
            raise FinetuneError(f"dataset file {shown(source)} does not exist")
        if path.is_dir():
            return datasets.load_dataset(str(path), split=options.dataset_split)
        return datasets.load_dataset(source, options.dataset_config, split=options.dataset_split)
    except FinetuneError:
        raise
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:  # not found, offline, parse errors
        raise FinetuneError(f"cannot read dataset {shown(source)}: {one_line(error)}") from None


def check_text_column(dataset, source: str, column: str) -> None:
    import datasets

    if column not in dataset.column_names:
        raise FinetuneError(f"dataset {shown(source)} has no column {shown(column)} (its columns: "
                            f"{shown(', '.join(dataset.column_names))}); choose one with --text_column")
    feature = dataset.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        kind = getattr(feature, "dtype", type(feature).__name__)
        raise FinetuneError(f"dataset {shown(source)}: column {shown(column)} holds {kind} values, not text; "
                            "choose a text column with --text_column")


def load_documents(source: str, tokenizer, options: FinetuneArguments):
    """The dataset's documents tokenized (an `input_ids` column; + EOS, cut to --max_length); empty texts are
    skipped, a missing (null) text stops the run with its row number."""
    dataset = read_dataset(source, options)
    column = options.text_column
    check_text_column(dataset, source, column)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        for text, index in zip(batch[column], indices):
            if text is None:
                raise FinetuneError(f"dataset {shown(source)}: row {index + 1} has no value in column "
                                    f"{shown(column)}; fill it or drop the row")
        texts = [text for text in batch[column] if text.strip()]
        ids = tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
        return {"input_ids": [(tokens + eos)[: options.max_length] for tokens in ids]}

    documents = dataset.map(tokenize, batched=True, with_indices=True, remove_columns=dataset.column_names,
                            desc="tokenizing")
    if len(documents) == 0:
        raise FinetuneError(f"dataset {shown(source)} holds no documents (column {shown(column)} is empty)")
    return documents


# ---------------------------------------------------------------- model


def load_model(model_reference: str, options: FinetuneArguments):
    try:
        model = AutoModelForCausalLM.from_pretrained(model_reference, dtype=torch.float32)
    except OSError as error:
        raise FinetuneError(f"cannot load model {shown(model_reference)}: {one_line(error)}") from None
    model.config.use_cache = False
    if not options.lora:
        return model
    from peft import LoraConfig, get_peft_model

    # the projections of the mixers and MLPs the model has, and the routed experts' stacked weights where it has
    # experts (peft adapts those through target_parameters, one rank-r update per expert)
    modules, parameters = lora_target_modules(model.config), lora_target_parameters(model.config)
    model = get_peft_model(model, LoraConfig(r=options.lora_rank, lora_alpha=options.lora_alpha,
                                             target_modules=modules, target_parameters=parameters or None,
                                             task_type="CAUSAL_LM"))
    trainable, total = model.get_nb_trainable_parameters()
    report(f"LoRA rank {options.lora_rank}: training {trainable:,} of {total:,} parameters "
           f"({100 * trainable / total:.2f}%) in {', '.join([*modules, *parameters])}")
    return model


def save_result(trainer: Trainer, tokenizer, options: FinetuneArguments, output: Path) -> str:
    """Writes the model (or the adapter, or the merged model) and the tokenizer; returns what was written."""
    if options.lora and options.merge_lora:
        merged = trainer.model.merge_and_unload()
        merged.config.use_cache = True
        if trainer.is_world_process_zero():
            merged.save_pretrained(output)
        written = "the merged model"
    else:
        if not options.lora:
            trainer.model.config.use_cache = True
        trainer.save_model(str(output))
        written = "the LoRA adapter" if options.lora else "the model"
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(output)
    return written


def final_loss(trainer: Trainer, mean_loss: float) -> float:
    """The last logged loss (the mean over the last logging window), or the run's mean loss if none was logged."""
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return logged[-1] if logged else mean_loss


# ---------------------------------------------------------------- the run


def run(argv: list[str]) -> int:
    """Parses `argv` and fine-tunes; bad input ends with one error line and status 2."""
    try:
        return finetune(*parse_arguments(argv))
    except FinetuneError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


def finetune(paths: argparse.Namespace, options: FinetuneArguments, training: TrainingArguments) -> int:
    check_options(options)
    checkpoint = resolve_checkpoint(training.resume_from_checkpoint, training.output_dir)
    model_reference = resolve_model_reference(paths.model)
    torch.manual_seed(training.seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(options.tokenizer or model_reference)
    except OSError as error:
        raise FinetuneError(f"cannot load the tokenizer of {shown(options.tokenizer or paths.model)} "
                            f"({one_line(error)}); give one with --tokenizer") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with training.main_process_first(desc="reading the dataset"):
        documents = load_documents(paths.dataset, tokenizer, options)
    model = load_model(model_reference, options)

    if options.packing:
        collator = DataCollatorWithFlattening(return_position_ids=True)
    else:
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=training, train_dataset=documents, data_collator=collator)
    batch = training.per_device_train_batch_size * training.gradient_accumulation_steps * training.world_size
    length = f"{training.max_steps} steps" if training.max_steps > 0 else f"{training.num_train_epochs:g} epochs"
    report(f"{len(documents):,} documents from {paths.dataset}; {length} of {batch} documents"
           + (f"; resuming from {checkpoint}" if checkpoint else "")
           + (f"; checkpoints in {training.output_dir}" if training.save_strategy != "no" else ""))
    result = trainer.train(resume_from_checkpoint=checkpoint)
    written = save_result(trainer, tokenizer, options, paths.output)
    report(f"done: {trainer.state.global_step} steps, final loss {final_loss(trainer, result.training_loss):.4g}; "
           f"saved {written} to {paths.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
