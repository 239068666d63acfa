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


# bench_kimi_linear.py's Kimi-Linear models: the ~1B-active one (16 layers 3:1 KDA:MLA, 64 experts top-8) and a tiny one
SIZES = {
    "gpu": dict(hidden=2048, layers=16, kda_heads=16, kda_dim=128, mla_heads=16, kv_lora_rank=512, qk_nope=128,
                qk_rope=64, v_dim=128, experts=64, top_k=8, expert_width=512, dense_width=5632, vocab=32000,
                batch=4, seq=4096, prompt=512, new_tokens=64),
    "tiny": dict(hidden=64, layers=4, kda_heads=2, kda_dim=16, mla_heads=2, kv_lora_rank=16, qk_nope=8, qk_rope=8,
                 v_dim=8, experts=8, top_k=2, expert_width=16, dense_width=96, vocab=256,
                 batch=2, seq=128, prompt=32, new_tokens=8),
}
ATTENTION_EVERY = 4  # Kimi-Linear's 3 KDA : 1 MLA


def kimi_config(size: dict) -> KimiLinearConfig:
    """transformers' config of `size`, in the released checkpoints' terms (1-indexed layer lists)."""
    layers = size["layers"]
    mla = [n for n in range(1, layers + 1) if n % ATTENTION_EVERY == 0]
    return KimiLinearConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["dense_width"],
        num_hidden_layers=layers, num_attention_heads=size["mla_heads"], num_key_value_heads=size["mla_heads"],
        kv_lora_rank=size["kv_lora_rank"], q_lora_rank=None, qk_nope_head_dim=size["qk_nope"],
        qk_rope_head_dim=size["qk_rope"], v_head_dim=size["v_dim"], mla_use_nope=True,
        linear_attn_config={"kda_layers": [n for n in range(1, layers + 1) if n not in mla], "full_attn_layers": mla,
                            "num_heads": size["kda_heads"], "head_dim": size["kda_dim"], "short_conv_kernel_size": 4},
        num_local_experts=size["experts"], num_experts_per_tok=size["top_k"],
        moe_intermediate_size=size["expert_width"], num_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.446, norm_topk_prob=True, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def kimi_linear_config(**narrow) -> HybridLinearConfig:
    """Ours for the ~1B-active Kimi-Linear model (SIZES["gpu"]), through the kimi_linear converter's config mapping;
    `narrow` overrides its sizes (keys of SIZES)."""
    import json

    from hybrid_linear_models.conversion.kimi_linear.config import kimi_to_hybrid_config

    size = dict(SIZES["gpu"], **narrow)
    return kimi_to_hybrid_config(json.loads(kimi_config(size).to_json_string()), "the Kimi-Linear benchmark config")
