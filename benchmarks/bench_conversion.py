#!/usr/bin/env python
"""Conversion benchmark: builds a synthetic multi-GB Fast-LLM checkpoint (hidden 2048, a pattern of GDN, KDA and
attention layers, written tensor by tensor), converts it to our HF format and back, each conversion in its own
subprocess, and prints throughput and the subprocess's peak resident memory during the conversion (VmHWM from /proc,
reset once the imports are done) next to its memory after the imports and the largest tensor: streaming keeps the
difference near a few times the largest tensor, whatever the checkpoint size.

    python benchmarks/bench_conversion.py                 # ~2.5 GB bfloat16, a couple of minutes
    python benchmarks/bench_conversion.py --size-gb 0.5   # quicker
    python benchmarks/bench_conversion.py --tiny          # a smoke test: 4 layers at hidden 64, a few MB
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hybrid_linear_models import HybridLinearConfig  # noqa: E402
from hybrid_linear_models.conversion.hf_layout import hf_tensor_shapes  # noqa: E402
from hybrid_linear_models.conversion.synthetic import write_random_checkpoint  # noqa: E402

PATTERN = ["gated_deltanet", "gated_deltanet", "kimi_delta_attention", "full_attention"]

# Runs in a fresh interpreter and measures itself from /proc: VmRSS once the imports are done, then VmHWM (peak RSS)
# of the conversion alone, after resetting the peak (ru_maxrss would also count the parent's memory before exec).
_CHILD = """
import json, re, sys, time
sys.path.insert(0, sys.argv[1])
from hybrid_linear_models.conversion import convert_checkpoint

def status_mb(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) / 1024

imported_mb = status_mb("VmRSS")
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
except OSError:
    pass
src, dst, from_format, to_format, shard = sys.argv[2:7]
started = time.perf_counter()
convert_checkpoint(src, dst, from_format=from_format, to_format=to_format, max_shard_size=shard)
print(json.dumps({"seconds": time.perf_counter() - started, "imported_mb": imported_mb,
                  "peak_mb": status_mb("VmHWM")}))
"""


# hidden 2048 with 128-wide heads; --tiny: the same pattern at hidden 64 with 16-wide heads
SIZES = {"full": dict(vocab=32000, hidden=2048, intermediate=5632, head_dim=128),
         "tiny": dict(vocab=256, hidden=64, intermediate=96, head_dim=16)}


def make_config(num_layers: int, size: str = "full") -> HybridLinearConfig:
    vocab, hidden, intermediate, head_dim = SIZES[size].values()
    return HybridLinearConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, rms_norm_eps=1e-5,
        layer_types=[PATTERN[i % len(PATTERN)] for i in range(num_layers)],
        num_attention_heads=16, num_key_value_heads=4, head_dim=head_dim,
        gdn_num_key_heads=8, gdn_num_value_heads=16, gdn_key_head_dim=head_dim, gdn_value_head_dim=head_dim,
        kda_num_heads=16, kda_head_dim=head_dim, kda_gate_activation="silu",
        attention_output_gate=False, attention_qk_norm=False, zero_centered_norms=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
    )


def checkpoint_bytes(config: HybridLinearConfig, itemsize: int) -> tuple[int, int]:
    sizes = [math.prod(shape) * itemsize for shape in hf_tensor_shapes(config).values()]
    return sum(sizes), max(sizes)


def run_child(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), *args], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"conversion failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def planning_costs() -> None:
    """The shape-only planning steps for the 1.2B GDN benchmark config (benchmarks/model_configs.py), best of 5: the
    canonical layout from meta-built layers (one per distinct setting), the Fast-LLM name map, and, for scale, the
    whole model built on the meta device."""
    import time

    from hybrid_linear_models import HybridLinearForCausalLM
    from hybrid_linear_models.conversion.fast_llm.parameters import build_fast_llm_rows
    from hybrid_linear_models.conversion.hf_layout import one_layer_per_type

    sys.path.insert(0, str(Path(__file__).parent))
    from model_configs import GPU_GDN, gdn_pair

    config = gdn_pair(**GPU_GDN)[0]

    def whole_model_on_meta():
        with torch.device("meta"):
            HybridLinearForCausalLM(config)

    steps = {"hf_tensor_shapes (all layers)": lambda: hf_tensor_shapes(config),
             "one_layer_per_type (census check)": lambda: one_layer_per_type(config),
             "build_fast_llm_rows": lambda: build_fast_llm_rows(config),
             "whole model on meta (not used)": whole_model_on_meta}
    for name, step in steps.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        print(f"{name}: {min(times) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.5, help="target checkpoint size (default 2.5)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--max-shard-size", default="1GB", help="HF shard size (default 1GB, to exercise sharding)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--planning", action="store_true", help="only time the planning steps (1.2B GDN config)")
    parser.add_argument("--tiny", action="store_true", help="4 layers at hidden 64 (a smoke test of this script)")
    args = parser.parse_args()
    if args.planning:
        return planning_costs()

    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = "tiny" if args.tiny else "full"
    layers = 4
    while not args.tiny and checkpoint_bytes(make_config(layers + 1), itemsize)[0] <= args.size_gb * 1e9:
        layers += 1
    config = make_config(layers, size)
    total, largest = checkpoint_bytes(config, itemsize)

    workdir = Path(tempfile.mkdtemp(prefix="bench_conversion_", dir=args.workdir))
    try:
        started = time.perf_counter()
        source = write_random_checkpoint(workdir / "fast_llm", config, "fast_llm", dtype=dtype)
        build_seconds = time.perf_counter() - started
        print(f"synthetic Fast-LLM checkpoint: {layers} layers ({', '.join(sorted(set(config.mixer_types)))}), "
              f"hidden {config.hidden_size}, {args.dtype}, {total / 1e9:.2f} GB, largest tensor "
              f"{largest / 1e6:.0f} MB, built in {build_seconds:.1f}s")
        print(f"{'conversion':<18}{'seconds':>9}{'MB/s':>8}{'RSS after imports MB':>22}{'peak RSS MB':>13}"
              f"{'peak - imports MB':>19}{'x largest tensor':>18}")
        runs = [("fast_llm", "hf", source, workdir / "hf"), ("hf", "fast_llm", workdir / "hf", workdir / "back")]
        for from_format, to_format, src, dst in runs:
            result = run_child(str(src), str(dst), from_format, to_format, args.max_shard_size)
            over = result["peak_mb"] - result["imported_mb"]
            print(f"{from_format + ' -> ' + to_format:<18}{result['seconds']:>9.1f}"
                  f"{total / 1e6 / result['seconds']:>8.0f}{result['imported_mb']:>22.0f}{result['peak_mb']:>13.0f}"
                  f"{over:>19.0f}{over * 2**20 / largest:>18.1f}")
        shards = sorted(p.name for p in (workdir / "hf").glob("*.safetensors"))
        print(f"HF output: {len(shards)} safetensors file(s) at --max-shard-size {args.max_shard_size}")
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
