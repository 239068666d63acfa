"""Benchmark model configurations, ours and transformers' equivalents with the same math and shapes."""

from __future__ import annotations

from transformers import KimiLinearConfig, Qwen3NextConfig

from hybrid_linear_models import HybridLinearConfig


def hybrid_layer_types(num_layers: int, linear: str, attention_every: int = 4) -> list[str]:
    return [("full_attention" if (i + 1) % attention_every == 0 else linear) for i in range(num_layers)]


def gdn_pair(hidden, layers, intermediate, vocab, heads, kv_heads, head_dim, key_heads, value_heads, gdn_dim):
    """Ours and transformers' Qwen3-Next (dense MLPs) with identical parameter names and math."""
    types = hybrid_layer_types(layers, "gated_deltanet")
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6)
    ours = HybridLinearConfig(**common, layer_types=types, gdn_num_key_heads=key_heads, gdn_num_value_heads=value_heads,
                              gdn_key_head_dim=gdn_dim, gdn_value_head_dim=gdn_dim)
    theirs = Qwen3NextConfig(
        **common, num_hidden_layers=layers, layer_types=["linear_attention" if t == "gated_deltanet" else t for t in types],
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=gdn_dim,
        linear_value_head_dim=gdn_dim, mlp_only_layers=list(range(layers)), num_experts=2, num_experts_per_tok=1,
        rope_parameters=dict(ours.rope_parameters),
    )
    return ours, theirs


def kda_pair(hidden, layers, intermediate, vocab, heads, kv_heads, head_dim, kda_heads, kda_dim):
    """Ours (KDA + gated attention) and transformers' Kimi-Linear (KDA + MLA attention, dense MLPs) of about the same
    size: the linear layers are identical, the attention layers comparable."""
    types = hybrid_layer_types(layers, "kimi_delta_attention")
    ours = HybridLinearConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, layer_types=types,
                              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                              kda_num_heads=kda_heads, kda_head_dim=kda_dim, kda_gate_activation="sigmoid",
                              rms_norm_eps=1e-5)
    theirs = KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
        mlp_layer_types=["dense"] * layers, num_local_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
        linear_attn_config=dict(num_heads=kda_heads, head_dim=kda_dim, short_conv_kernel_size=4,
                                kda_layers=[i + 1 for i, t in enumerate(types) if t != "full_attention"],
                                full_attn_layers=[i + 1 for i, t in enumerate(types) if t == "full_attention"]),
    )
    return ours, theirs


# Issue sizes: ~35M CPU decoding model; ~1.2B GDN and ~1B KDA models for the GPU.
CPU_DECODE = dict(hidden=512, layers=8, intermediate=1536, vocab=8192, heads=8, kv_heads=2, head_dim=64,
                  key_heads=4, value_heads=8, gdn_dim=64)
GPU_GDN = dict(hidden=2048, layers=16, intermediate=5632, vocab=32000, heads=16, kv_heads=2, head_dim=256,
               key_heads=16, value_heads=32, gdn_dim=128)
GPU_KDA = dict(hidden=2048, layers=16, intermediate=5632, vocab=32000, heads=16, kv_heads=2, head_dim=128,
               kda_heads=16, kda_dim=128)
TINY_GDN = dict(hidden=64, layers=4, intermediate=96, vocab=256, heads=4, kv_heads=2, head_dim=16,
                key_heads=2, value_heads=4, gdn_dim=16)
TINY_KDA = dict(hidden=64, layers=4, intermediate=96, vocab=256, heads=4, kv_heads=2, head_dim=16,
                kda_heads=4, kda_dim=16)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def kimi_linear_config(**narrow) -> HybridLinearConfig:
    """Ours for bench_kimi_linear.py's ~1B-active Kimi-Linear model (16 layers 3:1 KDA:MLA, 64 experts top-8), through
    the kimi_linear converter's config mapping; `narrow` overrides its sizes (keys of bench_kimi_linear.SIZES)."""
    import json

    from bench_kimi_linear import SIZES, kimi_config

    from hybrid_linear_models.conversion.kimi_linear.config import kimi_to_hybrid_config

    size = dict(SIZES["gpu"], **narrow)
    return kimi_to_hybrid_config(json.loads(kimi_config(size).to_json_string()), "the Kimi-Linear benchmark config")
