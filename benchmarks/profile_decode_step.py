"""Where one captured batch-1 decoding step spends its time on a GPU: the device kernels of replayed steps, grouped by
kernel name, against the step's wall time (issue 17: what to fuse next, and how far the launches are from the
weight-read limit).

For each model (the GDN and KDA benchmark models of bench_generation.py, the Kimi-Linear MoE model of
bench_kimi_linear.py; random weights, bfloat16): a `--prompt`-token prefill into a static cache, one step to capture
the graph, then `--steps` replayed steps under torch.profiler. Printed per model:
- wall ms per step (CUDA events around the replays) and the sum of kernel durations per step; their difference is
  the time the GPU idles between kernels (launch gaps: what fewer, fuller kernels win back);
- kernels per step;
- the `--top` kernels by device time per step, with their count per step and share of the kernel time.

    python benchmarks/profile_decode_step.py [--models gdn kda kimi] [--prompt 512] [--steps 20] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_configs import GPU_GDN, GPU_KDA, gdn_pair, kda_pair, kimi_linear_config  # noqa: E402

from hybrid_linear_models import HybridLinearForCausalLM  # noqa: E402


CONFIGS = {"gdn": lambda: gdn_pair(**GPU_GDN)[0], "kda": lambda: kda_pair(**GPU_KDA)[0], "kimi": kimi_linear_config}


def profile_model(name: str, prompt: int, steps: int, top: int) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = HybridLinearForCausalLM(CONFIGS[name]()).to(torch.bfloat16).eval()
    input_ids = torch.randint(1, model.config.vocab_size, (1, prompt), device="cuda")
    # every step below writes one slot: the capture, 3 warm-ups, `steps` timed and `steps` profiled
    cache = StaticCache(config=model.config, max_cache_len=prompt + 4 + 2 * steps)
    token = input_ids[:, -1:]
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
        model(input_ids=token, cache=cache, use_cache=True)  # captured here
        assert model._graph_decoder._graph is not None, "the step was not captured"
        for _ in range(3):
            model(input_ids=token, cache=cache, use_cache=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            model(input_ids=token, cache=cache, use_cache=True)
        end.record()
        torch.cuda.synchronize()
        wall_ms = start.elapsed_time(end) / steps
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                model(input_ids=token, cache=cache, use_cache=True)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for event in kernels:
        by_name[event.name].append(event.device_time_total / 1e3)  # microseconds -> ms
    total = sum(sum(times) for times in by_name.values()) / steps
    params = sum(p.numel() for p in model.parameters())
    print(f"\n{name}: {params / 1e6:.0f}M params, prompt {prompt}, batch 1: wall {wall_ms:.3f} ms/step "
          f"({1e3 / wall_ms:.0f} tok/s), kernels {total:.3f} ms/step, idle between kernels {wall_ms - total:.3f} ms, "
          f"{len(kernels) / steps:.0f} kernels/step")
    print(f"{'ms/step':>8} {'share':>6} {'n/step':>6}  kernel")
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    for kernel, times in ranked[:top]:
        share = sum(times) / steps / total
        print(f"{sum(times) / steps:>8.4f} {share:>6.1%} {len(times) / steps:>6.1f}  {kernel[:110]}")
    del model, cache
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode_step.py profiles CUDA-graph decoding: it needs a CUDA GPU")
    for name in args.models:
        try:
            profile_model(name, args.prompt, args.steps, args.top)
        except Exception as error:  # one model's failure must not cost the others' figures in a GPU call
            print(f"\n{name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
