"""Compiles a Triton kernel for an H200 (sm_90) with no GPU, through triton's NVIDIA backend (ptxas and cuobjdump ship
with triton), and reads the cubin's stack frame: bytes spilled to local memory, which a GPU kernel must not need.
Run in a process of its own without TRITON_INTERPRET (the tests start one: `run_compile_script`)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def ptxas_present() -> bool:
    """Whether triton with its NVIDIA backend's ptxas is installed (the compiles need it, not a GPU)."""
    spec = importlib.util.find_spec("triton")
    return bool(spec and spec.submodule_search_locations and (
        Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "bin" / "ptxas").is_file())


def stack_bytes(fn, pointers: dict, constants: dict, warps: int, stages: int | None = None,
                aligned: tuple[str, ...] = ()) -> int:
    """The stack frame of `fn` (a triton.jit function) compiled for sm_90: `pointers` the pointer and float
    arguments' types (others are i32 unless in `constants`), `aligned` the arguments a launch sees 16-byte aligned."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = {"num_warps": warps, **({"num_stages": stages} if stages is not None else {})}
    binary = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as cubin:
        cubin.write(binary.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    try:
        usage = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    finally:
        os.unlink(cubin.name)
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def run_compile_script(script: str) -> list[dict]:
    """`script` (Python that prints one JSON object a line) run from the repository root in a process without
    TRITON_INTERPRET, with this folder importable; its lines parsed (an AssertionError with its stderr if it fails)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    environment["PYTHONPATH"] = os.pathsep.join([str(root / "tests"), str(root),
                                                 environment.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=600, check=False, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]
