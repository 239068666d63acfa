"""Cache bytes per token of multi-head latent attention against full keys and values of the same heads.

For each set of MLA shapes: the formula (`mixer_mla.cache_bytes_per_token`, `full_kv_bytes_per_token`), then what a
one-layer model of those shapes really holds in a `StaticCache` after a prefill (transformers' `StaticLayer`, bytes of
its tensors per token slot and batch row) and in a `DynamicCache` (`DynamicLayer`), on the CPU in the chosen
dtype. The full-KV column is what an expanded cache (transformers' DeepSeek-V3 before its latent cache, or a GQA
layer with one KV head per query head of these widths) would hold.

    python benchmarks/bench_mla_cache.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache, StaticCache

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.cache_hybrid_linear import layer_bytes_per_token
from hybrid_linear_models.mixer_mla import cache_bytes_per_token, full_kv_bytes_per_token

# (name, heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), from the released configs
SHAPES = [
    ("Kimi-Linear 48B-A3B", 32, 512, 128, 64, 128),
    ("DeepSeek-V3", 128, 512, 128, 64, 128),
    ("Kimi-style, no shared slice", 32, 512, 128, 0, 128),
]


def measured(heads: int, rank: int, nope: int, rope: int, v: int, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes per token held by a one-layer model's static and dynamic caches after an 8-token prefill (batch 1)."""
    config = HybridLinearConfig(vocab_size=64, hidden_size=64, intermediate_size=64, layer_types=["mla_attention"],
                                num_attention_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=nope,
                                qk_rope_head_dim=rope, v_head_dim=v)
    model = HybridLinearForCausalLM(config).to(dtype).eval()
    input_ids = torch.randint(0, 64, (1, 8))
    static, dynamic = StaticCache(config=config, max_cache_len=16), DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids, cache=static, use_cache=True)
        model(input_ids, cache=dynamic, use_cache=True)
    static_bytes = sum(t.numel() * t.element_size() for t in (static.layers[0].keys, static.layers[0].values)) // 16
    return static_bytes, layer_bytes_per_token(dynamic.layers[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    dtype = getattr(torch, parser.parse_args().dtype)
    print("| shapes | heads | latent + shared slice | MLA cache (formula / static / dynamic) | full KV | ratio |")
    print("|---|---|---|---|---|---|")
    for name, heads, rank, nope, rope, v in SHAPES:
        settings = argparse.Namespace(num_attention_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=nope,
                                      qk_rope_head_dim=rope, v_head_dim=v)
        mla, full = cache_bytes_per_token(settings, dtype), full_kv_bytes_per_token(settings, dtype)
        static, dynamic = measured(heads, rank, nope, rope, v, dtype)
        assert static == dynamic == mla, (static, dynamic, mla)
        print(f"| {name} | {heads} | {rank} + {rope} | {mla} / {static} / {dynamic} B | {full} B | {full / mla:.1f}x |")


if __name__ == "__main__":
    main()
