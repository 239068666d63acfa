"""A saved or converted folder as a newcomer meets it: every Auto class (AutoConfig, AutoModel, AutoModelForCausalLM,
AutoTokenizer) loads it in a process where this package cannot be imported, through the remote code and auto_map it
ships, and reproduces the in-process model; a folder without a tokenizer says so and how to add one.

One subprocess (the package blocked) loads every folder and writes what it computed; the tests compare that with the
model in this process, so the slow part (a fresh interpreter importing torch and transformers) runs once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from distributed_helpers import SUBPROCESS_TIMEOUT
from model_helpers import WITHOUT_THE_PACKAGE_PRELUDE, run_without_the_package, tiny_model, word_tokenizer
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer
from transformers.dynamic_module_utils import get_relative_import_files

import hybrid_linear_models
from hybrid_linear_models import modeling_hybrid_linear
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.hf import AUTO_MAP
from hybrid_linear_models.conversion.remote_code import remote_code_files

FAST_LLM = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda"
WORDS = ["the", "cat", "sat", "on", "mat"]
TEXT = "the cat sat on the mat"
AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")

# Runs with the package unimportable: a finder placed first refuses it (the editable install's finder comes later
# in sys.meta_path), and no sys.path entry holds it (the subprocess runs from tmp_path).
_WITHOUT_THE_PACKAGE = WITHOUT_THE_PACKAGE_PRELUDE + textwrap.dedent("""

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    job = json.loads(Path(sys.argv[1]).read_text())
    input_ids = load_file(job["input_ids"])["input_ids"]
    tensors, report = {}, {"modules": {}, "configs": {}, "tokens": {}, "tokenizer_errors": {}}
    for name, folder in job["models"].items():
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        report["configs"][name] = [type(config).__name__, config.layer_types]
        for auto in (AutoModel, AutoModelForCausalLM):
            model = auto.from_pretrained(folder, trust_remote_code=True).eval()
            report["modules"][f"{name}/{auto.__name__}"] = type(model).__module__
            with torch.no_grad():
                output = model(input_ids)
            tensors[f"{name}/{auto.__name__}"] = (output.logits if auto is AutoModelForCausalLM
                                                  else output.last_hidden_state).contiguous()
        model.save_pretrained(job["resaved"][name])  # a model loaded as remote code saves a loadable folder
    for name, folder in job["tokenizers"].items():
        try:
            report["tokens"][name] = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)(job["text"]).input_ids
        except Exception as error:
            report["tokenizer_errors"][name] = f"{type(error).__name__}: {error}"
    report["package_imported"] = any(m.split(".")[0] == "hybrid_linear_models" for m in sys.modules)
    save_file(tensors, job["tensors"])
    Path(job["report"]).write_text(json.dumps(report))
""")


def _saved_model():
    return tiny_model(tie_word_embeddings=True)  # tied: AutoModelForCausalLM on the base model's folder is exact


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("first_hour")
    model, tokenizer = _saved_model(), word_tokenizer(WORDS)
    folders = {name: root / name for name in ("lm", "base", "tokenizer", "converted", "bare")}
    model.save_pretrained(folders["lm"])
    tokenizer.save_pretrained(folders["lm"])
    model.model.save_pretrained(folders["base"])
    tokenizer.save_pretrained(folders["tokenizer"])
    convert_checkpoint(FAST_LLM / "fast_llm", folders["converted"], from_format="fast_llm", to_format="hf",
                       tokenizer=folders["tokenizer"])
    convert_checkpoint(FAST_LLM / "fast_llm", folders["bare"], from_format="fast_llm", to_format="hf")
    return folders


@pytest.fixture(scope="module")
def isolated(folders, tmp_path_factory) -> dict:
    """What the package-less subprocess computed and reported."""
    root = tmp_path_factory.mktemp("isolated")
    input_ids = torch.tensor([[3, 5, 7, 2, 11, 4, 9, 1, 6, 8]])
    save_file({"input_ids": input_ids}, root / "input_ids.safetensors")
    job = {
        "models": {name: str(folders[name]) for name in ("lm", "base")},
        "resaved": {name: str(root / f"resaved_{name}") for name in ("lm", "base")},
        "tokenizers": {name: str(folders[name]) for name in ("lm", "converted", "bare")},
        "text": TEXT, "input_ids": str(root / "input_ids.safetensors"),
        "tensors": str(root / "outputs.safetensors"), "report": str(root / "report.json"),
    }
    (root / "job.json").write_text(json.dumps(job))
    (root / "run.py").write_text(_WITHOUT_THE_PACKAGE)
    run_without_the_package(root / "run.py", root / "job.json", cwd=root)
    report = json.loads((root / "report.json").read_text())
    return {"report": report, "outputs": load_file(root / "outputs.safetensors"), "input_ids": input_ids,
            "resaved": {name: Path(path) for name, path in job["resaved"].items()}}


def _auto_map(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["auto_map"]


def _sources(folder: Path) -> set[str]:
    return {path.name for path in folder.glob("*.py")}


@pytest.mark.parametrize("name", ["lm", "base"])
def test_saved_folder_maps_every_auto_class(folders, name):
    assert _auto_map(folders[name]) == AUTO_MAP == modeling_hybrid_linear.AUTO_MAP
    assert set(AUTO_MAP) == set(AUTO_CLASSES)


def test_saving_the_base_model_first_still_maps_every_auto_class(tmp_path):
    """transformers adds only the saved class's own Auto class; in a fresh model nothing else has added the rest."""
    _saved_model().model.save_pretrained(tmp_path / "base")
    assert _auto_map(tmp_path / "base") == AUTO_MAP


@pytest.mark.parametrize("name", ["lm", "base", "converted"])
def test_folders_ship_every_source_that_remote_code_needs(folders, name):
    needed = {path.name for path in remote_code_files()}
    assert _sources(folders[name]) == needed
    # transformers copies a folder's modules into its module cache by following `from .x import` lines: that walk
    # must reach every module that the package's own import walk finds, or remote loading would miss one
    package = Path(hybrid_linear_models.__file__).parent
    followed = {Path(p).name for p in get_relative_import_files(package / "modeling_hybrid_linear.py")}
    assert followed | {"modeling_hybrid_linear.py"} == needed


@pytest.mark.slow  # a subprocess that loads the model without the package
def test_auto_classes_load_saved_folders_without_the_package(isolated):
    report, outputs, input_ids = isolated["report"], isolated["outputs"], isolated["input_ids"]
    assert not report["package_imported"]
    assert all(module.startswith("transformers_modules.") for module in report["modules"].values()), report["modules"]
    for name in ("lm", "base"):
        assert report["configs"][name][0] == "HybridLinearConfig"
        assert report["configs"][name][1] == _saved_model().config.layer_types
    model = _saved_model()
    with torch.no_grad():
        logits = model(input_ids).logits
        hidden = model.model(input_ids).last_hidden_state
    for name in ("lm", "base"):  # each folder through both Auto model classes
        torch.testing.assert_close(outputs[f"{name}/AutoModelForCausalLM"], logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(outputs[f"{name}/AutoModel"], hidden, rtol=0, atol=1e-5)


@pytest.mark.slow  # a subprocess that loads the model without the package
@pytest.mark.parametrize("name", ["lm", "base"])
def test_a_model_loaded_as_remote_code_saves_a_loadable_folder(isolated, name):
    resaved = isolated["resaved"][name]
    assert _auto_map(resaved) == AUTO_MAP
    assert _sources(resaved) == {path.name for path in remote_code_files()}


@pytest.mark.slow  # a subprocess that loads the model without the package
@pytest.mark.parametrize("name", ["lm", "converted"])
def test_auto_tokenizer_loads_saved_and_converted_folders_without_the_package(isolated, name):
    assert isolated["report"]["tokens"][name] == word_tokenizer(WORDS)(TEXT).input_ids == [2, 3, 4, 5, 2, 6]


def test_auto_tokenizer_with_the_package_needs_no_trust_remote_code(folders):
    for name in ("lm", "converted"):
        assert AutoTokenizer.from_pretrained(folders[name])(TEXT).input_ids == [2, 3, 4, 5, 2, 6]


@pytest.mark.slow  # a subprocess that loads the model without the package
def test_a_folder_without_a_tokenizer_says_so_and_how_to_add_one(folders, isolated):
    with pytest.raises(OSError, match=r"has no tokenizer .*tokenizer\.save_pretrained.*--tokenizer"):
        AutoTokenizer.from_pretrained(folders["bare"])
    # without the package, transformers' own error (it never calls this package's code) at least fails the load
    assert "bare" in isolated["report"]["tokenizer_errors"]
    assert not {path.name for path in folders["bare"].iterdir()} & {"tokenizer.json", "tokenizer_config.json"}


def test_the_converter_copies_the_tokenizer_found_beside_the_source(tmp_path, folders):
    source = tmp_path / "fast_llm"
    shutil.copytree(FAST_LLM / "fast_llm", source)
    shutil.copytree(folders["tokenizer"], source, dirs_exist_ok=True)
    result = convert_checkpoint(source, tmp_path / "hf", from_format="fast_llm", to_format="hf")
    assert result.tokenizer_files == ("tokenizer.json", "tokenizer_config.json")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (folders["tokenizer"] / "tokenizer.json").read_bytes()


def test_the_converter_refuses_a_bad_tokenizer_in_one_line(tmp_path, folders):
    too_large = tmp_path / "large"
    word_tokenizer([f"w{i}" for i in range(400)]).save_pretrained(too_large)  # ids up to 401 > vocab_size 384
    cases = {
        tmp_path / "missing": "is not a folder",
        folders["bare"]: "holds no tokenizer",
        too_large: r"token ids up to 401, but the model's vocab_size is 384",
    }
    for tokenizer, message in cases.items():
        with pytest.raises(ConversionError, match=message) as caught:
            convert_checkpoint(FAST_LLM / "fast_llm", tmp_path / "out", from_format="fast_llm", to_format="hf",
                               tokenizer=tokenizer)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConversionError, match="Hugging Face folders only"):
        convert_checkpoint(folders["converted"], tmp_path / "out", from_format="hf", to_format="fast_llm",
                           tokenizer=folders["tokenizer"])
    assert not (tmp_path / "out").exists()


def test_a_long_tokenizer_path_is_shortened_in_the_error(tmp_path):
    long_path = tmp_path / ("x" * 200) / ("y" * 200)
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(FAST_LLM / "fast_llm", tmp_path / "out", from_format="fast_llm", to_format="hf",
                           tokenizer=long_path)
    assert "y" * 50 in str(caught.value) and "x" * 101 not in str(caught.value) and len(str(caught.value)) < 250


@pytest.mark.slow  # the quickstart in a subprocess
def test_quickstart_prints_a_short_summary(tmp_path):
    """README's first command: a few lines (conversion, its error against Fast-LLM, generations, where the models
    are), no file listings or progress bars, and the models where it says."""
    root = Path(__file__).parents[1]
    environment = {**os.environ, "PYTHONPATH": str(root)}  # this checkout's package, whatever is installed
    result = subprocess.run([sys.executable, str(root / "examples" / "quickstart.py"), "--output", str(tmp_path)],
                            check=False, cwd=tmp_path, env=environment, stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) <= 5, result.stdout
    assert "56 tensors" in lines[0] and "max |logits - Fast-LLM's| = " in lines[0]
    assert float(lines[0].split("max |logits - Fast-LLM's| = ")[1].split()[0]) <= 1e-4
    assert str(tmp_path) in lines[-1]
    assert ".py" not in result.stdout and result.stderr == ""
    assert (tmp_path / "converted-hf" / "config.json").is_file() and (tmp_path / "fresh-hf" / "config.json").is_file()


def test_a_tokenizer_config_without_a_class_still_loads(tmp_path, folders):
    """Then AutoTokenizer picks the class registered for the model type: this package's loader, which returns
    transformers' generic fast tokenizer for a folder with tokenizer.json."""
    shutil.copytree(folders["lm"], tmp_path / "lm")
    tokenizer_config = json.loads((tmp_path / "lm" / "tokenizer_config.json").read_text())
    del tokenizer_config["tokenizer_class"]
    (tmp_path / "lm" / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "lm")
    assert type(tokenizer).__name__ == "TokenizersBackend"
    assert tokenizer(TEXT).input_ids == [2, 3, 4, 5, 2, 6]
