"""Configuration of the hybrid linear-attention model family.

A decoder of `num_hidden_layers` blocks, each with one token mixer picked by `layer_types`:

- "full_attention":       softmax attention (GQA, optional per-head q/k RMSNorm, partial rotary, optional sigmoid
                          output gate as in Qwen3-Next);
- "sliding_attention":    the same within a window of `sliding_window` tokens;
- "gated_deltanet":       Gated DeltaNet (Qwen3-Next's linear attention);
- "kimi_delta_attention": Kimi Delta Attention (per-channel decay);

followed by a gated MLP, each sub-block pre-normed with RMSNorm and added to the residual stream.

Every switch that changes the math is a field, written explicitly into config.json (defaults are resolved here, never
left for the modeling code to guess).
"""

from __future__ import annotations

from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention", "gated_deltanet", "kimi_delta_attention")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
LINEAR_LAYER_TYPES = ("gated_deltanet", "kimi_delta_attention")
GATE_ACTIVATIONS = ("silu", "sigmoid")

_DEFAULT_LAYER_TYPES = ["gated_deltanet", "gated_deltanet", "gated_deltanet", "full_attention"] * 2


class HybridLinearConfig(PreTrainedConfig):
    r"""
    Args:
        vocab_size, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, hidden_act,
        rms_norm_eps, max_position_embeddings, rope_parameters, tie_word_embeddings, sliding_window,
        initializer_range, attention_bias, attention_dropout, pad_token_id, bos_token_id, eos_token_id, use_cache:
            as in other transformers decoders. `rope_parameters` also holds `partial_rotary_factor`, the fraction of
            each attention head's dims that are rotated (Qwen3-Next: 0.25; Llama-style models: 1.0).
        layer_types (`list[str]`): one mixer per layer, among "full_attention", "sliding_attention",
            "gated_deltanet", "kimi_delta_attention". Default: 3 Gated DeltaNet layers to 1 attention layer, 8 layers.
        num_hidden_layers (`int`, *optional*): follows from `layer_types`; if given, must match its length.
        mlp_bias (`bool`): biases in the MLP projections.
        attention_output_gate (`bool`): Qwen3-Next's gated attention: q_proj also produces a gate per head, and the
            attention output is multiplied by sigmoid(gate).
        attention_qk_norm (`bool`): per-head RMSNorm of queries and keys before the rotary embedding.
        zero_centered_norms (`bool`): the block, final and q/k RMSNorms compute x_hat * (1 + w) with w initialised to 0
            (Qwen3-Next) instead of x_hat * w with w initialised to 1. The gated output norms of GDN/KDA are always
            x_hat * w.
        gdn_num_key_heads, gdn_num_value_heads, gdn_key_head_dim, gdn_value_head_dim (`int`): Gated DeltaNet heads;
            value heads must be a multiple of key heads (value head j reads key head j // (values / keys)).
        gdn_conv_kernel_size (`int`): width of GDN's depthwise causal convolution over [q | k | v].
        gdn_gate_activation (`str`): activation of the output gate of GDN's gated RMSNorm, "silu" (Qwen3-Next,
            Fast-LLM) or "sigmoid".
        gdn_norm_eps (`float`): epsilon of GDN's gated RMSNorm. Defaults to `rms_norm_eps`.
        kda_num_heads, kda_head_dim (`int`): Kimi Delta Attention heads.
        kda_conv_kernel_size (`int`): width of KDA's depthwise causal convolutions.
        kda_gate_activation (`str`): activation of KDA's output gate, "sigmoid" (Kimi Linear) or "silu" (Fast-LLM).
        kda_norm_eps (`float`): epsilon of KDA's gated RMSNorm. Defaults to `rms_norm_eps`.
        fuse_linear_cross_entropy (`bool`): in training (`model.train()`, `labels` given, CUDA tensors, fla
            installed), compute the loss from the hidden states with fla's fused linear + cross-entropy, which does
            not keep the [tokens, vocab] logits for the backward (and holds at most 4 GiB of them at once): the
            same loss, less memory; `outputs.logits` is then None. Evaluation and inference always return logits.
    """

    model_type = "hybrid_linear"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        # GDN and KDA split by heads; their conv kernels, dt_bias, A_log and norm weight stay replicated (each rank
        # slices its heads' rows and sums their gradients: see tensor_parallel_heads.py)
        "layers.*.linear_attn.in_proj_qkvz": "colwise",
        "layers.*.linear_attn.in_proj_ba": "colwise",
        "layers.*.linear_attn.out_proj": "rowwise",
        "layers.*.linear_attn.q_proj": "colwise",
        "layers.*.linear_attn.k_proj": "colwise",
        "layers.*.linear_attn.v_proj": "colwise",
        "layers.*.linear_attn.f_b_proj": "colwise",
        "layers.*.linear_attn.g_b_proj": "colwise",
        "layers.*.linear_attn.b_proj": "colwise",
        "layers.*.linear_attn.o_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 3072
    layer_types: list[str] | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_parameters: dict | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    initializer_range: float = 0.02
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    attention_output_gate: bool = True
    attention_qk_norm: bool = True
    zero_centered_norms: bool = True
    gdn_num_key_heads: int = 8
    gdn_num_value_heads: int = 16
    gdn_key_head_dim: int = 64
    gdn_value_head_dim: int = 64
    gdn_conv_kernel_size: int = 4
    gdn_gate_activation: str = "silu"
    gdn_norm_eps: float | None = None
    kda_num_heads: int = 16
    kda_head_dim: int = 64
    kda_conv_kernel_size: int = 4
    kda_gate_activation: str = "sigmoid"
    kda_norm_eps: float | None = None
    fuse_linear_cross_entropy: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            count = self.num_hidden_layers or len(_DEFAULT_LAYER_TYPES)
            self.layer_types = [_DEFAULT_LAYER_TYPES[i % len(_DEFAULT_LAYER_TYPES)] for i in range(count)]
        self.layer_types = list(self.layer_types)
        if self.num_hidden_layers is None:
            self.num_hidden_layers = len(self.layer_types)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}
        else:
            self.rope_parameters = dict(self.rope_parameters)
        self.rope_parameters.setdefault("partial_rotary_factor", kwargs.pop("partial_rotary_factor", 1.0))
        if self.gdn_norm_eps is None:
            self.gdn_norm_eps = self.rms_norm_eps
        if self.kda_norm_eps is None:
            self.kda_norm_eps = self.rms_norm_eps
        self.validate()  # before the base class, which rewrites some legacy layer-type names
        super().__post_init__(**kwargs)

    # ------------------------------------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Raises a ValueError naming the field and the fix when the configuration is inconsistent."""
        problems = []
        if not isinstance(self.layer_types, list) or not self.layer_types:
            problems.append(f"layer_types must be a non-empty list of {LAYER_TYPES}, got {self.layer_types!r}")
        else:
            unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if unknown:
                problems.append(f"layer_types has unknown entries {unknown}; each entry must be one of {LAYER_TYPES}")
            if self.num_hidden_layers != len(self.layer_types):
                problems.append(
                    f"num_hidden_layers={self.num_hidden_layers} but layer_types has {len(self.layer_types)} entries; "
                    "give one layer type per layer (or leave num_hidden_layers unset)"
                )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim", "gdn_value_head_dim",
                     "gdn_conv_kernel_size", "kda_num_heads", "kda_head_dim", "kda_conv_kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems:
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append(
                    f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                    f"num_key_value_heads={self.num_key_value_heads}"
                )
            if self.gdn_num_value_heads % self.gdn_num_key_heads:
                problems.append(
                    f"gdn_num_value_heads={self.gdn_num_value_heads} must be a multiple of "
                    f"gdn_num_key_heads={self.gdn_num_key_heads}"
                )
            factor = self.rope_parameters.get("partial_rotary_factor")
            if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
                problems.append(f"rope_parameters['partial_rotary_factor'] must be in (0, 1], got {factor!r}")
            elif int(self.head_dim * factor) % 2:
                problems.append(
                    f"head_dim * partial_rotary_factor = {self.head_dim} * {factor} must give an even number of "
                    "rotated dims"
                )
        if "sliding_attention" in (self.layer_types or []) and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            problems.append(
                f"layer_types has 'sliding_attention' layers, so sliding_window must be a positive integer, "
                f"got {self.sliding_window!r}"
            )
        for name in ("gdn_gate_activation", "kda_gate_activation"):
            if getattr(self, name) not in GATE_ACTIVATIONS:
                problems.append(f"{name} must be one of {GATE_ACTIVATIONS}, got {getattr(self, name)!r}")
        if self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act={self.hidden_act!r} is not a known activation")
        if problems:
            raise ValueError("Invalid HybridLinearConfig: " + "; ".join(problems) + ".")

    # ------------------------------------------------------------------------------------------------- helpers

    @property
    def partial_rotary_factor(self) -> float:
        return self.rope_parameters["partial_rotary_factor"]

    def layers_of_type(self, *types: str) -> list[int]:
        """Indices of the layers whose mixer is one of `types`."""
        return [i for i, t in enumerate(self.layer_types) if t in types]


__all__ = ["HybridLinearConfig", "LAYER_TYPES"]
