"""The released flagships at full size on one GPU, random weights built on the device (flagship_models.py): decoding,
time to first token, prefill and memory, ours beside transformers' own classes with the same weights, and
Qwen3-Next's FP8 build beside the published vLLM figures.

Models (`--models`, one on the GPU at a time: ours built, measured, freed, then transformers' built from the same
seeded draws):
- qwen3-next-fp8: Qwen3-Next-80B-A3B, all 48 layers, the released FP8 layout (~75 GiB); ours only (transformers
  runs FP8 through its own quantizer and downloaded kernels), beside vLLM's published H200 figures (`VLLM_H200`).
- qwen3-next-bf16: the first `--qwen-layers` (24) of its 48 layers in bfloat16 (~75 GiB): ours vs transformers'
  Qwen3NextForCausalLM (the whole bf16 model, ~149 GiB, does not fit one H200).
- kimi-linear: Kimi-Linear-48B-A3B, all 27 layers, bfloat16 (~92 GiB): ours vs transformers' KimiLinearForCausalLM.

Measurements (bench_generation's conventions: greedy `generate`, ours with `cache_implementation="static"` (its
steps replayed from captured CUDA graphs), transformers with its default cache):
1. time to first token at batch 1 for 1K, 32K and 256K tokens of prompt: `generate(max_new_tokens=1)`, the first
   call at that length (first calls included: autotuning, captures, allocations) and the best of the warm ones;
   prefill tokens/s = prompt / warm TTFT;
2. decoding tokens/s at batch 1 and 16 after 1K and 256K tokens of prompt: batch x (N - 1) / (time of prompt + N
   tokens - time of prompt + 1 token), N = `--new-tokens`, after one warm-up call; the best of `--repeats` (at
   least 3: both timings hold the prefill, whose spread would otherwise swing the rate) at 1K, one at 256K (each
   call a 256K prefill). After 256K only the batches of `--long-batches` run (default 1: at
   batch 16 every call prefills 4M tokens, minutes each); a cell whose cache (static: prompt + N slots) would not
   fit the free memory is skipped with its size; an out-of-memory error is printed in its cell;
3. the limit of each decoding cell: a step must read every weight it uses once (`step_bytes`: the routed experts
   actually used (the expected number of distinct experts among batch x top-k uniformly routed picks), the shared
   expert, the attention / GDN / KDA projections, the routers, the LM head, the embedding's rows; FP8 weights as
   their FP8 bytes and scales) and the caches at the mean decoding context, so batch x bandwidth / bytes is the
   fastest tokens/s the memory allows (`--bandwidth-gbs`, 4800 for an H200); the share is ours / that limit;
4. peak memory allocated of each model's whole run.

--tiny: the same layouts in miniature (FP8 with 16 x 16 blocks) through every step on the CPU in float32: prompts
16 / 32 / 64 tokens for "1K" / "32K" / "256K", batches 1 and 2, 4 new tokens (a smoke test of this script; its
figures mean nothing).

    python benchmarks/bench_flagships.py [--models qwen3-next-fp8 qwen3-next-bf16 kimi-linear] [--tiny]
        [--qwen-layers 24] [--contexts 1K 32K 256K] [--batches 1 16] [--long-batches 1] [--new-tokens 64]
        [--repeats 2]
        [--bandwidth-gbs 4800] [--eager] [--warm-up]

Without --warm-up, this package's Triton kernels run their default configurations (kernel_tuning), as a process that
never calls `warm_up` does; with it, `warm_up` tunes them first and prints its time.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_generation import timed_generate
from flagship_models import (
    build_ours,
    build_theirs,
    kimi_linear_fields,
    qwen3_next_fields,
)
from timing import timed

CONTEXTS = {"1K": 1024, "32K": 32768, "256K": 262144}
TINY_CONTEXTS = {"1K": 16, "32K": 32, "256K": 64}
DECODE_CONTEXTS = ("1K", "256K")
# vLLM's published figures for Qwen3-Next-80B-A3B FP8 on one H200 (single request)
VLLM_H200 = {"decode tok/s, 1K": 210.8, "decode tok/s, 256K": 152.8, "TTFT s, 1K": 0.379, "TTFT s, 256K": 20.4}
MODELS = ("qwen3-next-fp8", "qwen3-next-bf16", "kimi-linear")
MARGIN = 2 * 2**30  # activations of a decoding step, kept free beside the cache


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cache_bytes(config, batch: int, context: int, element: int) -> int:
    """Bytes of the caches of `batch` rows over `context` tokens: each GDN / KDA layer's float32 state and conv
    window, each attention layer's keys and values, each MLA layer's latent and shared rope key."""
    total = 0
    for index, kind in enumerate(config.mixer_types):
        s = config.per_layer_config[index]
        if kind == "gated_deltanet":
            conv = 2 * s.gdn_num_key_heads * s.gdn_key_head_dim + s.gdn_num_value_heads * s.gdn_value_head_dim
            total += batch * (4 * s.gdn_num_value_heads * s.gdn_key_head_dim * s.gdn_value_head_dim
                              + element * conv * s.gdn_conv_kernel_size)
        elif kind == "kimi_delta_attention":
            total += batch * (4 * s.kda_num_heads * s.kda_head_dim**2
                              + element * 3 * s.kda_num_heads * s.kda_head_dim * s.kda_conv_kernel_size)
        elif kind == "mla_attention":
            total += batch * context * (s.kv_lora_rank + s.qk_rope_head_dim) * element
        else:
            total += batch * context * 2 * s.num_key_value_heads * s.head_dim * element
    return total


def step_bytes(model, batch: int, context: int) -> int:
    """Bytes one decoding step of `batch` rows reads (see the module docstring, 3.)."""
    config = model.config
    experts, top_k = config.num_experts, config.num_experts_per_tok
    used = experts * (1 - (1 - top_k / experts) ** batch) if experts else 0  # expected distinct experts
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        size = tensor.numel() * tensor.element_size()
        if "embed_tokens" in name:
            size = batch * tensor.shape[-1] * tensor.element_size()  # the rows of the batch's tokens
        elif ".mlp.experts." in name:
            size = size * used / experts
        elif "inv_freq" in name:
            size = 0
        total += size
    return int(total + cache_bytes(config, batch, context, model.lm_head.weight.element_size()))


MIN_DECODE_REPEATS = 3  # timings of each decoding cell below 128K of context (see `decoding`)


def _tokens(vocab: int, batch: int, length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch * 1_000_003 + length)
    return torch.randint(1, vocab, (batch, length), generator=generator).to(device)


def _cell(run):
    """run() or the reason it did not run: out of memory, printed in the table."""
    try:
        return run()
    except torch.OutOfMemoryError:
        return "OOM"


def time_to_first_token(model, contexts: dict[str, int], repeats: int, device, kwargs: dict) -> dict:
    results = {}
    for label, length in contexts.items():
        tokens = _tokens(model.config.vocab_size, 1, length, device)

        def run(tokens=tokens, length=length):
            first = timed_generate(model, tokens, 1, **kwargs)
            warm = min(timed_generate(model, tokens, 1, **kwargs) for _ in range(repeats if length < 2**17 else 1))
            return first, warm
        results[label] = _cell(run)
        _free(device)
        print(f"  TTFT {label}: {results[label]}", flush=True)
    return results


def decoding(model, config, contexts: dict[str, int], args, device, kwargs: dict) -> dict:
    """Decoding tok/s per (batch, context) cell; `config` ours (the cache sizes)."""
    results, new_tokens = {}, args.new_tokens
    element = model.lm_head.weight.element_size()
    for label in args.decode_contexts:
        length = contexts[label]
        for batch in args.batches:
            if label != "1K" and batch not in args.long_batches:
                results[batch, label] = f"not run (a {batch * length}-token prefill; --long-batches {batch} runs it)"
                continue
            needed = cache_bytes(config, batch, length + new_tokens, element) + MARGIN
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            if free is not None and needed > free:
                results[batch, label] = f"skipped: cache {needed / 2**30:.0f} GiB > {free / 2**30:.0f} GiB free"
                print(f"  decode b={batch} {label}: {results[batch, label]}", flush=True)
                continue
            tokens = _tokens(model.config.vocab_size, batch, length, device)

            def run(tokens=tokens, batch=batch, long=length >= 2**17):
                timed_generate(model, tokens, new_tokens, **kwargs)  # warm-up: autotuning, captures
                # the rate is a difference of two timings that each hold the prompt's prefill (0.3 s at 1K for the FP8
                # Qwen3-Next, varying by tens of ms: ~1 ms a token over 64 tokens), so short contexts take the best of
                # at least 3 of each
                count = 1 if long else max(args.repeats, MIN_DECODE_REPEATS)
                one = min(timed_generate(model, tokens, 1, **kwargs) for _ in range(count))
                many = min(timed_generate(model, tokens, new_tokens, **kwargs) for _ in range(count))
                if many <= one:  # timer noise on a tiny model: no figure rather than an absurd one
                    return "n/a (N tokens took no longer than 1)"
                return batch * (new_tokens - 1) / (many - one)
            results[batch, label] = _cell(run)
            _free(device)
            print(f"  decode b={batch} {label}: {results[batch, label]}", flush=True)
    return results


def measure(model, config, side: str, args, contexts: dict[str, int], device) -> dict:
    kwargs = {"cache_implementation": "static"} if side == "ours" else {}
    if side == "ours" and args.eager:
        model.set_cuda_graph_decoding(False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if side == "ours" and args.warm_up:  # what generation will need, tuned and captured before the first call
        longest = max(contexts[k] for k in args.contexts) + args.new_tokens
        model.warm_up(max_batch_size=1, max_length=min(longest, model.config.max_position_embeddings))
    ttft = time_to_first_token(model, {k: contexts[k] for k in args.contexts}, args.repeats, device, kwargs)
    decode = decoding(model, config, contexts, args, device, kwargs)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    graphs = getattr(model, "_graph_decoder", None)
    if side == "ours" and device.type == "cuda":  # a step that cannot be captured runs eager: say so
        failed = sorted({str(reason) for reason in getattr(graphs, "_failed", {}).values()})
        print(f"  ours' decoding graphs: {'off (--eager)' if graphs is None else failed or 'captured'}", flush=True)
    return {"ttft": ttft, "decode": decode, "peak": peak}


def _text(value, scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "not run"
    return f"{value * scale:.{digits}f}" if isinstance(value, float | int) else str(value)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float | int) and isinstance(b, float | int) and b else "n/a"


def report(name: str, results: dict, limits: dict, contexts: dict[str, int], args) -> None:
    sides = list(results)
    print(f"\n{name}: time to first token, batch 1 (first call / warm, seconds; prefill tok/s from warm)")
    for label in args.contexts:
        cells = []
        for side in sides:
            value = results[side]["ttft"][label]
            if isinstance(value, tuple):
                cells.append(f"{side} {value[0]:8.3f} / {value[1]:8.3f} s, {contexts[label] / value[1]:9.0f} tok/s")
            else:
                cells.append(f"{side} {value}")
        ratio = ""
        if len(sides) == 2 and all(isinstance(results[s]["ttft"][label], tuple) for s in sides):
            ratio = f" | warm ratio transformers / ours {_ratio(results[sides[1]]['ttft'][label][1], results[sides[0]]['ttft'][label][1])}"
        print(f"  {label:>5}: " + " | ".join(cells) + ratio)
    print(f"{name}: decoding tok/s, {args.new_tokens} new tokens (limit: bytes per step over "
          f"{args.bandwidth_gbs:.0f} GB/s)")
    for label in args.decode_contexts:
        for batch in args.batches:
            cells = [f"{side} {_text(results[side]['decode'][batch, label])}" for side in sides]
            ours, limit = results[sides[0]]["decode"][batch, label], limits[batch, label]
            ratio = (f" | ours / transformers {_ratio(ours, results[sides[1]]['decode'][batch, label])}"
                     if len(sides) == 2 else "")
            share = f"{ours / limit:.1%}" if isinstance(ours, float) else "n/a"
            print(f"  b={batch:<3} {label:>5}: " + " | ".join(cells) + ratio + f" | limit {limit:.0f}, ours {share}")
    print(f"{name}: peak memory allocated: " + ", ".join(f"{s} {results[s]['peak']:.1f} GiB" for s in sides)
          + (" (n/a off CUDA)" if args.tiny else ""), flush=True)


def vllm_anchor(results: dict) -> None:
    """Ours beside vLLM's published H200 figures: tok/s as ours / vLLM, TTFT as vLLM / ours (above 1: ours
    faster)."""
    ttft, decode = results["ttft"], results["decode"]
    ours = {"decode tok/s, 1K": decode.get((1, "1K")), "decode tok/s, 256K": decode.get((1, "256K")),
            "TTFT s, 1K": ttft.get("1K", (None, None))[1] if isinstance(ttft.get("1K"), tuple) else ttft.get("1K"),
            "TTFT s, 256K": ttft.get("256K", (None, None))[1] if isinstance(ttft.get("256K"), tuple)
            else ttft.get("256K")}
    print("\nqwen3-next-fp8 beside vLLM (published, one H200; ratio above 1: ours faster)")
    for key, theirs in VLLM_H200.items():
        value = ours[key]
        speedup = _ratio(value, theirs) if key.startswith("decode") else _ratio(theirs, value)
        print(f"  {key:<20} vLLM {theirs:>8} | ours {_text(value, digits=3):>10} | {speedup}")


def run_model(key: str, args, device: torch.device, dtype: torch.dtype, contexts: dict[str, int]) -> None:
    if key == "qwen3-next-fp8":
        fields, sides = qwen3_next_fields(tiny=args.tiny, fp8=True), ["ours"]
    elif key == "qwen3-next-bf16":
        fields, sides = qwen3_next_fields(layers=None if args.tiny else args.qwen_layers, tiny=args.tiny), \
            ["ours", "transformers"]
    else:
        fields, sides = kimi_linear_fields(tiny=args.tiny), ["ours", "transformers"]
    print(f"\n=== {key}: {fields['num_hidden_layers']} layers, {dtype}, {device}", flush=True)
    results, limits, config, logits = {}, {}, None, {}
    for side in sides:
        build = build_ours if side == "ours" else build_theirs
        model, seconds = timed(lambda: build(fields, device, dtype), device)
        print(f"{side}: built in {seconds:.1f} s", flush=True)
        if side == "ours":
            config = model.config
            for label in args.decode_contexts:
                for batch in args.batches:
                    read = step_bytes(model, batch, contexts[label] + args.new_tokens // 2)
                    limits[batch, label] = batch * args.bandwidth_gbs * 1e9 / read
        results[side] = measure(model, config, side, args, contexts, device)
        with torch.no_grad():  # the last positions' logits on a short input (after the first calls measured)
            probe = model(_tokens(fields["vocab_size"], 1, 64, device), use_cache=False, logits_to_keep=8)
            logits[side] = probe.logits.float().cpu()
        del model
        _free(device)
    if len(logits) == 2:
        ours, theirs = logits["ours"], logits["transformers"]
        agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        print(f"\nsame weights: max |logits ours - transformers'| = {(ours - theirs).abs().max().item():.3g} (logits "
              f"up to {theirs.abs().max().item():.3g}), top-1 agreement {agree:.0%}, 64 tokens, {dtype} (in bfloat16 "
              "a router's near ties may pick other experts: tests/test_flagship_models.py checks float32)")
    report(key, results, limits, contexts, args)
    if key == "qwen3-next-fp8":
        vllm_anchor(results["ours"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS))
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (a smoke test of this script)")
    parser.add_argument("--qwen-layers", type=int, default=24, help="layers of the bf16 Qwen3-Next (of 48)")
    parser.add_argument("--contexts", nargs="*", choices=list(CONTEXTS), default=list(CONTEXTS),
                        help="prompt lengths of the time-to-first-token rows (and of decoding: 1K, 256K)")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--long-batches", type=int, nargs="*", default=[1],
                        help="the batches also decoded after 256K (default 1: batch 16 prefills 4M tokens)")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth (H200: 4800 GB/s)")
    parser.add_argument("--warm-up", action="store_true",
                        help="ours: model.warm_up (batch 1, up to the longest context) before the first call, timed")
    parser.add_argument("--eager", action="store_true", help="ours without captured CUDA graphs")
    args = parser.parse_args()
    for name in ("qwen_layers", "repeats", "new_tokens"):  # (checked before any model is built)
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if any(batch < 1 for batch in [*(args.batches or []), *args.long_batches]):
        parser.error("--batches and --long-batches take positive integers")
    if args.bandwidth_gbs <= 0:
        parser.error(f"--bandwidth-gbs must be positive, got {args.bandwidth_gbs}")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("the full-size flagships need a CUDA device; run with --tiny for the CPU smoke test.")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    contexts = TINY_CONTEXTS if args.tiny else CONTEXTS
    args.batches = args.batches or ([1, 2] if args.tiny else [1, 16])
    args.new_tokens = args.new_tokens or (4 if args.tiny else 64)
    args.decode_contexts = [label for label in DECODE_CONTEXTS if label in args.contexts]
    if args.tiny:
        # one thread: the smoke run's tensors are tiny, and a second thread waits for a core that
        # other processes hold (CI runs two test workers on two cores)
        torch.set_num_threads(1)
    for key in args.models:
        try:
            run_model(key, args, device, dtype, contexts)
        except SystemExit as refusal:  # (a model that does not fit: the others still run)
            print(f"{key}: skipped: {refusal}", flush=True)


if __name__ == "__main__":
    main()
