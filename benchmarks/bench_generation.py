"""Decoding speed, ours vs transformers, side by side in one run (greedy, fixed number of new tokens).

CPU (default without CUDA): float32, 2 threads, ~35M model (hidden 512, 6 GDN + 2 gated attention, vocab 8192),
batch 1, prompt 256, 64 new tokens, against transformers' Qwen3NextForCausalLM with the same config and weights.

GPU (--device cuda): bfloat16, ~1.2B GDN model (hidden 2048, 12 GDN + 4 gated attention, vocab 32000) against
Qwen3NextForCausalLM with the same weights, and a ~1B KDA model against KimiLinearForCausalLM; prompt 1024, 128 new
tokens, batch 1 and 16; ours with `cache_implementation="static"` (a captured CUDA graph per step, generate's stop
check one step behind: deferred_stop_check), transformers with its default cache.
Prints tokens/s of the decoding phase, prefill tokens/s and the ratios; beside ours, the share of the weight-read
limit (a step reads every weight once, and the caches: bytes per step / `--bandwidth-gbs`, 4800 GB/s for an H200,
gives the fastest a batch can decode) and the kernels of one decoding step (on CUDA: counted by torch.profiler over
one replayed step, graph replays included) and the tokens/s of the step alone (back-to-back replays, outside
`generate`: what separates it from the decoding figure is host work in generate's loop). Then prefill alone at
batch 1 for each of `--prefill-lengths` (default 1024 and 8192 on a GPU): ours into a static cache (its captured
prefill), ours with the graphs off, and transformers, with each one's peak memory.

--tiny: tiny models through every step of the GPU run (both pairs, ours with a static cache; prompt 32, 8 new
tokens, batch 1 and 2, float32 on the CPU): a smoke test of this script.

    python benchmarks/bench_generation.py [--device cuda] [--tiny] [--bandwidth-gbs 4800] [--prefill-lengths 1024 8192]
                                          [--batches 1 16] [--prefill-only] [--skip-gdn] [--skip-kda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import KimiLinearForCausalLM, Qwen3NextForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).parent))
from model_configs import CPU_DECODE, GPU_GDN, GPU_KDA, TINY_GDN, TINY_KDA, count_parameters, gdn_pair, kda_pair  # noqa: E402
from timing import timed  # noqa: E402

from hybrid_linear_models import HybridLinearForCausalLM  # noqa: E402


def timed_generate(model, input_ids, new_tokens, **kwargs) -> float:
    """Seconds for one greedy `generate`."""
    with torch.no_grad():
        out, seconds = timed(lambda: model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                    do_sample=False, pad_token_id=0, **kwargs), input_ids.device)
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return seconds


def measure(model, input_ids, new_tokens, repeats, **kwargs) -> dict:
    """Decoding tokens/s from (time of prompt + N tokens) - (time of prompt + 1 token); prefill tokens/s from the
    latter. The warm-up generates all N tokens, then 1: autotuning, and for ours with `cache_implementation="static"`
    the captures (the decoding step's, and the prompt's length bucket's: cuda_graph_prefill), which then serve every
    later call (transformers keeps the longest static cache length asked for, and each call's new cache is bound to
    the captured storage: cuda_graph_decoding)."""
    timed_generate(model, input_ids, new_tokens, **kwargs)
    timed_generate(model, input_ids, 1, **kwargs)  # ours captures the prompt's bucket on its second prefill
    prefill = min(timed_generate(model, input_ids, 1, **kwargs) for _ in range(repeats))
    total = min(timed_generate(model, input_ids, new_tokens, **kwargs) for _ in range(repeats))
    batch = input_ids.shape[0]
    return {"decode_tok_s": batch * (new_tokens - 1) / max(total - prefill, 1e-9),
            "prefill_tok_s": input_ids.numel() / prefill, "total_s": total}


def bytes_per_step(model, batch: int, context: int) -> int:
    """Bytes one decoding step must read: every weight once (the input embedding only by its rows, a tied LM head
    once), each GDN/KDA layer's recurrent and conv states, each attention layer's keys and values over `context`
    tokens (a sliding layer: over its window), for `batch` rows."""
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    total = sum(p.numel() * p.element_size() for p in model.parameters()  # (each tied parameter once)
                if p is not embedding or tied)
    config, element = model.config, next(model.parameters()).element_size()
    for i, layer_type in enumerate(config.mixer_types):
        s = config.per_layer_config[i]
        if layer_type == "gated_deltanet":
            state = s.gdn_num_value_heads * s.gdn_key_head_dim * s.gdn_value_head_dim
            conv = (2 * s.gdn_num_key_heads * s.gdn_key_head_dim + s.gdn_num_value_heads * s.gdn_value_head_dim
                    ) * s.gdn_conv_kernel_size
            total += batch * (4 * state + element * conv)  # float32 state
        elif layer_type == "kimi_delta_attention":
            state = s.kda_num_heads * s.kda_head_dim ** 2
            conv = 3 * s.kda_num_heads * s.kda_head_dim * s.kda_conv_kernel_size
            total += batch * (4 * state + element * conv)
        else:
            seen_tokens = min(context, s.sliding_window) if layer_type == "sliding_attention" else context
            total += batch * 2 * s.num_key_value_heads * s.head_dim * seen_tokens * element
    return total


def kernels_per_step(model, input_ids, new_tokens: int) -> str:
    """Device kernels (and copies) of one decoding step after the prompt, counted by torch.profiler: as `generate`
    runs it on CUDA with a static cache (a replay of the captured graph), then the same step uncaptured (a check:
    profilers that trace graph replays as one launch would show a tiny first figure); 'n/a' off CUDA."""
    if input_ids.device.type != "cuda":
        return "n/a"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def count(graphs: bool) -> str:
        model.set_cuda_graph_decoding(graphs)
        cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + 4)
        token = input_ids[:, -1:]
        with torch.no_grad():
            model(input_ids=input_ids, cache=cache, use_cache=True)
            model(input_ids=token, cache=cache, use_cache=True)  # captured here (graphs), warm-up (eager)
            torch.cuda.synchronize()
            try:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    model(input_ids=token, cache=cache, use_cache=True)
                    torch.cuda.synchronize()
            except Exception as error:  # a profiler without CUPTI
                return f"n/a ({type(error).__name__})"
        return str(sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA))

    try:
        return f"{count(True)} (eager {count(False)})"
    finally:
        model.set_cuda_graph_decoding(True)


def step_alone_tok_s(model, input_ids, steps: int = 64) -> str:
    """Tokens/s of the decoding step by itself on CUDA with a static cache (model calls back to back: replays of the
    captured graph), without `generate`'s loop around it; 'n/a' off CUDA. Against the decoding figure: the rest of
    generate's time per token is host work the GPU waits for (transformers' loop reads each step's tokens on the
    host, so the host work between that read and the next replay is not overlapped)."""
    if input_ids.device.type != "cuda":
        return "n/a"
    cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + steps + 2)
    token = input_ids[:, -1:]
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
        model(input_ids=token, cache=cache, use_cache=True)  # captured here
        _, seconds = timed(lambda: [model(input_ids=token, cache=cache, use_cache=True) for _ in range(steps)],
                           input_ids.device)
    return f"{input_ids.shape[0] * steps / seconds:.0f}"


def prefill(ours, theirs, lengths, repeats: int, device) -> None:
    """Batch-1 prefill (the prompt's forward into a new cache, only the last token's logits, as `generate` runs it):
    ours into a StaticCache as `generate(..., cache_implementation="static")` makes one per call, replayed from the
    prompt's captured length bucket (cuda_graph_prefill, switched on here: captured on the bucket's second prompt, in
    the warm-up);
    ours uncaptured into a StaticCache (`first`: what a bucket's first prompt runs, and every prompt with the graphs
    off) and into the default cache (`plain`: what ours ran before the captured prefill); transformers' with its
    default cache. Tokens/s and the ratios to transformers, with each one's peak memory allocated and reserved on
    CUDA (reserved counts a graph's memory pool, which a replay uses without allocating)."""
    print("\nprefill, batch 1: tok/s (peak GiB allocated / reserved) | ours, first, plain : transformers")

    def forward(model, input_ids, static: bool) -> None:  # (a new static cache per call, as generate makes one)
        cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + 1) if static else None
        model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **({"cache": cache} if static else {}))

    variants = [("ours", ours, True, True), ("first", ours, True, False), ("plain", ours, False, False),
                ("transformers", theirs, False, None)]
    vocab = ours.config.vocab_size
    for length in lengths:
        input_ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
        results = []
        for name, model, static, graphs in variants:
            if graphs is not None:  # ("ours": the prompt graphs, which are off by default, on)
                model.set_cuda_graph_decoding(graphs, prompts=graphs)
            with torch.no_grad():
                for _ in range(2):  # warm-up: autotuning; ours captures its bucket on the second prompt
                    forward(model, input_ids, static)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                best = min(timed(lambda: forward(model, input_ids, static), device)[1] for _ in range(repeats))
            memory = ((torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30)
                      if device.type == "cuda" else (float("nan"), float("nan")))
            results.append((name, length / best, *memory))
        ours.set_cuda_graph_decoding(True)
        cells = " | ".join(f"{name} {rate:>9.0f} ({alloc:5.2f} / {reserved:5.2f})"
                           for name, rate, alloc, reserved in results)
        ratios = ", ".join(f"{rate / results[-1][1]:.2f}x" for _, rate, _, _ in results[:-1])
        print(f"  {length:>6} tokens: {cells} | {ratios}", flush=True)


def run_pair(name, ours, theirs, device, dtype, prompt, new_tokens, batches, repeats, ours_kwargs, bandwidth_gbs=4800.0,
             prefill_lengths=()):
    ours = ours.to(device=device, dtype=dtype).eval()
    theirs = theirs.to(device=device, dtype=dtype).eval()
    print(f"\n{name}: ours {count_parameters(ours) / 1e6:.1f}M params, transformers "
          f"{count_parameters(theirs) / 1e6:.1f}M params, {dtype}, prompt {prompt}, {new_tokens} new tokens")
    print(f"{'batch':>5} {'ours tok/s':>11} {'theirs tok/s':>13} {'ratio':>6} | {'ours prefill':>12} "
          f"{'theirs prefill':>14} {'ratio':>6} | {'limit tok/s':>11} {'share':>6} {'kernels/step':>20} "
          f"{'step alone':>10}")
    rows = []
    for batch in batches:
        input_ids = torch.randint(1, ours.config.vocab_size, (batch, prompt),
                                  generator=torch.Generator().manual_seed(batch)).to(device)
        kwargs = dict(ours_kwargs)
        static = kwargs.pop("static", False)
        if static:  # what a user types: a new static cache per call (bound to the graph captured in the warm-up)
            kwargs["cache_implementation"] = "static"
        a = measure(ours, input_ids, new_tokens, repeats, **kwargs)
        b = measure(theirs, input_ids, new_tokens, repeats)
        rows.append((batch, a, b))
        # the limit at the mean context of the decoding phase (bytes per step over the bandwidth, times the batch)
        limit = batch * bandwidth_gbs * 1e9 / bytes_per_step(ours, batch, prompt + new_tokens // 2)
        kernels = kernels_per_step(ours, input_ids, new_tokens) if static else "n/a"
        alone = step_alone_tok_s(ours, input_ids) if static else "n/a"
        print(f"{batch:>5} {a['decode_tok_s']:>11.1f} {b['decode_tok_s']:>13.1f} "
              f"{a['decode_tok_s'] / b['decode_tok_s']:>6.2f} | {a['prefill_tok_s']:>12.0f} "
              f"{b['prefill_tok_s']:>14.0f} {a['prefill_tok_s'] / b['prefill_tok_s']:>6.2f} | {limit:>11.0f} "
              f"{a['decode_tok_s'] / limit:>6.1%} {kernels:>20} {alone:>10}", flush=True)
    if prefill_lengths:
        prefill(ours, theirs, prefill_lengths, max(repeats, 3), device)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke test of this script)")
    parser.add_argument("--skip-kda", action="store_true")
    parser.add_argument("--skip-gdn", action="store_true")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--prefill-only", action="store_true", help="only the batch-1 prefill table")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="the GPU's memory bandwidth in GB/s for the weight-read limit (default: H200's 4800)")
    parser.add_argument("--prefill-lengths", type=int, nargs="*",
                        help="batch-1 prefill lengths (default 1024 8192 on a GPU, 256 on the CPU, 64 with --tiny)")
    args = parser.parse_args()
    lengths = args.prefill_lengths
    if lengths is None:
        lengths = [64] if args.tiny else [1024, 8192] if args.device.startswith("cuda") else [256]
    extra = dict(bandwidth_gbs=args.bandwidth_gbs, prefill_lengths=lengths)
    print("command: python " + " ".join(sys.argv))
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cpu":
        # --tiny on one thread: the smoke run's tensors are tiny, and a second thread waits for a core that
        # other processes hold (CI runs two test workers on two cores)
        torch.set_num_threads(1 if args.tiny else 2)
    if device.type == "cpu" and not args.tiny:
        ours_cfg, theirs_cfg = gdn_pair(**CPU_DECODE)
        ours = HybridLinearForCausalLM(ours_cfg)
        theirs = Qwen3NextForCausalLM(theirs_cfg)
        theirs.load_state_dict(ours.state_dict())
        run_pair("GDN (CPU)", ours, theirs, device, torch.float32, 256, 64,
                 [] if args.prefill_only else args.batches or [1], args.repeats, {}, **extra)
        return
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt, new_tokens = ((64, 16) if device.type == "cuda" else (32, 8)) if args.tiny else (1024, 128)
    batches = [] if args.prefill_only else args.batches or ([1, 2] if device.type == "cpu" else [1, 16])
    static = {"static": True}  # ours: a static cache, one-token steps replayed from a CUDA graph
    if not args.skip_gdn:
        ours_cfg, theirs_cfg = gdn_pair(**(TINY_GDN if args.tiny else GPU_GDN))
        with torch.device(device):
            ours, theirs = HybridLinearForCausalLM(ours_cfg), Qwen3NextForCausalLM(theirs_cfg)
        theirs.load_state_dict(ours.state_dict())
        run_pair("GDN vs Qwen3-Next", ours, theirs, device, dtype, prompt, new_tokens, batches, args.repeats, static,
                 **extra)
        del ours, theirs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_kda:
        ours_cfg, theirs_cfg = kda_pair(**(TINY_KDA if args.tiny else GPU_KDA))
        with torch.device(device):
            ours, theirs = HybridLinearForCausalLM(ours_cfg), KimiLinearForCausalLM(theirs_cfg)
        run_pair("KDA vs Kimi-Linear", ours, theirs, device, dtype, prompt, new_tokens, batches, args.repeats, static,
                 **extra)


if __name__ == "__main__":
    main()
