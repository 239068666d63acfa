"""Where one captured decoding step (batch 1, or `--batch` rows) spends its time on a GPU: the device kernels of
replayed steps, grouped by kernel name, against the step's wall time (what to fuse next, and how far the
launches are from the weight-read limit).

For each model (the GDN and KDA benchmark models of bench_generation.py, the Kimi-Linear MoE model of
bench_kimi_linear.py; random weights, bfloat16; and the released flagships at their real widths with the first
`--flagship-layers` of their layers, the pattern's full period by default, so a step's per-layer kernels are the full
model's: `qwen3-next-fp8`, Qwen3-Next-80B-A3B in its released FP8 layout, and `kimi-48b`, Kimi-Linear-48B-A3B in
bfloat16, from flagship_models.py): a `--prompt`-token prefill into a static cache, one step to capture
the graph, then `--steps` replayed steps under torch.profiler. Printed per model:
- wall ms per step (CUDA events around the replays) and the sum of kernel durations per step; their difference is
  the time the GPU idles between kernels (launch gaps: what fewer, fuller kernels win back). With programmatic
  dependent launch (kernels_launch_triton) a kernel starts before the one ahead has finished and its duration includes
  its wait for it, so kernels overlap: the sum then exceeds the wall time (a negative idle), and a kernel's own
  duration is its share of the step only up to that overlap;
- kernels per step;
- the `--top` kernels by device time per step, with their count per step and share of the kernel time;
- with `--trace DIR`, one replayed step's kernels in launch order with their durations (DIR/decode_<model>.txt);
- with `--verify K ...`, the same accounting for a replayed speculative verify round of K tokens per row
  (speculative_decoding.CapturedVerifyRound: the forward, the greedy acceptance and the restore of every GDN/KDA state;
  random drafts) on the same model, beside the step's: what makes a round cost more than the step (its trace in
  DIR/verify<K>_<model>.txt);
- with `--prefill N ...`, the same accounting for uncaptured batch-1 prefills of N tokens (wall against kernel time:
  how much of a prefill is host launch overhead rather than GPU work);
- with `--ab KIND ...`, instead, each model's replayed step captured without and with one of this package's decoding
  kernels in turn (A B A B), wall ms per step of each, in one run: `gemv` (the linear layers on cuBLAS, or on the
  Triton GEMV: kernels_gemv), `attention` (the full-attention layers on the torch path, or the fused attention step:
  attention_step), `in_place` (the GDN/KDA state copied after fla's recurrent kernel, or updated in place by it:
  recurrent_in_place), `norm` (the block RMSNorms on fla's kernel, or on this package's: inference_norm), `pdl`
  (this package's decoding kernels launched plainly, or with programmatic dependent launch: kernels_launch_triton),
  `conv` (GDN/KDA's short convolution on fla's kernel after the input projection's GEMV, or in that GEMV's epilogue:
  kernels_gemv.linear_conv_step), `gated_norm` (the GDN/KDA output norm on fla's kernel, or on this package's,
  launched dependently: inference_norm), `routed` (the FP8 experts' routes sorted by expert for the grouped kernel,
  or each route's product in the routed kernel: kernels_fp8.ROUTED_MAX_ROUTES; the qwen3-next-fp8 model), `moe` (the
  sparse MoE's softmax top-k and gated shared sum in torch's ops, or one kernel each: moe_inference_ops),
  `swiglu_input` (the FP8 routed experts' SwiGLU and routing weight as torch ops, or computed as the down projection
  reads its input: kernels_fp8.SWIGLU_INPUT_DEVICE_TYPES), `fp8_flat` (an FP8 GDN layer's input projections
  gathered after the product, or read through a row index: mixer_gated_deltanet.FLAT_FP8_PROJECTION_DEVICE_TYPES),
  `routed_bf16` (bf16 experts sorted and grouped, or each route's GEMV: experts_routed.ROUTED_MAX_ROUTES);
- with `--mtp K ...` (the GDN and KDA models), instead, batch-1 `generate(use_mtp=K)` of `--generate` new tokens (64
  without it) on the model with one MTP layer (random weights: a round keeps about one token, and drafts all K):
  per round (one replayed graph: the verify forward of K + 1 tokens, the acceptance, the GDN/KDA restore, the head's
  entries and its K recursive drafts), its kernel time, kernels, the GPU's idle time and the `--top` kernels, against
  the one-token step's wall time; with `--trace DIR`, one round's kernels in launch order (DIR/mtp<K>_<model>.txt);
- with `--generate N`, instead, batch-1 generate of N new tokens against the step alone, with generate's stop check
  synchronous (a cache of one's own: transformers' loop reads each step's tokens on the host, and the GPU waits for
  the host's work before the next replay) and deferred (`cache_implementation="static"`: deferred_stop_check): ms
  per token of each, and from a profile of one generate call, per token in its decoding phase: the GPU's kernel time,
  its kernels (the graph's and those outside it), and the time the GPU idles.

On a CPU (`--tiny`, the CPU smoke configuration; also what runs without CUDA), the tiny GDN and KDA models' eager
decoding step (a CPU runs no graphs and none of this package's Triton kernels) in float32, its torch ops ranked by
their own CPU time per step: which ops a step runs on the CPU path and how often.

    python benchmarks/profile_decode_step.py [--models gdn kda kimi qwen3-next-fp8 kimi-48b] [--prompt 512]
        [--steps 20] [--top 25] [--trace DIR] [--prefill 1024 8192] [--generate 64] [--batch 16]
        [--ab gemv attention in_place norm pdl conv gated_norm routed moe swiglu_input fp8_flat
         routed_bf16] [--flagship-layers 4]
        [--verify 2 4]
        [--mtp 1 3]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flagship_models import build_ours, kimi_linear_fields, qwen3_next_fields  # noqa: E402
from model_configs import (  # noqa: E402
    GPU_GDN,
    GPU_KDA,
    TINY_GDN,
    TINY_KDA,
    gdn_pair,
    kda_pair,
    kimi_linear_config,
)

from hybrid_linear_models import HybridLinearForCausalLM  # noqa: E402


CONFIGS = {"gdn": lambda: gdn_pair(**GPU_GDN)[0], "kda": lambda: kda_pair(**GPU_KDA)[0], "kimi": kimi_linear_config}
# the flagships' fields with their first `layers` layers (flagship_models draws them on the device, layer by layer)
FLAGSHIPS = {"qwen3-next-fp8": lambda layers: qwen3_next_fields(layers=layers, fp8=True),
             "kimi-48b": lambda layers: kimi_linear_fields(layers=layers)}
FLAGSHIP_LAYERS = 4  # one period of each pattern (3 linear-attention layers, then one attention layer)


def model_and_prompt(name: str, prompt: int, batch: int = 1, layers: int = FLAGSHIP_LAYERS, mtp: bool = False
                     ) -> tuple[HybridLinearForCausalLM, torch.Tensor]:
    """The benchmark model `name` (random weights, seed 0, bfloat16, on CUDA; a flagship's first `layers` layers;
    with `mtp`, one dense MTP layer) and `batch` random prompts."""
    torch.manual_seed(0)
    if name in FLAGSHIPS:
        model = build_ours(FLAGSHIPS[name](layers), torch.device("cuda"))
    else:
        config = CONFIGS[name]()
        if mtp:
            config.num_mtp_layers, config.mtp_mlp_type = 1, "dense"
        with torch.device("cuda"):
            model = HybridLinearForCausalLM(config).to(torch.bfloat16).eval()
    return model, torch.randint(1, model.config.vocab_size, (batch, prompt), device="cuda")


def kernel_events(prof) -> list:
    from torch.autograd import DeviceType

    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def print_ranked(kernels: list, repeats: int, top: int) -> float:
    """The `top` kernels by device time per repeat; returns the kernel ms per repeat."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for event in kernels:
        by_name[event.name].append(event.device_time_total / 1e3)  # microseconds -> ms
    total = sum(sum(times) for times in by_name.values()) / repeats
    print(f"{'ms/step':>8} {'share':>6} {'n/step':>6}  kernel")
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    for kernel, times in ranked[:top]:
        share = sum(times) / repeats / total
        print(f"{sum(times) / repeats:>8.4f} {share:>6.1%} {len(times) / repeats:>6.1f}  {kernel[:110]}")
    return total


def profile_prefill(model, name: str, length: int, top: int) -> None:
    """Uncaptured batch-1 prefill of `length` tokens into a fresh static cache: wall against kernel time."""
    from torch.profiler import ProfilerActivity, profile

    input_ids = torch.randint(1, model.config.vocab_size, (1, length), device="cuda")

    def prefill():
        cache = StaticCache(config=model.config, max_cache_len=length + 1)
        model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)

    with torch.no_grad():
        for _ in range(2):
            prefill()
        wall_ms = timed_ms(prefill, 3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                prefill()
            torch.cuda.synchronize()
    kernels = kernel_events(prof)
    print(f"\n{name} prefill {length} tokens, batch 1: wall {wall_ms:.2f} ms ({length / wall_ms * 1e3:.0f} tok/s), "
          f"{len(kernels) / 3:.0f} kernels")
    total = print_ranked(kernels, 3, top)
    print(f"kernels {total:.2f} ms, idle {wall_ms - total:.2f} ms")
    # where the host's time goes (a prefill whose GPU idles is bound by it): ops by their own CPU time
    with torch.no_grad():
        start = time.perf_counter()
        cache = StaticCache(config=model.config, max_cache_len=length + 1)
        made = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as host:
            model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
    print(f"host: StaticCache made in {made * 1e3:.2f} ms; ops by own CPU time in one prefill:")
    print(host.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70))
    import cProfile
    import pstats

    python = cProfile.Profile()
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=length + 1)
        python.enable()
        model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        python.disable()
    print("host: Python functions by own time in one prefill (cProfile):")
    pstats.Stats(python).sort_stats("tottime").print_stats(top)


def timed_ms(run, repeats: int) -> float:
    """Wall ms per call of run() over `repeats` calls, without gradients (CUDA events around them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def step_ms(model, cache, token, steps: int) -> float:
    """Wall ms per decoding step over `steps` steps (the steps replay a graph captured earlier)."""
    return timed_ms(lambda: model(input_ids=token, cache=cache, use_cache=True), steps)


def replayed_ms(model, cache, token, steps: int) -> float:
    """Wall ms per replayed step (captured anew first: a fresh decoder)."""
    model.set_cuda_graph_decoding(True)
    with torch.no_grad():
        for _ in range(3):  # capture, then warm
            model(input_ids=token, cache=cache, use_cache=True)
    return step_ms(model, cache, token, steps)


# what `--ab` switches: the module, its setting (a device-types tuple, emptied to turn the kernel off, or set to
# OFF_VALUES), the two sides' names
SWITCHES = {
    "gemv": ("kernels_gemv", "GEMV_DEVICE_TYPES", "cuBLAS", "Triton GEMV"),
    "attention": ("attention_step", "STEP_DEVICE_TYPES", "torch attention", "fused attention step"),
    "in_place": ("recurrent_in_place", "IN_PLACE_DEVICE_TYPES", "state copied", "state in place"),
    "norm": ("inference_norm", "NORM_DEVICE_TYPES", "fla's RMSNorm", "RMSNorm kernel"),
    "pdl": ("kernels_launch_triton", "PDL_DEVICE_TYPES", "plain launches", "dependent launches"),
    "conv": ("kernels_gemv", "CONV_STEP_DEVICE_TYPES", "convolution's kernel", "convolution in the GEMV"),
    "gated_norm": ("inference_norm", "GATED_NORM_DEVICE_TYPES", "fla's gated RMSNorm", "gated RMSNorm kernel"),
    "routed": ("kernels_fp8", "ROUTED_MAX_ROUTES", "experts sorted and grouped", "experts routed"),
    "moe": ("moe_inference_ops", "MOE_DEVICE_TYPES", "torch's routing and shared sum", "MoE kernels"),
    "swiglu_input": ("kernels_fp8", "SWIGLU_INPUT_DEVICE_TYPES", "experts' SwiGLU apart", "SwiGLU in the down read"),
    "fp8_flat": ("mixer_gated_deltanet", "FLAT_FP8_PROJECTION_DEVICE_TYPES", "GDN FP8 projections gathered",
                 "GDN FP8 projections indexed"),
    "routed_bf16": ("experts_routed", "ROUTED_MAX_ROUTES", "bf16 experts grouped", "bf16 experts routed"),
}
OFF_VALUES = {"routed": 0, "routed_bf16": 0}  # (the other switches' off value: no device type)


def compare(name: str, prompt: int, steps: int, kind: str, layers: int = FLAGSHIP_LAYERS) -> None:
    """The same model and cache, its step captured without and with the kernels `kind` switches (SWITCHES), in turn
    (A B A B): wall ms per replayed step of each."""
    import importlib

    module_name, attribute, off_name, on_name = SWITCHES[kind]
    module = importlib.import_module(f"hybrid_linear_models.{module_name}")
    model, input_ids = model_and_prompt(name, prompt, layers=layers)
    cache = StaticCache(config=model.config, max_cache_len=prompt + 4 * (3 + steps) + 1)
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
    devices, times = getattr(module, attribute), {off_name: [], on_name: []}
    try:
        for _ in range(2):
            for side, types in ((off_name, OFF_VALUES.get(kind, ())), (on_name, devices)):
                setattr(module, attribute, types)
                times[side].append(replayed_ms(model, cache, input_ids[:, -1:], steps))
    finally:
        setattr(module, attribute, devices)
    off, on = min(times[off_name]), min(times[on_name])
    print(f"\n{name}: replayed step, {off_name} {off:.3f} ms, {on_name} where it is taken {on:.3f} ms: "
          f"{off / on:.3f}x (each the best of 2)")
    del model, cache
    torch.cuda.empty_cache()


class LoopTurns(NamedTuple):
    """The turns of a loop that launches one CUDA graph a turn, from a profile: the device kernels of the whole turns,
    their count, and per turn the wall and kernel ms."""

    kernels: list
    count: int
    wall_ms: float
    busy_ms: float


def loop_turns(prof, first: int) -> tuple[int, LoopTurns | None]:
    """A profile's CUDA-graph launches (host events) counted, and the turns from launch `first` to the last launch
    (None where there are too few for one)."""
    from torch.autograd import DeviceType

    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    launches = [e for e in events if e.device_type == DeviceType.CPU and "GraphLaunch" in e.name]
    if len(launches) < first + 2:
        return len(launches), None
    start, end = launches[first].time_range.start, launches[-1].time_range.start
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and start <= e.time_range.start < end]
    count = len(launches) - 1 - first
    return len(launches), LoopTurns(kernels, count, (end - start) / 1e3 / count,
                                    sum(e.device_time_total for e in kernels) / 1e3 / count)


def profile_generate(name: str, prompt: int, tokens: int, steps: int, layers: int = FLAGSHIP_LAYERS) -> None:
    """Batch-1 generate against its step alone, with the stop check synchronous (a static cache of one's own, which
    generate hands back: GDN/KDA states cannot undo the extra step a deferred check runs) and deferred
    (`cache_implementation="static"`: deferred_stop_check); see the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    model, input_ids = model_and_prompt(name, prompt, layers=layers)
    length = prompt + max(tokens, steps + 8) + 1
    cache = StaticCache(config=model.config, max_cache_len=length)
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
        model(input_ids=input_ids[:, -1:], cache=cache, use_cache=True)  # captured here
        alone = step_ms(model, cache, input_ids[:, -1:], steps)

    for mode, caches in (("synchronous stop check", dict(cache=cache)),
                         ("deferred stop check", dict(cache_implementation="static"))):
        def run(new: int):
            if "cache" in caches:  # (generate's own caches start empty)
                cache.reset()
            model.generate(input_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                           **caches)

        with torch.no_grad():
            run(tokens)  # captured here (each cache length is a capture of its own), then warm
            first = min(timed_ms(lambda: run(1), 1) for _ in range(3))
            whole = min(timed_ms(lambda: run(tokens), 1) for _ in range(3))
            per_token = (whole - first) / (tokens - 1)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(tokens)
                torch.cuda.synchronize()
        launches, turns = loop_turns(prof, 0)
        if turns is None:
            print(f"\n{name}: generate ran {launches} graph launches: not a captured decoding loop")
            return
        print(f"\n{name}, {mode}: generate, batch 1, prompt {prompt}, {tokens} new tokens: {per_token:.3f} ms per "
              f"token ({1e3 / per_token:.0f} tok/s) against the step alone {alone:.3f} ms ({1e3 / alone:.0f} tok/s); "
              f"per token in generate's loop (profiled): GPU kernels {turns.busy_ms:.3f} ms, "
              f"{len(turns.kernels) / turns.count:.0f} kernels, GPU idle {turns.wall_ms - turns.busy_ms:.3f} ms")


def profile_mtp_rounds(name: str, prompt: int, drafts: int, tokens: int, steps: int, top: int,
                       trace: Path | None) -> None:
    """Batch-1 `generate(use_mtp=drafts)` profiled round by round (the module docstring's `--mtp`)."""
    from torch.profiler import ProfilerActivity, profile

    model, input_ids = model_and_prompt(name, prompt, mtp=True)
    cache = StaticCache(config=model.config, max_cache_len=prompt + steps + 8)
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
        model(input_ids=input_ids[:, -1:], cache=cache, use_cache=True)  # captured here
        step = step_ms(model, cache, input_ids[:, -1:], steps)
    del cache

    def run():
        model.generate(input_ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                       use_mtp=drafts)

    with torch.no_grad():
        run()  # the round's capture, then warm
        whole = min(timed_ms(run, 1) for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    launches, rounds = loop_turns(prof, 1)  # (the first round aside: the prompt's kernels come before it)
    if rounds is None:
        print(f"\n{name}: generate(use_mtp={drafts}) ran {launches} graph launches: not a captured round loop")
        return
    print(f"\n{name}: generate(use_mtp={drafts}), batch 1, prompt {prompt}, {tokens} new tokens in {whole:.1f} ms; "
          f"per round (profiled, {rounds.count} rounds): wall {rounds.wall_ms:.3f} ms ({rounds.wall_ms / step:.2f} "
          f"one-token steps of {step:.3f} ms), GPU kernels {rounds.busy_ms:.3f} ms, "
          f"{len(rounds.kernels) / rounds.count:.0f} kernels, GPU idle {rounds.wall_ms - rounds.busy_ms:.3f} ms")
    print_ranked(rounds.kernels, rounds.count, top)
    if trace is not None:  # the last whole round, kernel by kernel in launch order
        last = rounds.kernels[-(len(rounds.kernels) // rounds.count):]
        trace.mkdir(parents=True, exist_ok=True)
        with open(trace / f"mtp{drafts}_{name}.txt", "w") as file:
            file.writelines(f"{event.device_time_total:8.2f} us  {event.name[:160]}\n" for event in last)


def profiled_replays(label: str, replay, steps: int, top: int, trace: Path | None, trace_name: str) -> float:
    """Wall ms per `replay()` over `steps` calls, then a profile of as many: kernel time, idle time, kernels per
    call, the `top` kernels, and with `trace` the last call's kernels in launch order (trace/trace_name). Returns
    the wall ms."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            replay()
        wall_ms = timed_ms(replay, steps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                replay()
            torch.cuda.synchronize()
    kernels = kernel_events(prof)
    total = sum(e.device_time_total for e in kernels) / 1e3 / steps
    print(f"\n{label}: wall {wall_ms:.3f} ms ({1e3 / wall_ms:.0f} per s), kernels {total:.3f} ms, idle between "
          f"kernels {wall_ms - total:.3f} ms, {len(kernels) / steps:.0f} kernels")
    print_ranked(kernels, steps, top)
    if trace is not None:  # the last call, kernel by kernel in launch order
        per_call = len(kernels) // steps
        trace.mkdir(parents=True, exist_ok=True)
        with open(trace / trace_name, "w") as file:
            for event in kernels[-per_call:]:
                file.write(f"{event.device_time_total:8.2f} us  {event.name[:160]}\n")
    return wall_ms


def profile_verify(model, name: str, input_ids: torch.Tensor, width: int, steps: int, top: int,
                   trace: Path | None, step_wall_ms: float) -> None:
    """Replayed verify rounds of `width` tokens per row (random drafts: a row keeps about one token a round) on a
    VerifyCache after the prompt, profiled as the step is."""
    from hybrid_linear_models.speculative_decoding import CapturedVerifyRound, prefill
    from hybrid_linear_models.verify_cache import VerifyCache

    batch, prompt = input_ids.shape
    cache = VerifyCache(model, batch, prompt + width * (2 * steps + 8) + 8, input_ids.device)
    with torch.no_grad():
        first = prefill(model, cache, input_ids, None)
        drafts = torch.randint(1, model.config.vocab_size, (batch, width - 1), device=input_ids.device)
        ids = torch.cat([first[:, None], drafts], dim=1)
        live = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        round_ = CapturedVerifyRound(model, cache, width)
        wall = profiled_replays(f"{name}: verify round of {width} tokens, batch {batch}", lambda: round_(ids, live),
                                steps, top, trace, f"verify{width}_{name}.txt")
    print(f"verify({width}) / step = {wall / step_wall_ms:.2f}")


def profile_model(name: str, prompt: int, steps: int, top: int, trace: Path | None = None,
                  prefills: tuple[int, ...] = (), batch: int = 1, layers: int = FLAGSHIP_LAYERS,
                  verify: tuple[int, ...] = ()) -> None:
    model, input_ids = model_and_prompt(name, prompt, batch, layers)
    # every step below writes one slot: the capture, 3 warm-ups, `steps` timed and `steps` profiled
    cache = StaticCache(config=model.config, max_cache_len=prompt + 4 + 2 * steps)
    token = input_ids[:, -1:]
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
        model(input_ids=token, cache=cache, use_cache=True)  # captured here
        assert model._graph_decoder.last_graph is not None, "the step was not captured"
    params = sum(p.numel() for p in model.parameters())
    wall_ms = profiled_replays(f"{name}: {params / 1e6:.0f}M params, prompt {prompt}, batch {batch}, decoding step",
                               lambda: model(input_ids=token, cache=cache, use_cache=True), steps, top, trace,
                               f"decode_{name}.txt")
    cache = None  # (freed before the rounds' and the prefills' caches are made)
    for width in verify:
        profile_verify(model, name, input_ids, width, steps, top, trace, wall_ms)
    for length in prefills:
        profile_prefill(model, name, length, top)


TINY = {"gdn": lambda: gdn_pair(**TINY_GDN)[0], "kda": lambda: kda_pair(**TINY_KDA)[0]}


def profile_cpu_step(name: str, prompt: int, steps: int, top: int) -> None:
    """The tiny model `name`'s eager decoding step on the CPU (float32, a static cache after a `prompt`-token
    prefill): wall ms per step, and its torch ops by own CPU time per step (aten ops: the kernels a CPU runs)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = HybridLinearForCausalLM(TINY[name]()).eval()
    input_ids = torch.randint(1, model.config.vocab_size, (1, prompt))
    cache = StaticCache(config=model.config, max_cache_len=prompt + 4 + 2 * steps)
    token = input_ids[:, -1:]
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
        for _ in range(3):
            model(input_ids=token, cache=cache, use_cache=True)
        start = time.perf_counter()
        for _ in range(steps):
            model(input_ids=token, cache=cache, use_cache=True)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                model(input_ids=token, cache=cache, use_cache=True)
    ops: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.name.startswith("aten::"):
            ops[event.name].append(event.self_cpu_time_total / 1e3)  # microseconds -> ms
    total = sum(sum(times) for times in ops.values()) / steps
    params = sum(p.numel() for p in model.parameters())
    print(f"\n{name} (tiny, CPU): {params / 1e3:.0f}K params, prompt {prompt}, eager decoding step: wall "
          f"{wall_ms:.3f} ms, aten ops' own time {total:.3f} ms, "
          f"{sum(len(times) for times in ops.values()) / steps:.0f} aten ops")
    print(f"{'ms/step':>8} {'share':>6} {'n/step':>6}  op")
    for op, times in sorted(ops.items(), key=lambda item: -sum(item[1]))[:top]:
        print(f"{sum(times) / steps:>8.4f} {sum(times) / steps / total:>6.1%} {len(times) / steps:>6.1f}  {op}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(CONFIGS), choices=[*CONFIGS, *FLAGSHIPS])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--batch", type=int, default=1, help="rows of the profiled step (not --ab, --generate)")
    parser.add_argument("--flagship-layers", type=int, default=FLAGSHIP_LAYERS,
                        help="the first layers of a flagship (qwen3-next-fp8, kimi-48b) to build")
    parser.add_argument("--trace", type=Path, default=None, help="folder for each model's kernels of one step")
    parser.add_argument("--prefill", type=int, nargs="*", default=[], help="also profile prefills of these lengths")
    parser.add_argument("--verify", type=int, nargs="*", default=[], metavar="K",
                        help="also profile replayed verify rounds of K tokens per row")
    parser.add_argument("--ab", nargs="*", default=[], choices=sorted(SWITCHES),
                        help="instead: each model's replayed step without and with these kernels, in turn")
    parser.add_argument("--mtp", type=int, nargs="*", default=[], metavar="K",
                        help="instead: generate(use_mtp=K) rounds of the model with an MTP layer, profiled")
    parser.add_argument("--tiny", action="store_true",
                        help="the CPU smoke configuration: the tiny models' eager step on the CPU (see above)")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="instead: generate N new tokens at batch 1 against the step alone, and where it waits")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    if args.tiny or not torch.cuda.is_available():
        if not args.tiny:
            print("profile_decode_step.py: no CUDA device: the tiny models' eager step on the CPU (--tiny) instead")
        for name in [name for name in args.models if name in TINY] or list(TINY):
            profile_cpu_step(name, min(args.prompt, 32) if args.tiny else args.prompt, args.steps, args.top)
        return
    for name in args.models:
        try:
            if args.ab:
                for kind in args.ab:
                    compare(name, args.prompt, args.steps, kind, args.flagship_layers)
                continue
            if args.mtp:
                for drafts in args.mtp:
                    profile_mtp_rounds(name, args.prompt, drafts, args.generate or 64, args.steps, args.top,
                                       args.trace)
                    torch.cuda.empty_cache()
                continue
            if args.generate:
                profile_generate(name, args.prompt, args.generate, args.steps, args.flagship_layers)
                torch.cuda.empty_cache()
                continue
            profile_model(name, args.prompt, args.steps, args.top, args.trace, tuple(args.prefill), args.batch,
                          args.flagship_layers, tuple(args.verify))
            torch.cuda.empty_cache()  # (the model is freed on the return)
        except Exception as error:  # one model's failure must not cost the others' figures in a GPU call
            print(f"\n{name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
