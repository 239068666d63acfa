"""The attention step's kernels (kernels_attention_step_triton: a decoding step's or a verify round's full-attention
layer against a static cache) at long caches: the split limit the package takes against `MAX_SPLITS` splits, side by
side in one run.

For each case (batch, tokens a row, cache slots; the GDN benchmark model's attention, 16 query and 2 KV heads of 256,
gated, bf16, every slot before the step's filled) it captures `attention_step` in a CUDA graph and times replays (the
median of `--repeats`), once with `split_limit` (more splits where the rows leave multiprocessors idle) and once with
it fixed to `MAX_SPLITS`, in turn (A B A B, the best of each): microseconds, the rate at which the keys and values are
read (TB/s), and the ratio. Without CUDA it says so and exits.

    python benchmarks/bench_attention_step.py [--heads 16] [--kv-heads 2] [--head-dim 256] [--repeats 20]
        [--cases 1x1x131072 1x4x131072 16x1x16384 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ["1x1x1152", "1x1x32768", "1x1x131072", "1x1x262144", "1x1x1048576", "1x4x131072", "16x1x16384"]


def replay_us(run, repeats: int) -> float:
    """Median microseconds of a CUDA-graph replay of run() (captured after two warm-up calls on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def step_call(batch: int, tokens: int, slots: int, heads: int, kv_heads: int, width: int):
    """attention_step of `tokens` a row at the cache's last slots, its inputs made here."""
    from hybrid_linear_models.kernels_attention_step_triton import attention_step

    def made(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    qkv = made(batch, tokens, heads * width * 2 + 2 * kv_heads * width)
    keys, values = made(batch, kv_heads, slots, width), made(batch, kv_heads, slots, width)
    first = torch.full((1,), slots - tokens, device="cuda", dtype=torch.long)
    scale = torch.ones(width, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.ones_like(scale).view(1, 1, width), torch.zeros_like(scale).view(1, 1, width)
    mask = torch.zeros(1, tokens, slots, device="cuda", dtype=torch.bfloat16)
    return lambda: attention_step(qkv, keys, values, first, scale, scale, (1e-6, 1e-6), cos, sin, width // 4, mask,
                                  width ** -0.5, heads, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cases", nargs="+", default=CASES, help="BATCHxTOKENSxSLOTS")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    if not torch.cuda.is_available():
        print("bench_attention_step.py: skipped, it times the attention step's Triton kernels and needs a CUDA device")
        return
    from hybrid_linear_models import kernels_attention_step_triton as kernels

    package_limit = kernels.split_limit
    sides = {"split_limit": package_limit, f"{kernels.MAX_SPLITS} splits": lambda device, programs: kernels.MAX_SPLITS}
    print(f"{args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, bf16; "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} multiprocessors")
    print(f"{'batch x tokens x slots':>24} | {'split_limit us':>14} {'TB/s':>5} | "
          f"{f'{kernels.MAX_SPLITS} splits us':>12} {'TB/s':>5} | faster")
    replay_us(step_call(1, 1, 1024, args.heads, args.kv_heads, args.head_dim), args.repeats)  # (clocks up)
    for case in args.cases:
        batch, tokens, slots = (int(n) for n in case.split("x"))
        run = step_call(batch, tokens, slots, args.heads, args.kv_heads, args.head_dim)
        read = 2 * batch * args.kv_heads * slots * args.head_dim * 2  # keys and values, bf16
        best = dict.fromkeys(sides, float("inf"))
        try:
            for _ in range(2):
                for side, limit in sides.items():
                    kernels.split_limit = limit
                    best[side] = min(best[side], replay_us(run, args.repeats))
        finally:
            kernels.split_limit = package_limit
        ours, fixed = best.values()
        print(f"{case:>24} | {ours:14.1f} {read / ours / 1e6:5.2f} | {fixed:12.1f} {read / fixed / 1e6:5.2f} | "
              f"{fixed / ours:.2f}x", flush=True)
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
