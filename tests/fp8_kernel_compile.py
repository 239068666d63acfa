"""Compiles the FP8 kernel (kernels_fp8_triton) for a GPU target ahead of time, with no GPU: every autotuning
configuration of every form and tile height (one_row also routed: a program row per expert route), with dependent
launch (what a Hopper GPU runs), bf16 activations
(e4m3 for fp8_dot), Qwen3-Next's 128 x 128 blocks and K = 2,048, and prints one JSON line per configuration with its
registers, its spilled bytes (the stack frame) and its shared memory; for one_row, also the SASS instructions per
weight a thread reads (the whole kernel: at K = 2,048 its slices are unrolled).

A launch specializes its arguments (16-byte aligned pointers, strides that are multiples of 16, a unit stride as the
constant 1), and so does this compile: without those hints the loads do not vectorize and the kernel spills, which
is not what a GPU runs. Registers and stack come from the cubin (`cuobjdump --dump-resource-usage`, shipped with
triton). Needs triton's NVIDIA backend (ptxas), not its interpreter.

    python tests/fp8_kernel_compile.py [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hybrid_linear_models import kernels_fp8_triton as kernel

K = 2048  # the weight's inputs (Qwen3-Next's hidden size)
INTEGERS = ("M", "N", "E", "R", "stride_xm", "stride_xsm", "stride_we", "stride_wn", "stride_se", "stride_sn",
            "stride_sk", "stride_ym")
ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "offsets_ptr", "xs_ptr", "stride_xm", "stride_xsm",
           "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_ym")


def compile_config(form: str, grouped: bool, config: tuple[int, int, int, int], arch: int, block_m: int,
                   routed: bool = False, variant: str = "") -> dict:
    """The compiled kernel's resources for one configuration (BLOCK_N, BLOCK_K, warps, stages) and rows per tile;
    `variant` "gated" (a routed down projection reading silu(gate) * up * weight) or "indexed" (a dense product
    through an aligned row index)."""
    fn = kernel._fp8_linear_kernel
    block_n, block_k, warps, stages = config
    indexed = variant == "indexed"
    pointers = {"x_ptr": "*fp8e4nv" if form == "fp8_dot" else "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                "b_ptr": "*fp32", "y_ptr": "*bf16",
                "offsets_ptr": "*i32" if grouped or routed else "*i64" if indexed else "*fp32", "xs_ptr": "*fp32",
                "rw_ptr": "*bf16" if variant == "gated" else "*fp32"}
    constants = {"K": K, "BN": 128, "BK": 128, "HAS_BIAS": False, "GROUPED": grouped,
                 "ROUTED": routed, "E_POW2": 512 if grouped else 1,
                 "FORM": kernel.FORMS.index(form), "PRECISION": "tf32", "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "BLOCK_K": block_k, "stride_sk": 1, "GATED_INPUT": variant == "gated", "HAS_INDEX": indexed,
                 "ALIGNED_INDEX": indexed, "PDL": True}
    if not grouped and not routed:
        constants.update(stride_we=0, stride_se=0)
    signature = {name: pointers.get(name, "i32" if name in INTEGERS and name not in constants else "constexpr")
                 for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED
             if signature[name] != "constexpr"}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as cubin:
        cubin.write(compiled.asm["cubin"])
    try:
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(cubin.name)
    registers, stack = (int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("REG", "STACK"))
    found = {"form": form, "grouped": grouped, "routed": routed, "variant": variant, "config": list(config),
             "block_m": block_m, "registers": registers, "stack": stack, "shared": compiled.metadata.shared}
    if form == "one_row":  # its K slices unrolled: the whole kernel's instructions over the weights a thread reads
        weights = block_n * K // (32 * warps)
        found["instructions_per_weight"] = round(_instructions(sass) / weights, 2)
    return found


def _instructions(sass: str) -> int:
    """The instructions of a cuobjdump -sass listing, NOPs left out (static count: the one_row kernel has no loop
    at K = 2,048 once unrolled, so it is the count one thread runs)."""
    return sum(1 for line in sass.splitlines()
               if re.match(r"\s*/\*[0-9a-f]{4}\*/\s+", line) and not re.match(r"\s*/\*[0-9a-f]{4}\*/\s+NOP", line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    args = parser.parse_args()
    for form, configs in kernel._CONFIGS.items():
        for grouped in (False, True) if form != "one_row" else (False,):
            # rows per tile: one row, 16 (decoding), 64 and 128 (prefill: `kernel._tile_rows`)
            for block_m in {"one_row": (1,), "scaled_dot": (16,)}.get(form, (64, 128)):
                for config in configs:
                    for routed in (False, True) if form == "one_row" else (False,):
                        print(json.dumps(compile_config(form, grouped, config, args.arch, block_m, routed)),
                              flush=True)
                    # the routed down projection's gated input; a decoding step's dense product through an index
                    variants = [(True, "gated")] if form == "one_row" else []
                    variants += [(False, "indexed")] if form in ("one_row", "scaled_dot") and not grouped else []
                    for routed, variant in variants:
                        print(json.dumps(compile_config(form, grouped, config, args.arch, block_m, routed, variant)),
                              flush=True)


if __name__ == "__main__":
    main()
