"""The `hybrid-linear-convert` front end: --help and argument errors without torch, the format list from the same
entries as the registry, its other entry points, decimal size units, and one line (no traceback) for every expected
failure while a bug keeps its traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from distributed_helpers import SUBPROCESS_TIMEOUT

from hybrid_linear_cli import convert as front_end
from hybrid_linear_cli.conversion_catalogue import DTYPE_NAMES, FORMAT_CATALOGUE, SIZE_BASE, format_size
from hybrid_linear_models import HybridLinearConfig
from hybrid_linear_models.conversion import FORMATS, ConversionError, convert_checkpoint
from hybrid_linear_models.conversion import api as conversion_api
from hybrid_linear_models.conversion.formats import with_remote_code

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "tests" / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "fast_llm"
HEAVY_MODULES = ("torch", "transformers", "hybrid_linear_models", "safetensors", "tqdm", "yaml")


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT, check=False)


# --------------------------------------------------------------------------------------------- a light front end


def test_help_and_argument_errors_do_not_import_torch():
    script = textwrap.dedent(f"""
        import sys
        from hybrid_linear_cli.convert import main
        codes = []
        for argv in (["--help"], ["--from", "fast_llm", "SRC"]):  # the help, and an argument error
            try:
                main(argv)
            except SystemExit as stop:
                codes.append(stop.code)
        print("exit codes", codes, "heavy modules", [m for m in {HEAVY_MODULES!r} if m in sys.modules])
    """)
    result = run_python("-c", script)
    assert result.returncode == 0, result.stderr
    assert "exit codes [0, 2] heavy modules []" in result.stdout
    assert "fast_llm_distributed" in result.stdout  # the help was printed, with the formats
    assert "the following arguments are required: --to" in result.stderr


def test_help_lists_the_registrys_formats():
    help_text = front_end.build_parser().format_help()
    for name, fmt in FORMATS.items():
        roles = "/".join(role for role, able in (("read", fmt.can_read), ("write", fmt.can_write)) if able)
        line = rf"^  {re.escape(name)} +{re.escape(fmt.description)} \[{roles}\]$"
        assert re.search(line, help_text, re.MULTILINE), name


def test_registry_is_built_from_the_catalogue():
    """One registration per format: the torch-free catalogue entry, which the registry resolves."""
    assert list(FORMATS) == [entry.name for entry in FORMAT_CATALOGUE]
    for entry in FORMAT_CATALOGUE:
        fmt = FORMATS[entry.name]
        assert (fmt.description, fmt.can_read, fmt.can_write, fmt.output) == (
            entry.description, entry.can_read, entry.can_write, with_remote_code(entry.output))
        assert all(callable(function) for function in (fmt.read, fmt.target_rows, fmt.write) if function is not None)
    assert FORMATS["hf"].output.marker_fields == {"model_type": HybridLinearConfig.model_type}
    assert all(isinstance(conversion_api.DTYPES[name], torch.dtype) for name in DTYPE_NAMES)


def test_other_entry_points_still_work():
    for args in (["conversion_scripts/convert.py", "--help"], ["-m", "hybrid_linear_models.conversion", "--help"]):
        result = run_python(*args)
        assert result.returncode == 0 and "formats:" in result.stdout and "--force" in result.stdout, args


# --------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("nbytes, shown", [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (621_312, "621.3 kB"),
                                           (5 * 10**6, "5.0 MB"), (14_903_000_000, "14.90 GB"),
                                           (2 * 10**12, "2.00 TB")])
def test_sizes_are_decimal(nbytes, shown):
    assert format_size(nbytes) == shown


def test_progress_bar_and_summary_use_the_same_decimal_units(tmp_path, monkeypatch, capsys):
    bars = []

    class RecordingBar(conversion_api.tqdm):
        def __init__(self, *args, **kwargs):
            bars.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(conversion_api, "tqdm", RecordingBar)
    total = convert_checkpoint(SRC, tmp_path / "first", from_format="fast_llm", to_format="hf").bytes
    assert front_end.main(["--from", "fast_llm", "--to", "hf", str(SRC), str(tmp_path / "dst")]) == 0
    assert bars and all(bar["unit"] == "B" and bar["unit_divisor"] == SIZE_BASE == 1000 for bar in bars)
    summary = capsys.readouterr().out
    assert f"Converted 56 tensors ({format_size(total)}) from fast_llm to hf" in summary
    assert "kB)" in summary  # the fixture is 0.6 MB


# --------------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("failure, status, line", [
    (ConversionError("SRC x is not a Fast-LLM checkpoint."), 1, "error: SRC x is not a Fast-LLM checkpoint."),
    (OSError(28, "No space left on device"), 1, "error: [Errno 28] No space left on device; no partial output"),
    (KeyboardInterrupt(), 130, "stopped by SIGINT; no partial output was left at DST."),
])
def test_expected_failures_end_in_one_line(tmp_path, monkeypatch, capsys, failure, status, line):
    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr(conversion_api, "convert_checkpoint", failing)
    assert front_end.main(["--from", "fast_llm", "--to", "hf", str(SRC), str(tmp_path / "dst")]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hybrid-linear-convert: {line}"), err


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def buggy(*args, **kwargs):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(conversion_api, "convert_checkpoint", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        front_end.main(["--from", "fast_llm", "--to", "hf", str(SRC), str(tmp_path / "dst")])
