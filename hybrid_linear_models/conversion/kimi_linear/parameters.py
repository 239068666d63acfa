"""Kimi-Linear's parameter names <-> our canonical ones, as tables, in the two layouts Kimi checkpoints come in.

The hub layout (the released checkpoints, and what transformers' `save_pretrained` writes, since it reverts its
load-time conversions on save), names relative to `model.layers.{i}.`:
- KDA under `self_attn.` (ours: `linear_attn.`): q/k/v projections and their three depthwise convolutions
  `q_conv1d` / `k_conv1d` / `v_conv1d` (P, 1, K) as ours; `f_a_proj`, `f_b_proj`, `b_proj`, `g_a_proj`, `g_b_proj`,
  `o_norm`, `o_proj`, `dt_bias` (P,) as ours; `A_log` stored (1, 1, H, 1) for our (H,) (the same values: a reshape).
- MLA under `self_attn.`, as ours (`q_proj` or `q_a_proj` / `q_a_layernorm` / `q_b_proj`, `kv_a_proj_with_mqa`,
  `kv_a_layernorm`, `kv_b_proj`, `o_proj`).
- dense MLP `mlp.{gate,up,down}_proj` as ours (transformers' save_pretrained writes it under `block_sparse_moe.`,
  since it reverts its `block_sparse_moe` -> `mlp` renaming on every layer: both are read);
- MoE under `block_sparse_moe.`: `gate.weight`, `gate.e_score_correction_bias`, `shared_experts.*` as ours under
  `mlp.`, and the experts one at a time, `experts.{e}.w1` (gate), `w3` (up), `w2` (down), stacked into our
  (E, 2I, H) `experts.gate_up_proj` (per expert w1's rows, then w3's: transformers' own concatenation) and
  (E, H, I) `experts.down_proj`.

transformers' in-memory layout (`save_pretrained(..., save_original_format=False)`), also read: KDA's three
convolutions as one `conv1d` (3P, 1, K) over [q | k | v], `f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` under
`self_attn.forget_gate.`, the MoE under `mlp.` with fused experts (our names).

Every converter is pure data movement (rename, reshape, split, stack): bit-exact both ways.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, Converter, SplitRows, StackedExperts
from ..hf_layout import CanonicalLayout, EMBEDDINGS, FINAL_NORM, LM_HEAD, layer_config, layer_prefix
from ..name_maps import Entry, MapRow, instantiate
from .config import DENSE, KDA, KIMI_MOE, MLA

KIMI_ATTENTION = "self_attn."  # both of Kimi's mixers live here
OURS_KDA = "linear_attn."
OURS_MLA = "self_attn."


@dataclass(frozen=True)
class HeadsInDim2(Converter):
    """A per-head vector stored as (1, 1, H, 1) (Kimi's `A_log`, shaped to broadcast over [batch, tokens, heads,
    dim]) and held as (H,) here: the same values, reshaped."""

    def forward(self, tensors):
        return [tensors[0].reshape(-1)]

    def inverse(self, tensors):
        return [tensors[0].reshape(1, 1, -1, 1)]

    def forward_shapes(self, shapes):
        shape = tuple(shapes[0])
        if len(shape) != 4 or shape[0] != 1 or shape[1] != 1 or shape[3] != 1:
            raise ValueError(f"shape {list(shape)} is not (1, 1, heads, 1)")
        return [(shape[2],)]

    def inverse_shapes(self, shapes):
        (heads,) = shapes[0]
        return [(1, 1, heads, 1)]


HEADS_IN_DIM_2 = HeadsInDim2()
_KDA_PLAIN = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm",
              "o_proj")
_FORGET_GATE = "forget_gate."

KDA_HUB = (
    *(Entry(f"self_attn.{name}.weight", IDENTITY, f"linear_attn.{name}.weight") for name in _KDA_PLAIN),
    *(Entry(f"self_attn.{n}_conv1d.weight", IDENTITY, f"linear_attn.{n}_conv1d.weight") for n in "qkv"),
    Entry("self_attn.dt_bias", IDENTITY, "linear_attn.dt_bias"),
    Entry("self_attn.A_log", HEADS_IN_DIM_2, "linear_attn.A_log"),
)
KDA_FUSED = (  # transformers' in-memory names
    *(Entry(f"self_attn.{_FORGET_GATE if name.startswith('f_') else ''}{name}.weight", IDENTITY,
            f"linear_attn.{name}.weight") for name in _KDA_PLAIN),
    Entry("self_attn.conv1d.weight", SplitRows(3), tuple(f"linear_attn.{n}_conv1d.weight" for n in "qkv")),
    Entry(f"self_attn.{_FORGET_GATE}dt_bias", IDENTITY, "linear_attn.dt_bias"),
    Entry(f"self_attn.{_FORGET_GATE}A_log", HEADS_IN_DIM_2, "linear_attn.A_log"),
)


def dense_mlp(prefix: str) -> tuple[Entry, ...]:
    """The gated MLP's three projections, stored under `prefix` ("mlp." or "block_sparse_moe.")."""
    return tuple(Entry(f"{prefix}{name}.weight", IDENTITY, f"mlp.{name}.weight")
                 for name in ("gate_proj", "up_proj", "down_proj"))


def _moe_hub(config: HybridLinearConfig) -> tuple[Entry, ...]:
    experts = config.num_experts
    moe = "block_sparse_moe."
    return (
        Entry(f"{moe}gate.weight", IDENTITY, "mlp.gate.weight"),
        Entry(f"{moe}gate.e_score_correction_bias", IDENTITY, "mlp.gate.e_score_correction_bias"),
        Entry(tuple(f"{moe}experts.{e}.{w}.weight" for e in range(experts) for w in ("w1", "w3")),
              StackedExperts(experts, 2), "mlp.experts.gate_up_proj"),
        Entry(tuple(f"{moe}experts.{e}.w2.weight" for e in range(experts)), StackedExperts(experts, 1),
              "mlp.experts.down_proj"),
        *(Entry(f"{moe}shared_experts.{name}.weight", IDENTITY, f"mlp.shared_experts.{name}.weight")
          for name in ("gate_proj", "up_proj", "down_proj")),
    )


def _renamed(canonical: Collection[str], ours: str, theirs: str) -> tuple[Entry, ...]:
    """Every canonical tensor under `ours`, stored under `theirs` with the rest of its name unchanged."""
    return tuple(Entry(theirs + name[len(ours):], IDENTITY, name) for name in canonical if name.startswith(ours))


@dataclass(frozen=True)
class StoredLayout:
    """Which of Kimi's two layouts each part of a layer is stored in (the writer always uses the hub's)."""

    fused_kda: bool = False
    fused_experts: bool = False
    dense_prefix: str = "mlp."


HUB_LAYOUT = StoredLayout()


def stored_layout(keys: Collection[str], index: int) -> StoredLayout:
    """The layout of layer `index` in a folder holding `keys`."""
    prefix = layer_prefix(index)
    return StoredLayout(fused_kda=f"{prefix}self_attn.conv1d.weight" in keys,
                        fused_experts=f"{prefix}mlp.experts.gate_up_proj" in keys,
                        dense_prefix="block_sparse_moe." if f"{prefix}block_sparse_moe.gate_proj.weight" in keys
                        else "mlp.")


def layer_entries(config: HybridLinearConfig, index: int, layout: StoredLayout,
                  canonical: Collection[str]) -> tuple[Entry, ...]:
    """Layer `index`'s table (names relative to the layer); `canonical`: its canonical tensor names."""
    layer_type, mlp_type = config.mixer_types[index], config.mlp_types[index]
    entries = [Entry(f"{name}.weight", IDENTITY, f"{name}.weight")
               for name in ("input_layernorm", "post_attention_layernorm")]
    if layer_type == KDA:
        entries += KDA_FUSED if layout.fused_kda else KDA_HUB
    elif layer_type == MLA:
        entries += _renamed(canonical, OURS_MLA, KIMI_ATTENTION)
    else:
        raise ValueError(f"layer {index}: {layer_type!r} has no Kimi-Linear names")
    if mlp_type == DENSE:
        entries += dense_mlp(layout.dense_prefix)
    elif mlp_type == KIMI_MOE:
        entries += _renamed(canonical, "mlp.", "mlp.") if layout.fused_experts else _moe_hub(layer_config(config,
                                                                                                          index))
    else:
        raise ValueError(f"layer {index}: MLP {mlp_type!r} has no Kimi-Linear names")
    return tuple(entries)


def build_kimi_rows(config: HybridLinearConfig, keys: Collection[str] | None = None) -> list[MapRow]:
    """Kimi's tensor names <-> canonical names for `config`: the layout of each layer as stored among `keys` (a
    folder's tensor names), or the hub layout (None: what the writer writes)."""
    canonical = CanonicalLayout(config)
    rows = instantiate((Entry(EMBEDDINGS, IDENTITY, EMBEDDINGS),), config)
    for index in range(len(config.mixer_types)):
        layout = stored_layout(keys, index) if keys is not None else HUB_LAYOUT
        prefix = layer_prefix(index)
        rows += instantiate(layer_entries(config, index, layout, canonical.layer(index)), layer_config(config, index),
                            prefix, prefix)
    top = [Entry(FINAL_NORM, IDENTITY, FINAL_NORM)]
    if not config.tie_word_embeddings:
        top.append(Entry(LM_HEAD, IDENTITY, LM_HEAD))
    return rows + instantiate(top, config)


__all__ = ["build_kimi_rows", "layer_entries", "stored_layout", "StoredLayout", "HeadsInDim2", "KDA_HUB",
           "KDA_FUSED", "dense_mlp"]
