"""Decoding speed, ours vs transformers, side by side in one run (greedy, fixed number of new tokens).

CPU (default without CUDA): float32, 2 threads, ~35M model (hidden 512, 6 GDN + 2 gated attention, vocab 8192),
batch 1, prompt 256, 64 new tokens, against transformers' Qwen3NextForCausalLM with the same config and weights.

GPU (--device cuda): bfloat16, ~1.2B GDN model (hidden 2048, 12 GDN + 4 gated attention, vocab 32000) against
Qwen3NextForCausalLM with the same weights, and a ~1B KDA model against KimiLinearForCausalLM; prompt 1024, 128 new
tokens, batch 1 and 16; ours with a static cache (captured CUDA graph per step), transformers with its default cache.
Prints tokens/s of the decoding phase, prefill tokens/s and the ratios.

    python benchmarks/bench_generation.py [--device cuda] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import KimiLinearForCausalLM, Qwen3NextForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).parent))
from model_configs import CPU_DECODE, GPU_GDN, GPU_KDA, TINY_GDN, TINY_KDA, count_parameters, gdn_pair, kda_pair  # noqa: E402

from hybrid_linear_models import HybridLinearForCausalLM  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, input_ids, new_tokens, static_cache: StaticCache | None = None, **kwargs) -> float:
    """Seconds for one greedy `generate`. With `static_cache`, that cache is reset and reused, so its CUDA graph is
    captured once (in the warm-up) as in a serving loop."""
    if static_cache is not None:
        static_cache.reset()
        kwargs["cache"] = static_cache
    _sync(input_ids.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, **kwargs)
    _sync(input_ids.device)
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - start


def measure(model, input_ids, new_tokens, repeats, **kwargs) -> dict:
    """Decoding tokens/s from (time of prompt + N tokens) - (time of prompt + 1 token); prefill tokens/s from the
    latter."""
    timed_generate(model, input_ids, min(new_tokens, 4), **kwargs)  # warm-up: autotuning, graph capture
    prefill = min(timed_generate(model, input_ids, 1, **kwargs) for _ in range(repeats))
    total = min(timed_generate(model, input_ids, new_tokens, **kwargs) for _ in range(repeats))
    batch = input_ids.shape[0]
    return {"decode_tok_s": batch * (new_tokens - 1) / max(total - prefill, 1e-9),
            "prefill_tok_s": input_ids.numel() / prefill, "total_s": total}


def run_pair(name, ours, theirs, device, dtype, prompt, new_tokens, batches, repeats, ours_kwargs):
    ours = ours.to(device=device, dtype=dtype).eval()
    theirs = theirs.to(device=device, dtype=dtype).eval()
    print(f"\n{name}: ours {count_parameters(ours) / 1e6:.1f}M params, transformers "
          f"{count_parameters(theirs) / 1e6:.1f}M params, {dtype}, prompt {prompt}, {new_tokens} new tokens")
    print(f"{'batch':>5} {'ours tok/s':>11} {'theirs tok/s':>13} {'ratio':>6} | {'ours prefill':>12} "
          f"{'theirs prefill':>14} {'ratio':>6}")
    rows = []
    for batch in batches:
        input_ids = torch.randint(1, ours.config.vocab_size, (batch, prompt),
                                  generator=torch.Generator().manual_seed(batch)).to(device)
        kwargs = dict(ours_kwargs)
        if kwargs.pop("static", False):
            kwargs["static_cache"] = StaticCache(config=ours.config, max_cache_len=prompt + new_tokens)
        a = measure(ours, input_ids, new_tokens, repeats, **kwargs)
        b = measure(theirs, input_ids, new_tokens, repeats)
        rows.append((batch, a, b))
        print(f"{batch:>5} {a['decode_tok_s']:>11.1f} {b['decode_tok_s']:>13.1f} "
              f"{a['decode_tok_s'] / b['decode_tok_s']:>6.2f} | {a['prefill_tok_s']:>12.0f} "
              f"{b['prefill_tok_s']:>14.0f} {a['prefill_tok_s'] / b['prefill_tok_s']:>6.2f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke test of this script)")
    parser.add_argument("--skip-kda", action="store_true")
    parser.add_argument("--skip-gdn", action="store_true")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(2)
        ours_cfg, theirs_cfg = gdn_pair(**(TINY_GDN if args.tiny else CPU_DECODE))
        ours = HybridLinearForCausalLM(ours_cfg)
        theirs = Qwen3NextForCausalLM(theirs_cfg)
        theirs.load_state_dict(ours.state_dict())
        run_pair("GDN (CPU)", ours, theirs, device, torch.float32, 32 if args.tiny else 256, 8 if args.tiny else 64,
                 args.batches or [1], args.repeats, {})
        return
    dtype = torch.bfloat16
    prompt, new_tokens = (64, 16) if args.tiny else (1024, 128)
    batches = args.batches or [1, 16]
    static = {"static": True}  # ours: a static cache, one-token steps replayed from a CUDA graph
    if not args.skip_gdn:
        ours_cfg, theirs_cfg = gdn_pair(**(TINY_GDN if args.tiny else GPU_GDN))
        with torch.device(device):
            ours, theirs = HybridLinearForCausalLM(ours_cfg), Qwen3NextForCausalLM(theirs_cfg)
        theirs.load_state_dict(ours.state_dict())
        run_pair("GDN vs Qwen3-Next", ours, theirs, device, dtype, prompt, new_tokens, batches, args.repeats, static)
        del ours, theirs
        torch.cuda.empty_cache()
    if not args.skip_kda:
        ours_cfg, theirs_cfg = kda_pair(**(TINY_KDA if args.tiny else GPU_KDA))
        with torch.device(device):
            ours, theirs = HybridLinearForCausalLM(ours_cfg), KimiLinearForCausalLM(theirs_cfg)
        run_pair("KDA vs Kimi-Linear", ours, theirs, device, dtype, prompt, new_tokens, batches, args.repeats, static)


if __name__ == "__main__":
    main()
