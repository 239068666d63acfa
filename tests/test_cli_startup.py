"""The command lines answer `--help` and refuse a bad conversion without importing torch (which takes seconds): each
case runs in a fresh interpreter that reports its exit status, its stderr and whether `torch` is in sys.modules at the
end. A refusal is one line naming the problem and the fix; the package's fixture checkpoints make the good paths."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST_LLM = ROOT / "tests" / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "fast_llm"
PROG = "hybrid-linear-convert"

_RUN = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    kind, target, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            if kind == "module":  # a front end's main(argv)
                module = __import__(target, fromlist=["main"])
                status = module.main(argv)
            else:  # a script, as `python SCRIPT ARGS` runs it
                sys.argv = [target, *argv]
                runpy.run_path(target, run_name="__main__")
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    print(json.dumps({"status": status or 0, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                      "torch": "torch" in sys.modules}))
""")


def run(kind: str, target: str, *argv: str, cwd: Path = ROOT) -> dict:
    """Runs a front end's main (kind "module") or a script (kind "script") in a fresh interpreter whose sys.path
    starts at the checkout."""
    result = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + _RUN,
                             kind, target, *map(str, argv)], cwd=cwd, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_refused(report: dict, *words: str) -> None:
    assert report["status"] == 1, report
    lines = report["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), report["stderr"]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not report["torch"], "torch was imported before the refusal"


@pytest.mark.parametrize("target", ["hybrid_linear_cli.convert", "hybrid_linear_cli.finetune"])
def test_front_ends_answer_help_without_torch(target):
    report = run("module", target, "--help")
    assert report["status"] == 0 and "usage:" in report["stdout"]
    assert not report["torch"]


@pytest.mark.parametrize("script", ["examples/quickstart.py", "benchmarks/make_finetune_example.py",
                                    "conversion_scripts/convert.py"])
def test_scripts_answer_help_without_torch_and_write_nothing(script, tmp_path):
    report = run("script", str(ROOT / script), "--help", cwd=tmp_path)
    assert report["status"] == 0 and "usage:" in report["stdout"], report
    assert not report["torch"]
    assert list(tmp_path.iterdir()) == []  # no folder named --help


def test_make_finetune_example_refuses_an_existing_output_without_torch(tmp_path):
    (tmp_path / "model").mkdir()
    report = run("script", str(ROOT / "benchmarks/make_finetune_example.py"), tmp_path)
    assert report["status"] == 2 and "exists" in report["stderr"], report
    assert not report["torch"]


def _folder_with_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_missing_source_is_refused_without_torch(tmp_path):
    report = run("module", "hybrid_linear_cli.convert", "--from", "fast_llm", "--to", "hf", tmp_path / "nope",
                 tmp_path / "out")
    assert_refused(report, "does not exist", "nope")


def test_a_source_that_is_a_file_is_refused_without_torch(tmp_path):
    (tmp_path / "file").write_text("x")
    report = run("module", "hybrid_linear_cli.convert", "--from", "hf", "--to", "fast_llm", tmp_path / "file",
                 tmp_path / "out")
    assert_refused(report, "not a folder")


@pytest.mark.parametrize("from_format,marker", [("fast_llm", "metadata.yaml"), ("hf", "config.json"),
                                                ("qwen3_next", "config.json"), ("fast_llm_distributed",
                                                                                 "metadata.yaml")])
def test_a_source_without_the_format_marker_is_refused_without_torch(tmp_path, from_format, marker):
    (tmp_path / "empty").mkdir()
    report = run("module", "hybrid_linear_cli.convert", "--from", from_format, "--to", "hf"
                 if from_format != "hf" else "fast_llm", tmp_path / "empty", tmp_path / "out")
    assert_refused(report, marker, f"not a {from_format} checkpoint")


def test_a_fast_llm_folder_read_as_hf_names_the_right_format(tmp_path):
    report = run("module", "hybrid_linear_cli.convert", "--from", "hf", "--to", "fast_llm", FAST_LLM, tmp_path / "o")
    assert_refused(report, "config.json", "--from fast_llm")


@pytest.mark.parametrize("model_type,reader,right", [("qwen3_next", "hf", "qwen3_next"),
                                                     ("hybrid_linear", "kimi_linear", "hf"),
                                                     ("kda", "apriel2", "fla"),
                                                     ("llama", "qwen3_next", None)])
def test_a_config_of_another_model_type_is_refused_without_torch(tmp_path, model_type, reader, right):
    source = _folder_with_config(tmp_path / "src", {"model_type": model_type})
    report = run("module", "hybrid_linear_cli.convert", "--from", reader, "--to", "fast_llm", source, tmp_path / "o")
    assert_refused(report, repr(model_type), *([f"--from {right}"] if right else []))


def test_an_existing_destination_is_refused_without_torch(tmp_path):
    (tmp_path / "out").mkdir()
    report = run("module", "hybrid_linear_cli.convert", "--from", "fast_llm", "--to", "hf", FAST_LLM,
                 tmp_path / "out")
    assert_refused(report, "exists", "--force")


def test_a_destination_inside_the_source_is_refused_without_torch(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "metadata.yaml").write_text("x: 1\n")
    report = run("module", "hybrid_linear_cli.convert", "--from", "fast_llm", "--to", "hf", source, source / "out")
    assert_refused(report, "overlaps")


def test_a_bad_shard_size_is_refused_without_torch(tmp_path):
    report = run("module", "hybrid_linear_cli.convert", "--from", "fast_llm", "--to", "hf", FAST_LLM,
                 tmp_path / "out", "--max-shard-size", "lots")
    assert_refused(report, "lots", "5GB")


def test_a_tokenizer_for_a_format_without_one_is_refused_without_torch(tmp_path):
    (tmp_path / "tok").mkdir()
    source = _folder_with_config(tmp_path / "src", {"model_type": "hybrid_linear"})
    report = run("module", "hybrid_linear_cli.convert", "--from", "hf", "--to", "fast_llm", source, tmp_path / "out",
                 "--tokenizer", tmp_path / "tok")
    assert_refused(report, "--to fast_llm", "tokenizer")


def test_a_tokenizer_that_is_not_a_folder_is_refused_without_torch(tmp_path):
    report = run("module", "hybrid_linear_cli.convert", "--from", "fast_llm", "--to", "hf", FAST_LLM,
                 tmp_path / "out", "--tokenizer", tmp_path / "missing")
    assert_refused(report, "not a folder", "missing")
