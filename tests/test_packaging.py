"""What the wheel holds follows from the source tree, with no list to keep up to date: setuptools finds the packages
by include patterns, so every folder of modules must be a package (an `__init__.py`), and every other file in a
package must be package data. CI (.ci/run) builds the wheel, installs it without -e and converts and generates from
that install; these checks catch the same omissions at once. README's test command is the one CI runs. The oldest
transformers is written twice, in pyproject and in the import-time check, and they agree."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _package_folders() -> list[Path]:
    include = SETUPTOOLS["packages"]["find"]["include"]
    tops = sorted({pattern.split(".")[0] for pattern in include})
    return [folder for top in tops for folder in [ROOT / top, *(ROOT / top).rglob("*")]
            if folder.is_dir() and folder.name != "__pycache__"]


def test_packages_are_found_not_listed():
    packages = SETUPTOOLS["packages"]
    assert isinstance(packages, dict) and "find" in packages, "pyproject lists packages by hand"
    assert "package-dir" not in SETUPTOOLS  # a mapped package is not found by find


def test_every_folder_of_modules_is_a_package():
    for folder in _package_folders():
        if any(folder.glob("*.py")):
            assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has modules but no __init__.py"


def test_every_other_file_in_a_package_is_package_data():
    data = SETUPTOOLS.get("package-data", {})
    for folder in _package_folders():
        package = ".".join(folder.relative_to(ROOT).parts)
        for path in folder.iterdir():
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                patterns = data.get(package, []) + data.get("*", [])
                assert any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns), (
                    f"{path.relative_to(ROOT)} would be left out of the wheel: add it to package-data")


def test_readme_gives_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = re.findall(r"^(python -m pytest[^\n]*)$", ci, flags=re.MULTILINE)
    assert len(commands) == 1, commands
    assert commands[0] in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_transformers_floor_is_pyproject_s_and_an_older_one_is_refused_in_one_line():
    """The import-time check (what a remote-code folder on an older transformers meets first) and pyproject's
    dependency name the same oldest transformers; older ones are refused naming both versions and the upgrade,
    that version's own pre-releases are taken."""
    from hybrid_linear_models.transformers_requirement import MINIMUM_TRANSFORMERS, check_transformers_version

    dependencies = PYPROJECT["project"]["dependencies"]
    floors = [re.search(r">=([\d.]+)", d).group(1) for d in dependencies if re.match(r"transformers\b", d)]
    assert floors == [MINIMUM_TRANSFORMERS]
    for older in ("5.17.0", "4.57.1", "5.23.9"):
        with pytest.raises(ImportError) as refused:
            check_transformers_version(older)
        message = str(refused.value)
        assert "\n" not in message and older in message and f"transformers>={MINIMUM_TRANSFORMERS}" in message
    for taken in (MINIMUM_TRANSFORMERS, f"{MINIMUM_TRANSFORMERS}.0.dev0", f"{MINIMUM_TRANSFORMERS}.1", "5.30.0"):
        check_transformers_version(taken)
