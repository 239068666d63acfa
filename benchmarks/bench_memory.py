"""Peak CPU memory of one forward of a one-layer model of each layer type, against the sequence length.

Each measurement runs in its own subprocess (a fresh allocator, no memory kept from an earlier one): the process
builds the model and the input, runs a short warm-up forward, resets the kernel's peak-RSS counter
(/proc/self/clear_refs) and reads it back after one forward of T tokens under no_grad: the figure is that peak minus
the RSS before the forward, i.e. what the forward itself needed. Printed as a table with the growth factor per 4x T
(4x is linear, 16x quadratic).

The row "sliding_attention (4-D mask)" runs sliding-window attention through transformers' materialised
[batch, 1, T, T] mask (instead of mixer_attention.sliding_window_attention's blocks) for comparison. The
"left-padded" rows run two rows, the second left-padded by a quarter of T: full attention's mask is then described
and applied in blocks from DESCRIBED_MASK_QUERIES tokens on (modeling's `_described_mask`), or materialised with
"(4-D mask)".

    python benchmarks/bench_memory.py [--lengths 2048 8192 32768] [--window 128] [--attn sdpa] [--rows ROW ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

ROWS = ["full_attention", "full_attention, left-padded", "full_attention, left-padded (4-D mask)", "sliding_attention",
        "sliding_attention (4-D mask)", "gated_deltanet", "kimi_delta_attention"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_one(row: str, length: int, window: int, attn: str) -> float:
    """MiB the forward of `length` tokens adds to the peak RSS (run in a subprocess of its own)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hybrid_linear_models import HybridLinearConfig, HybridLinearModel

    torch.manual_seed(0)
    layer_type = row.split()[0].rstrip(",")
    config = HybridLinearConfig(
        layer_types=[layer_type], vocab_size=1024, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, gdn_num_key_heads=4, gdn_num_value_heads=8, gdn_key_head_dim=64,
        gdn_value_head_dim=64, kda_num_heads=8, kda_head_dim=64, sliding_window=window, attn_implementation=attn,
    )
    model = HybridLinearModel(config).eval()
    if row.endswith("(4-D mask)"):  # (the method replaced must exist: a renamed one would be patched in vain)
        assert callable(HybridLinearModel._described_mask)
        HybridLinearModel._described_mask = lambda *args, **kwargs: None  # transformers' mask for every layer
    rows = 2 if "left-padded" in row else 1
    input_ids = torch.randint(0, config.vocab_size, (rows, length))
    mask = torch.ones_like(input_ids)
    mask[1:, : length // 4] = 0  # (the second row, where there is one, left-padded)
    with torch.no_grad():
        model(input_ids[:, :64], attention_mask=mask[:, :64], use_cache=False)  # warm-up: kernels, thread pools
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
        before = _status_kib("VmRSS")
        model(input_ids, attention_mask=mask, use_cache=False)
        peak = _status_kib("VmHWM")
    return (peak - before) / 1024


def run_all(rows: list[str], lengths: list[int], window: int, attn: str) -> dict[str, list[float]]:
    table = {}
    for row in rows:
        table[row] = []
        for length in lengths:
            command = [sys.executable, __file__, "--one", row, str(length), "--window", str(window), "--attn", attn]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            table[row].append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"  {row:30s} T={length:6d}: {table[row][-1]:9.1f} MiB", file=sys.stderr, flush=True)
    return table


def print_table(table: dict[str, list[float]], lengths: list[int], window: int, attn: str) -> None:
    growth = [f"{b}/{a}" for a, b in itertools.pairwise(lengths)]
    header = ["layer (one, hidden 512, batch 1; padded: 2)"]
    header += [f"T={n}" for n in lengths] + [f"growth {g}" for g in growth]
    print(f"Peak memory of one forward (MiB over the RSS before it), window {window}, {attn}, CPU float32")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row, values in table.items():
        factors = [f"{b / a:.1f}x" if a > 0 else "-" for a, b in itertools.pairwise(values)]
        print("| " + " | ".join([row] + [f"{v:.0f}" for v in values] + factors) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS, metavar="ROW", help=f"default: all of {ROWS}")
    parser.add_argument("--one", nargs=2, metavar=("ROW", "T"), help=argparse.SUPPRESS)  # one measurement (subprocess)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.window, args.attn)))
        return
    print_table(run_all(args.rows, args.lengths, args.window, args.attn), args.lengths, args.window, args.attn)


if __name__ == "__main__":
    main()
