"""The fine-tuning command as a newcomer meets it: a --help that answers without torch, every TrainingArguments flag
(and the old spellings), datasets in every local format, one-line errors for bad input (missing peft, a missing
column, a missing checkpoint), adapters that record where their base model is, and a resumed run that ends where an
unbroken one does. Runs go through `main` in this process (a tiny model, a few steps) except where a fresh
interpreter is the point (what --help imports, peft hidden, offline hub)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_helpers import SUBPROCESS_TIMEOUT
from model_helpers import tiny_model, word_tokenizer
from safetensors.torch import load_file
from transformers import TrainingArguments

from hybrid_linear_cli.finetune import (
    DERIVED,
    TRAINING_FLAGS,
    FinetuneArguments,
    build_help_parser,
    main,
)
from hybrid_linear_models.training.finetune import (
    FinetuneError,
    build_parser,
    load_documents,
    parse_arguments,
    resolve_checkpoint,
    resolve_model_reference,
)

REPO = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(2, 128)]
# documents with a learnable rule: runs of consecutive words
TEXTS = [" ".join(WORDS[(start + i) % len(WORDS)] for i in range(12)) for start in range(0, 80, 2)]


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    """`datasets` writes its Arrow cache under tmp_path, not the user's cache folder."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    tiny_model(["gated_deltanet", "full_attention"]).save_pretrained(folder)
    word_tokenizer(WORDS).save_pretrained(folder)
    return folder


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    return path


def run_in_subprocess(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          cwd=REPO, env={**os.environ, **env}, check=False)


# ---------------------------------------------------------------- --help and the arguments


def test_help_answers_without_importing_torch_and_the_package_does_not_import_datasets():
    code = (
        "import sys, io, contextlib\n"
        "from hybrid_linear_cli.finetune import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out: status = main(['--help'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'hybrid_linear_models', 'datasets') if m in sys.modules)\n"
        "print(status, heavy, '--max_steps' in out.getvalue(), '(default: 100)' in out.getvalue())\n"
        "import hybrid_linear_models\n"
        "print('datasets' in sys.modules, 'peft' in sys.modules)\n"
    )
    result = run_in_subprocess(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["0 [] True True", "False False"]


def test_help_shows_every_option_with_its_default(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for item in dataclasses.fields(FinetuneArguments):
        assert f"--{item.name}" in text
    for name, (default, _) in TRAINING_FLAGS.items():
        assert f"--{name}" in text
        if default is not DERIVED:
            assert f"(default: {default})" in " ".join(text.split()), name
    assert "--help-training" in text and "--batch-size" in text and "--gradient-checkpointing" in text


def test_help_training_lists_every_training_argument(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_arguments(["--help-training"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    flags = [f"--{f.name}" for f in dataclasses.fields(TrainingArguments) if f.init]
    assert len(flags) > 100 and all(flag in text for flag in flags)
    assert "--text_column" in text and "MODEL" in text


def test_the_light_help_states_the_defaults_the_real_parse_applies():
    """--help is built without transformers: its table must agree with what HfArgumentParser parses, and name only
    real TrainingArguments fields."""
    training_fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    assert set(TRAINING_FLAGS) <= set(training_fields)
    parsed = vars(build_parser().parse_args(["m", "d", "o"]))
    for name, (default, _) in TRAINING_FLAGS.items():
        assert parsed[name] == (None if default is DERIVED else default), name
    for item in dataclasses.fields(FinetuneArguments):
        assert parsed[item.name] == item.default
    shown = {action.dest: action.default for action in build_help_parser()._actions}
    assert all(shown[name] == default for name, (default, _) in TRAINING_FLAGS.items())


# Every flag of the script's first version (argparse, dashed), with a value and where it must land.
OLD_FLAGS = {
    "--tokenizer": ("tok", "tokenizer", "tok"),
    "--text-field": ("body", "text_column", "body"),
    "--max-length": ("64", "max_length", 64),
    "--max-steps": ("7", "max_steps", 7),
    "--batch-size": ("3", "per_device_train_batch_size", 3),
    "--gradient-accumulation-steps": ("2", "gradient_accumulation_steps", 2),
    "--learning-rate": ("5e-3", "learning_rate", 5e-3),
    "--warmup-steps": ("2", "warmup_steps", 2),
    "--logging-steps": ("2", "logging_steps", 2),
    "--seed": ("3", "seed", 3),
    "--packing": (None, "packing", True),
    "--gradient-checkpointing": (None, "activation_checkpointing", True),
    "--bf16": (None, "bf16", True),
    "--no-bf16": (None, "bf16", False),
    "--lora": (None, "lora", True),
    "--lora-rank": ("4", "lora_rank", 4),
    "--lora-alpha": ("8", "lora_alpha", 8),
    "--merge-lora": (None, "merge_lora", True),
    "--report-to": ("tensorboard", "report_to", ["tensorboard"]),
}


@pytest.mark.parametrize("flag", OLD_FLAGS)
def test_every_flag_of_the_first_version_still_works(flag):
    value, attribute, expected = OLD_FLAGS[flag]
    extra = ["--lora"] if flag == "--merge-lora" else []
    paths, options, training = parse_arguments(["m", "d.jsonl", "out", flag, *([value] if value else []), *extra])
    assert (paths.model, paths.dataset, paths.output) == ("m", "d.jsonl", Path("out"))
    parsed = getattr(options, attribute) if hasattr(options, attribute) else getattr(training, attribute)
    assert parsed == expected


def test_dashed_underscored_and_equals_spellings_all_parse():
    _, options, training = parse_arguments(["m", "d", "o", "--batch-size=3", "--max_steps", "5", "--text_column=x",
                                            "--lr-scheduler-type", "constant", "--gradient-checkpointing"])
    assert (training.per_device_train_batch_size, training.max_steps, options.text_column) == (3, 5, "x")
    assert training.lr_scheduler_type == "constant"
    assert training.activation_checkpointing and training.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_run_dependent_defaults():
    _, _, training = parse_arguments(["m", "d", "runs/out"])
    assert training.output_dir == str(Path("runs/out/checkpoints"))
    assert training.bf16 == torch.cuda.is_available() and training.use_cpu == (not torch.cuda.is_available())
    assert (training.save_strategy, training.save_steps, training.max_steps) == ("steps", 500, 100)
    _, _, training = parse_arguments(["m", "d", "out", "--output_dir", "elsewhere", "--save_strategy", "no"])
    assert (training.output_dir, training.save_strategy) == ("elsewhere", "no")


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--save_strategy", "sometimes"], "invalid choice: 'sometimes'"),
    (["--max_steps", "many"], "invalid int value: 'many'"),
])
def test_bad_flags_end_with_one_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["m", "d", "o", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_training_arguments_own_checks_end_with_one_line(capsys):
    assert main(["m", "d", "o", "--load_best_model_at_end"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(
        "hybrid-linear-finetune: error: invalid training arguments: --load_best_model_at_end requires the save and "
        "eval strategy to match")


def test_merge_lora_without_lora_is_refused(capsys):
    assert main(["m", "d", "o", "--merge_lora"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hybrid-linear-finetune: error: --merge_lora merges LoRA adapters: add --lora, or drop --merge_lora")


# ---------------------------------------------------------------- datasets


def write_dataset(folder: Path, suffix: str, texts: list[str], column: str = "text") -> Path:
    """The texts as a dataset file of the given type (each format written its own way, not through `datasets`)."""
    path = folder / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps({column: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    elif suffix == ".json":
        path.write_text(json.dumps([{column: text, "id": i} for i, text in enumerate(texts)]))
    elif suffix == ".csv":
        path.write_text(f"id,{column}\n" + "".join(f'{i},"{text}"\n' for i, text in enumerate(texts)))
    elif suffix == ".txt":
        path.write_text("\n\n".join(texts) + "\n")  # blank lines between documents are skipped
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(texts))), column: texts}), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".txt", ".parquet"])
def test_every_local_format_gives_the_same_documents(suffix, tmp_path):
    tokenizer = word_tokenizer(WORDS)
    texts = ["w5 w6 w7", "w9 w10", "w3 " * 40]
    documents = load_documents(str(write_dataset(tmp_path, suffix, texts)), tokenizer, FinetuneArguments(max_length=8))
    assert documents.column_names == ["input_ids"]
    assert documents["input_ids"] == [[5, 6, 7, 1], [9, 10, 1], [3] * 8]  # + EOS, cut to --max_length


def test_a_folder_of_files_and_another_text_column(tmp_path):
    (tmp_path / "corpus").mkdir()
    write_dataset(tmp_path / "corpus", ".jsonl", ["w5 w6", "w7"], column="body")
    documents = load_documents(str(tmp_path / "corpus"), word_tokenizer(WORDS), FinetuneArguments(text_column="body"))
    assert documents["input_ids"] == [[5, 6, 1], [7, 1]]


def test_a_missing_column_is_named_with_the_columns_present(tmp_path):
    path = write_dataset(tmp_path, ".parquet", ["w5"], column="content")
    with pytest.raises(FinetuneError) as error:
        load_documents(str(path), word_tokenizer(WORDS), FinetuneArguments())
    assert str(error.value) == (f"dataset {str(path)!r} has no column 'text' (its columns: 'id, content'); "
                                "choose one with --text_column")


@pytest.mark.parametrize("lines, message", [
    ('{"text": "w5 w6"}\n{"body": "w7"}\n', "row 2 has no value in column 'text'; fill it or drop the row"),
    ('{"text": 5}\n', "column 'text' holds int64 values, not text"),
    ('{"text": "w5"}\n{"text": \n', "cannot read dataset"),
    ('{"text": "  "}\n', "holds no documents (column 'text' is empty)"),
])
def test_bad_rows_are_one_clear_error(lines, message, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(lines)
    with pytest.raises(FinetuneError, match=re.escape(message)):
        load_documents(str(path), word_tokenizer(WORDS), FinetuneArguments())


def test_missing_files_and_unknown_types_are_named(tmp_path):
    (tmp_path / "data.xml").write_text("<doc/>")
    with pytest.raises(FinetuneError, match=r"data\.xml'?: unknown file type; use one of \.jsonl, \.json"):
        load_documents(str(tmp_path / "data.xml"), word_tokenizer(WORDS), FinetuneArguments())
    with pytest.raises(FinetuneError, match=r"dataset file '.*missing\.jsonl' does not exist"):
        load_documents(str(tmp_path / "missing.jsonl"), word_tokenizer(WORDS), FinetuneArguments())


def test_long_user_input_is_cut_in_error_messages(tmp_path):
    with pytest.raises(FinetuneError) as error:
        load_documents(str(tmp_path / ("x" * 500 + ".jsonl")), word_tokenizer(WORDS), FinetuneArguments())
    assert len(str(error.value)) < 300 and "x" * 120 not in str(error.value)


def test_a_hub_id_offline_is_one_clear_line(model_dir, tmp_path):
    code = ("import sys; from hybrid_linear_cli.finetune import main; "
            f"sys.exit(main([{str(model_dir)!r}, 'someone/some-dataset', {str(tmp_path / 'out')!r}]))")
    result = run_in_subprocess(code, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                               HF_DATASETS_CACHE=str(tmp_path / "cache"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "hybrid-linear-finetune: error: cannot read dataset 'someone/some-dataset': Couldn't reach "
        "'someone/some-dataset' on the Hub (OfflineModeIsEnabled)")


# ---------------------------------------------------------------- LoRA


def test_lora_without_peft_says_how_to_install_it_before_loading_anything(tmp_path):
    # peft hidden as if not installed; the model folder does not even exist: the check comes first
    code = ("import sys; sys.modules['peft'] = None; from hybrid_linear_cli.finetune import main; "
            f"sys.exit(main([{str(tmp_path / 'no-model')!r}, 'data.jsonl', 'out', '--lora']))")
    result = run_in_subprocess(code)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        'hybrid-linear-finetune: error: --lora needs the peft package: pip install "hybrid_linear_models[train]" '
        "(or pip install peft)")


def test_adapter_records_the_base_model_as_an_absolute_path(model_dir, data, tmp_path, monkeypatch):
    monkeypatch.chdir(model_dir.parent)  # the model given relative to the working directory
    status = main([model_dir.name, str(data), str(tmp_path / "adapter"), "--lora", "--lora_rank", "2",
                   "--max_steps", "1", "--per_device_train_batch_size", "2", "--save_strategy", "no"])
    assert status == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(model_dir.resolve())
    assert resolve_model_reference("some-org/some-model") == "some-org/some-model"  # a hub id stays as given


def test_a_missing_model_folder_is_named(tmp_path, capsys):
    assert main([str(tmp_path / "no-model"), "data.jsonl", "out"]) == 2
    assert capsys.readouterr().err == (
        f"hybrid-linear-finetune: error: model folder {str(tmp_path / 'no-model')!r} does not exist\n")
    with pytest.raises(FinetuneError, match="has no config.json"):
        resolve_model_reference(str(tmp_path))


# ---------------------------------------------------------------- checkpoints and the summary


def train_command(model_dir: Path, data: Path, output: Path, steps: int, *extra: str) -> list[str]:
    """The command line of a short deterministic run (constant learning rate, so a run cut short is the start of a
    longer one) that saves a checkpoint every 3 steps and at the end."""
    return [str(model_dir), str(data), str(output), "--max_steps", str(steps), "--per_device_train_batch_size", "4",
            "--packing", "--learning_rate", "5e-3", "--lr_scheduler_type", "constant", "--logging_steps", "1",
            "--save_steps", "3", *extra]


def summary(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_a_resumed_run_ends_where_an_unbroken_one_does(model_dir, data, tmp_path, capsys):
    assert main(train_command(model_dir, data, tmp_path / "unbroken", 6)) == 0
    unbroken = summary(capsys)
    assert main(train_command(model_dir, data, tmp_path / "broken", 3)) == 0  # stopped after 3 steps (checkpoint-3)
    capsys.readouterr()
    assert main(train_command(model_dir, data, tmp_path / "broken", 6, "--resume_from_checkpoint", "last")) == 0
    resumed = summary(capsys)
    assert resumed == unbroken.replace("unbroken", "broken")
    assert re.fullmatch(r"hybrid-linear-finetune: done: 6 steps, final loss [0-9.]+; saved the model to \S+", resumed)
    expected, actual = load_file(tmp_path / "unbroken" / "model.safetensors"), load_file(
        tmp_path / "broken" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)
    # a checkpoint named by its path, into another output folder: the same weights again
    checkpoint = tmp_path / "unbroken" / "checkpoints" / "checkpoint-3"
    assert main(train_command(model_dir, data, tmp_path / "again", 6, "--resume_from_checkpoint", str(checkpoint))) == 0
    assert summary(capsys) == unbroken.replace("unbroken", "again")
    torch.testing.assert_close(load_file(tmp_path / "again" / "model.safetensors"), expected, rtol=0, atol=0)


def test_the_summary_gives_the_last_logged_loss(model_dir, data, tmp_path, capsys):
    assert main(train_command(model_dir, data, tmp_path / "out", 2)) == 0
    state = json.loads((tmp_path / "out" / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text())
    last_loss = [entry["loss"] for entry in state["log_history"] if "loss" in entry][-1]
    assert summary(capsys) == (f"hybrid-linear-finetune: done: 2 steps, final loss {last_loss:.4g}; "
                               f"saved the model to {tmp_path / 'out'}")


def test_a_checkpoint_that_is_not_there_is_named(tmp_path):
    with pytest.raises(FinetuneError, match="no checkpoint-N folder in"):
        resolve_checkpoint("last", str(tmp_path))
    (tmp_path / "checkpoint-3").mkdir()
    assert resolve_checkpoint("True", str(tmp_path)) == str(tmp_path / "checkpoint-3")
    with pytest.raises(FinetuneError, match="is not a checkpoint folder"):
        resolve_checkpoint(str(tmp_path), str(tmp_path))
    assert resolve_checkpoint(None, str(tmp_path)) is None
