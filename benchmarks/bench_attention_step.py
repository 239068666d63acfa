"""The attention step's kernels (kernels_attention_step_triton: a decoding step's or a verify round's full-attention
layer against a static cache) at long caches: the package's settings against `MAX_SPLITS` splits, against the tile
loop without its software pipeline, and against other settings where asked, side by side in one run.

For each case (batch, tokens a row, cache slots; the GDN benchmark model's attention, 16 query and 2 KV heads of 256,
gated, bf16, every slot before the step's filled) it captures `attention_step` in a CUDA graph and times replays (the
median of `--repeats`) with each side's settings in turn (A B A B, the best of each): microseconds, the rate at which
the keys and values are read (TB/s), and how many times faster the package's settings are.

Without CUDA (or with `--tiny`, the CPU smoke configuration), the kernels' sides are skipped and the table holds what
a CPU runs instead: the torch path's step (a one-layer full-attention model of the given heads, float32, a static
cache filled to the case's slots; `--tiny`: 4 query / 2 KV heads of 16 and small caches), us per step.

    python benchmarks/bench_attention_step.py [--heads 16] [--kv-heads 2] [--head-dim 256] [--repeats 20]
        [--cases 1x1x131072 1x4x131072 16x1x16384 ...] [--variants slots_per_tile=64,stages=2 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
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


def variants(kernels, asked: list[str]) -> dict[str, dict]:
    """The sides timed against the package's kernels, each the module functions it replaces: `MAX_SPLITS` splits,
    the tile loop without its software pipeline, and each of `asked` ("FIELD=VALUE[,FIELD=VALUE]": fields of the
    `AttendSettings` the package chooses, e.g. "slots_per_tile=64,stages=2")."""
    fields = {field.name for field in dataclasses.fields(kernels.AttendSettings)}
    chosen = kernels.attend_settings

    def replaced(**changes):
        return {"attend_settings": lambda *args: dataclasses.replace(chosen(*args), **changes)}

    sides = {"package": {}, f"{kernels.MAX_SPLITS} splits": {"split_limit": lambda *args: kernels.MAX_SPLITS},
             "no pipeline": replaced(stages=0)}
    for variant in asked:
        changes = dict(item.split("=") for item in variant.split(","))
        if not set(changes) <= fields:
            raise SystemExit(f"bench_attention_step: {sorted(set(changes) - fields)} are not fields of AttendSettings "
                             f"({sorted(fields)})")
        sides[variant] = replaced(**{name: int(value) for name, value in changes.items()})
    return sides


TINY_CASES = ["1x1x64", "1x4x64", "2x1x256"]


def cpu_table(cases: list[str], heads: int, kv_heads: int, width: int, repeats: int) -> None:
    """Each case's step on the torch path (a CPU): a one-layer full-attention model's forward of `tokens` a row
    into a static cache of `slots`, filled before the step's last tokens; us per step (the median of `repeats`)."""
    import time

    from transformers import StaticCache

    from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM

    config = HybridLinearConfig(mixer_types=["full_attention"], hidden_size=heads * width, num_attention_heads=heads,
                                num_key_value_heads=kv_heads, head_dim=width, intermediate_size=4 * width,
                                vocab_size=256)
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(config).eval()
    print(f"{heads} query / {kv_heads} KV heads of {width}, float32, the CPU's torch path (the Triton kernels' sides "
          "need CUDA); us per step of a one-layer model")
    print(f"{'batch x tokens x slots':>24} | {'torch path, us':>14} | {'package kernels':>22}")
    for case in cases:
        batch, tokens, slots = (int(n) for n in case.split("x"))
        ids = torch.randint(1, 256, (batch, slots))
        times = []
        with torch.no_grad():
            for _ in range(repeats):
                cache = StaticCache(config=config, max_cache_len=slots)
                model(input_ids=ids[:, : slots - tokens], cache=cache, use_cache=True)
                start = time.perf_counter()
                model(input_ids=ids[:, slots - tokens:], cache=cache, use_cache=True)
                times.append((time.perf_counter() - start) * 1e6)
        print(f"{case:>24} | {sorted(times)[len(times) // 2]:>14.1f} | {'skipped (needs CUDA)':>22}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cases", nargs="+", default=CASES, help="BATCHxTOKENSxSLOTS")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="also these settings, each FIELD=VALUE[,FIELD=VALUE] of AttendSettings (e.g. stages=2)")
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke configuration (see above)")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    if args.tiny or not torch.cuda.is_available():
        heads = (4, 2, 16) if args.tiny else (args.heads, args.kv_heads, args.head_dim)
        # (the GPU's default cases reach 10**6 slots: a CPU takes the tiny ones unless others are asked)
        cpu_table(TINY_CASES if args.cases == CASES else args.cases, *heads, min(args.repeats, 5))
        return
    import triton

    from hybrid_linear_models import kernels_attention_step_triton as kernels

    sides = variants(kernels, args.variants)
    print(f"{args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, bf16; "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} multiprocessors; us (TB/s of keys and values "
          "read), and the package's speed-up over each other side")
    for number, side in enumerate(sides):
        print(f"  side {number}: {side}")
    print(f"{'batch x tokens x slots':>24} | " + " | ".join(f"{f'side {n}':>22}" for n in range(len(sides))))
    replay_us(step_call(1, 1, 1024, args.heads, args.kv_heads, args.head_dim), args.repeats)  # (clocks up)
    for case in args.cases:
        batch, tokens, slots = (int(n) for n in case.split("x"))
        run = step_call(batch, tokens, slots, args.heads, args.kv_heads, args.head_dim)
        read = 2 * batch * args.kv_heads * slots * args.head_dim * 2  # keys and values, bf16
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(2):  # A B A B: the best of each
            for side, patches in sides.items():
                kept = {name: getattr(kernels, name) for name in patches}
                try:
                    for name, value in patches.items():
                        setattr(kernels, name, value)
                    best[side] = min(best[side], replay_us(run, args.repeats))
                except triton.runtime.errors.OutOfResources:  # (a setting whose tiles exceed shared memory)
                    best[side] = float("nan")
                finally:
                    for name, value in kept.items():
                        setattr(kernels, name, value)
        ours = best["package"]
        cells = [f"{us:8.1f} ({read / us / 1e6:4.2f})" + (f" {us / ours:5.2f}x" if side != "package" else " " * 7)
                 for side, us in best.items()]
        print(f"{case:>24} | " + " | ".join(cells), flush=True)
        for key, stages in kernels._stages_that_fit.items():  # (settings whose tiles exceeded shared memory)
            if stages < key[5].stages:
                print(f"{'':>24}   {key[5]} ran with {stages} stages: more do not fit shared memory")
        kernels._stages_that_fit.clear()
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
