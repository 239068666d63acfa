"""The package's flat source files that an exported folder needs for `from_pretrained(..., trust_remote_code=True)`:
the configuration and modeling modules and, recursively, every module they import relatively (`from .x import y`,
`from . import x`), inside functions too: the Triton kernel modules are imported that way by their loaders
(`triton_loading.triton_kernel`), so they ship although nothing imports them at import time. Worked out from the
files themselves, so it follows the package as it changes.

Loading such a folder, transformers copies into its module cache the modules it finds by following `from .x import`
lines only (not `from . import x`): a module imported only the second way would be shipped but not loaded.
tests/test_first_hour.py checks that both walks find the same files."""

from __future__ import annotations

import ast
from pathlib import Path

from .errors import ConversionError

PACKAGE_DIR = Path(__file__).resolve().parents[1]
ENTRY_MODULES = ("configuration_hybrid_linear", "modeling_hybrid_linear")


def relative_imports(source: str, filename: str = "<module>") -> list[str]:
    """Module names imported relatively from the same package by `source`."""
    names = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1:
                raise ConversionError(f"{filename}: `from {'.' * node.level}{node.module or ''} import ...` reaches "
                                      "outside the package; remote code must be flat modules.")
            if node.module:
                names.append(node.module.split(".")[0])
            else:
                names.extend(alias.name for alias in node.names)
    return names


def remote_code_files(package_dir: Path = PACKAGE_DIR, entries: tuple[str, ...] = ENTRY_MODULES) -> list[Path]:
    """The source files to ship, entries first, each once."""
    found: dict[str, Path] = {}
    pending = list(entries)
    while pending:
        name = pending.pop(0)
        if name in found:
            continue
        path = package_dir / f"{name}.py"
        if not path.is_file():
            raise ConversionError(f"remote code: {path} is missing, so the exported folder could not be loaded with "
                                  "trust_remote_code; reinstall the hybrid_linear_models package.")
        found[name] = path
        pending.extend(relative_imports(path.read_text(encoding="utf-8"), str(path)))
    return list(found.values())


__all__ = ["ENTRY_MODULES", "relative_imports", "remote_code_files"]
