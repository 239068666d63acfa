"""fla's parameter names (GatedDeltaNetForCausalLM, KDAForCausalLM) <-> our canonical ones, as tables.

fla keeps every projection and convolution separate; ours fuses some:
- GDN: q_proj, k_proj, v_proj, g_proj (the output gate, our z) stack FLAT into [Q | K | V | Z] and are then grouped
  by key head into our in_proj_qkvz (per key head h: [q_h | k_h | v_h | z_h], the same row grouping Fast-LLM's flat
  layout needs); b_proj and a_proj stack into [b | a], grouped into in_proj_ba; the three depthwise kernels
  q_conv1d, k_conv1d, v_conv1d stack into our one flat conv1d over [Q | K | V] (a depthwise convolution per channel,
  so stacking channels is exact).
- KDA: the same names as ours for q/k/v and their convs, b_proj, A_log, dt_bias, o_norm, o_proj; fla's two-layer
  `f_proj` / `g_proj` (nn.Sequential) are our f_a/f_b and g_a/g_b, `g_proj.1.bias` our g_b_proj.bias.
- Attention: `attn.{q,k,v,o}_proj` (q/k/v biases with qkv_bias); block norms `attn_norm` / `mlp_norm`;
  `model.embeddings`; `model.norm`; `lm_head` (absent when tied).

Names are relative to `model.layers.{i}.` inside a block. Every converter is pure data movement: bit-exact both ways.
"""

from __future__ import annotations

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, Chain, ConcatRows, ConfigDependent, GdnKeyHeadGrouping
from ..hf_layout import EMBEDDINGS, FINAL_NORM, LM_HEAD, layer_config, layer_prefix
from ..name_maps import Entry, MapRow, instantiate

TOP = (
    Entry("model.embeddings.weight", IDENTITY, EMBEDDINGS),
    Entry("model.norm.weight", IDENTITY, FINAL_NORM),
    Entry("lm_head.weight", IDENTITY, LM_HEAD, when=lambda config: not config.tie_word_embeddings),
)

BLOCK = (
    Entry("attn_norm.weight", IDENTITY, "input_layernorm.weight"),
    Entry("mlp_norm.weight", IDENTITY, "post_attention_layernorm.weight"),
    *(Entry(f"mlp.{name}.weight", IDENTITY, f"mlp.{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")),
)

ATTENTION = (*(Entry(f"attn.{name}.weight", IDENTITY, f"self_attn.{name}.weight")
                for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
             *(Entry(f"attn.{name}.bias", IDENTITY, f"self_attn.{name}.bias", when=lambda c: bool(c.attention_bias))
               for name in ("q_proj", "k_proj", "v_proj")))  # qkv_bias; fla's o_proj has none


def _gdn_widths(config: HybridLinearConfig) -> tuple[int, int]:
    return (config.gdn_num_key_heads * config.gdn_key_head_dim,
            config.gdn_num_value_heads * config.gdn_value_head_dim)


def _qkvz(config: HybridLinearConfig) -> Chain:
    keys, values = _gdn_widths(config)
    return Chain(ConcatRows((keys, keys, values, values)), GdnKeyHeadGrouping("qkvz"))


def _ba(config: HybridLinearConfig) -> Chain:
    heads = config.gdn_num_value_heads
    return Chain(ConcatRows((heads, heads)), GdnKeyHeadGrouping("ba"))


def _conv(config: HybridLinearConfig) -> ConcatRows:
    keys, values = _gdn_widths(config)
    return ConcatRows((keys, keys, values))


GATED_DELTANET = (
    Entry(tuple(f"attn.{n}_proj.weight" for n in "qkvg"), ConfigDependent(_qkvz), "linear_attn.in_proj_qkvz.weight"),
    Entry(("attn.b_proj.weight", "attn.a_proj.weight"), ConfigDependent(_ba), "linear_attn.in_proj_ba.weight"),
    Entry(tuple(f"attn.{n}_conv1d.weight" for n in "qkv"), ConfigDependent(_conv), "linear_attn.conv1d.weight"),
    Entry("attn.A_log", IDENTITY, "linear_attn.A_log"),
    Entry("attn.dt_bias", IDENTITY, "linear_attn.dt_bias"),
    Entry("attn.o_norm.weight", IDENTITY, "linear_attn.norm.weight"),
    Entry("attn.o_proj.weight", IDENTITY, "linear_attn.out_proj.weight"),
)

KIMI_DELTA = (
    *(Entry(f"attn.{n}_proj.weight", IDENTITY, f"linear_attn.{n}_proj.weight") for n in "qkv"),
    *(Entry(f"attn.{n}_conv1d.weight", IDENTITY, f"linear_attn.{n}_conv1d.weight") for n in "qkv"),
    Entry("attn.f_proj.0.weight", IDENTITY, "linear_attn.f_a_proj.weight"),
    Entry("attn.f_proj.1.weight", IDENTITY, "linear_attn.f_b_proj.weight"),
    Entry("attn.b_proj.weight", IDENTITY, "linear_attn.b_proj.weight"),
    Entry("attn.A_log", IDENTITY, "linear_attn.A_log"),
    Entry("attn.dt_bias", IDENTITY, "linear_attn.dt_bias"),
    Entry("attn.g_proj.0.weight", IDENTITY, "linear_attn.g_a_proj.weight"),
    Entry("attn.g_proj.1.weight", IDENTITY, "linear_attn.g_b_proj.weight"),
    Entry("attn.g_proj.1.bias", IDENTITY, "linear_attn.g_b_proj.bias"),
    Entry("attn.o_norm.weight", IDENTITY, "linear_attn.o_norm.weight"),
    Entry("attn.o_proj.weight", IDENTITY, "linear_attn.o_proj.weight"),
)

MIXERS = {
    "full_attention": ATTENTION,
    "sliding_attention": ATTENTION,
    "gated_deltanet": GATED_DELTANET,
    "kimi_delta_attention": KIMI_DELTA,
}


def block_prefix(index: int) -> str:
    return f"model.layers.{index}."


def build_fla_rows(config: HybridLinearConfig) -> list[MapRow]:
    """fla's tensor names <-> canonical names for `config`, each layer's converters bound to its own config."""
    rows = instantiate(TOP[:1], config)
    for index, layer_type in enumerate(config.mixer_types):
        rows += instantiate(MIXERS[layer_type] + BLOCK, layer_config(config, index), block_prefix(index),
                            layer_prefix(index))
    rows += instantiate(TOP[1:], config)
    return rows


__all__ = ["MIXERS", "TOP", "BLOCK", "build_fla_rows", "block_prefix"]
