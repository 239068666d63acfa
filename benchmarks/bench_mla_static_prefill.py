"""Prefill time of MLA layers against a static cache, as max_cache_len grows past the prompt.

A static cache hands each MLA layer its whole latent buffer; a multi-token step expands only the filled slots through
kv_b_proj (`mixer_mla.filled_slots`), so the prefill should cost the same whatever max_cache_len. A two-layer MLA
model (hidden 256, 8 heads, kv_lora_rank 128, q/k 32 + 4, v 32), one CPU thread, float32, best of --repeats; the
expanded rows per layer (kv_b_proj's input, counted by a forward hook) printed beside the time.

    python benchmarks/bench_mla_static_prefill.py [--prompt 256] [--slots 256 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import StaticCache

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--slots", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = HybridLinearConfig(vocab_size=128, hidden_size=256, intermediate_size=256,
                                layer_types=["mla_attention"] * 2, num_attention_heads=8, kv_lora_rank=128,
                                qk_nope_head_dim=32, qk_rope_head_dim=4, v_head_dim=32)
    model = HybridLinearForCausalLM(config).eval()
    rows = []
    model.model.layers[0].self_attn.kv_b_proj.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[-2]))
    input_ids = torch.randint(0, 128, (1, args.prompt))
    for slots in args.slots:
        best = float("inf")
        for _ in range(args.repeats):
            cache = StaticCache(config=config, max_cache_len=slots)
            rows.clear()
            with torch.no_grad():
                start = time.perf_counter()
                model(input_ids, cache=cache, use_cache=True)
                best = min(best, time.perf_counter() - start)
        print(f"max_cache_len {slots:6d}: prefill of {args.prompt} tokens {best * 1e3:7.1f} ms, "
              f"kv_b_proj rows per layer {rows[0]}")


if __name__ == "__main__":
    main()
