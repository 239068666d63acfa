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

Every such field is validated (`HybridLinearConfig.validate`), at construction, at load (overrides included) and before
config.json is written, with one ValueError naming each bad field, the problem and the fix: a bad value must fail
here, in words, not later as a NaN in the logits (a zero epsilon, a NaN rope_theta), a crash inside a mixer (a rope
type the rotary embedding cannot run, a string where a bool belongs: "false" is truthy), or an allocation of
terabytes (sizes are bounded before any tensor exists). Messages show user-supplied values through a bounded repr,
so a hostile config.json cannot make them huge.
"""

from __future__ import annotations

import math
from typing import Any

from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig

from .shown_values import brief

LAYER_TYPES = ("full_attention", "sliding_attention", "gated_deltanet", "kimi_delta_attention")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
LINEAR_LAYER_TYPES = ("gated_deltanet", "kimi_delta_attention")
GATE_ACTIVATIONS = ("silu", "sigmoid")

_DEFAULT_LAYER_TYPES = ["gated_deltanet", "gated_deltanet", "gated_deltanet", "full_attention"] * 2

# Generous bounds that no real model reaches, so that a hostile config fails in validate(), before any allocation.
MAX_LAYERS = 100_000
MAX_PARAMETERS = 2**40  # in the embeddings, or in one decoder layer

# The rope types the rotary embedding runs (transformers' ROPE_INIT_FUNCTIONS, "default" computed here), each with the
# keys its init function reads without a default. "proportional" is left out: it rotates the whole head with zero
# frequencies on the pass-through dims, pairing dims differently from this model's partial rotary.
ROPE_REQUIRED_KEYS = {
    "default": ("rope_theta",),
    "linear": ("rope_theta", "factor"),
    "dynamic": ("rope_theta", "factor"),
    "yarn": ("rope_theta", "factor"),
    "longrope": ("rope_theta", "short_factor", "long_factor"),
    "llama3": ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"),
}

_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim", "gdn_value_head_dim",
                "gdn_conv_kernel_size", "kda_num_heads", "kda_head_dim", "kda_conv_kernel_size",
                "max_position_embeddings")
_BOOL_FIELDS = ("attention_bias", "mlp_bias", "attention_output_gate", "attention_qk_norm", "zero_centered_norms",
                "tie_word_embeddings", "fuse_linear_cross_entropy", "use_cache")

# The fields a layer's weight count grows with (named when the count is over MAX_PARAMETERS).
_ATTENTION_SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
_LAYER_SIZE_FIELDS = {
    "full_attention": _ATTENTION_SIZE_FIELDS,
    "sliding_attention": _ATTENTION_SIZE_FIELDS,
    "gated_deltanet": ("hidden_size", "intermediate_size", "gdn_num_key_heads", "gdn_num_value_heads",
                       "gdn_key_head_dim", "gdn_value_head_dim", "gdn_conv_kernel_size"),
    "kimi_delta_attention": ("hidden_size", "intermediate_size", "kda_num_heads", "kda_head_dim",
                             "kda_conv_kernel_size"),
}

def _distinct(values: list) -> list:
    """The distinct values in order of appearance (unhashable ones compared by repr), a few at most."""
    seen, kept = set(), []
    for value in values:
        key = brief(value)
        if key not in seen:
            seen.add(key)
            kept.append(value)
        if len(kept) == 6:
            break
    return kept


def _is_int(value: Any, allow_none: bool = False) -> bool:
    return (value is None and allow_none) or (isinstance(value, int) and not isinstance(value, bool))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return _is_number(value) and (isinstance(value, int) or math.isfinite(value))  # (huge ints overflow isfinite)


def _positive_int_problem(name: str, value: Any, limit: int | None = None) -> str | None:
    if not _is_int(value) or value <= 0:
        return f"{name} must be a positive integer, got {brief(value)}"
    if limit is not None and value > limit:
        return f"{name} must be at most {brief(limit)}, got {brief(value)}"
    return None


def _number_problems(name: str, value: Any, low: float | None = None, high: float | None = None,
                     low_inclusive: bool = True) -> list[str]:
    """[] when value is a finite real number in [low, high) (or (low, high) without low_inclusive), else the problem."""
    if not _is_finite_number(value):
        return [f"{name} must be a finite number, got {brief(value)}"]
    too_low = low is not None and (value < low or (value == low and not low_inclusive))
    if too_low or (high is not None and value >= high):
        interval = f"{'[' if low_inclusive else '('}{low if low is not None else '-inf'}, {high or 'inf'})"
        return [f"{name} must be in {interval}, got {brief(value)}"]
    return []


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
        self._resolve_defaults(kwargs)
        self.validate()  # before the base class, which rewrites some legacy layer-type names
        super().__post_init__(**kwargs)
        self.validate()  # again: the base class standardises rope_parameters (adds keys some rope types read)

    def _resolve_defaults(self, kwargs: dict) -> None:
        """Fills the fields whose defaults follow from others; leaves malformed values for validate() to name."""
        if self.layer_types is None and _is_int(self.num_hidden_layers, allow_none=True):
            count = self.num_hidden_layers or len(_DEFAULT_LAYER_TYPES)
            if count <= MAX_LAYERS:  # never build a list for a hostile layer count
                self.layer_types = [_DEFAULT_LAYER_TYPES[i % len(_DEFAULT_LAYER_TYPES)] for i in range(count)]
        if isinstance(self.layer_types, tuple):
            self.layer_types = list(self.layer_types)
        if self.num_hidden_layers is None and isinstance(self.layer_types, list) and self.layer_types:
            self.num_hidden_layers = len(self.layer_types)
        legacy = kwargs.pop("rope_scaling", None)  # transformers' older name, taken as the base class would
        if self.rope_parameters is None and legacy is not None:
            self.rope_parameters = legacy
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "partial_rotary_factor": 0.25}
        if isinstance(self.rope_parameters, dict):
            self.rope_parameters = dict(self.rope_parameters)
            self.rope_parameters.setdefault("rope_type", "default")
            self.rope_parameters.setdefault("rope_theta", kwargs.pop("rope_theta", 10_000.0))
            self.rope_parameters.setdefault("partial_rotary_factor", kwargs.pop("partial_rotary_factor", 1.0))
        if self.gdn_norm_eps is None:
            self.gdn_norm_eps = self.rms_norm_eps
        if self.kda_norm_eps is None:
            self.kda_norm_eps = self.rms_norm_eps

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As the base class, then validates again: keyword overrides are set after construction."""
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        config.validate()
        return loaded

    # ------------------------------------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Raises one ValueError naming every invalid field, the problem and the fix.

        This overrides the hook of transformers' strict dataclass config, which calls `validate()` when a config is
        saved (so a config mutated after construction is not written invalid); `__post_init__` and `from_dict` call
        it too. The fields are checked one by one first; the relations between them only when the fields they read
        are sound, so one bad value gives one message, not a cascade."""
        problems = self._field_problems()
        if not problems:
            problems = self._relation_problems()
        if problems:
            raise ValueError("Invalid HybridLinearConfig: " + "; ".join(problems) + ".")

    def _field_problems(self) -> list[str]:
        problems = [problem for name in _SIZE_FIELDS
                    if (problem := _positive_int_problem(name, getattr(self, name), MAX_PARAMETERS))]
        problems += self._layer_types_problems()
        for name in ("rms_norm_eps", "gdn_norm_eps", "kda_norm_eps"):
            problems += _number_problems(name, getattr(self, name), low=0.0, low_inclusive=False)
        problems += _number_problems("initializer_range", self.initializer_range, low=0.0)
        problems += _number_problems("attention_dropout", self.attention_dropout, low=0.0, high=1.0)
        problems += [f"{name} must be True or False (a bool), got {brief(getattr(self, name))}"
                     for name in _BOOL_FIELDS if not isinstance(getattr(self, name), bool)]
        window = self.sliding_window
        if window is not None and (problem := _positive_int_problem("sliding_window", window)):
            problems.append(problem + " (or None when no layer is 'sliding_attention')")
        for name in ("gdn_gate_activation", "kda_gate_activation"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in GATE_ACTIVATIONS:
                problems.append(f"{name} must be one of {GATE_ACTIVATIONS}, got {brief(getattr(self, name))}")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act={brief(self.hidden_act)} is not a known activation; use e.g. 'silu'")
        problems += self._rope_problems()
        return problems

    def _layer_types_problems(self) -> list[str]:
        layers = self.num_hidden_layers
        if isinstance(self.layer_types, list) and len(self.layer_types) > MAX_LAYERS:
            return [f"layer_types has {len(self.layer_types)} entries, more than the limit of {MAX_LAYERS} layers"]
        if layers is not None and (problem := _positive_int_problem("num_hidden_layers", layers, MAX_LAYERS)):
            return [problem]
        if not isinstance(self.layer_types, list) or not self.layer_types:
            return [f"layer_types must be a non-empty list of {LAYER_TYPES}, got {brief(self.layer_types)}"]
        unknown = [t for t in self.layer_types if not isinstance(t, str) or t not in LAYER_TYPES]
        problems = []
        if unknown:
            problems.append(f"layer_types has unknown entries {brief(_distinct(unknown))}; each entry must be one of "
                            f"{LAYER_TYPES}")
        if layers is not None and layers != len(self.layer_types):
            problems.append(f"num_hidden_layers={layers} but layer_types has {len(self.layer_types)} entries; "
                            "give one layer type per layer (or leave num_hidden_layers unset)")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            problems.append("layer_types has 'sliding_attention' layers, so sliding_window must be a positive integer, "
                            "got None")
        return problems

    def _rope_problems(self) -> list[str]:
        rope = self.rope_parameters
        if not isinstance(rope, dict):
            return [f"rope_parameters must be a dict with rope_type and rope_theta, got {brief(rope)}"]
        rope_type = rope.get("rope_type")
        if not isinstance(rope_type, str) or rope_type not in ROPE_REQUIRED_KEYS:
            known = tuple(ROPE_REQUIRED_KEYS)
            return [(f"rope_parameters['rope_type'] must be one of {known} (the types this model's rotary embedding "
                     f"runs), got {brief(rope_type)}")]
        missing = [key for key in ROPE_REQUIRED_KEYS[rope_type] if key not in rope]
        if missing:
            return [f"rope_parameters with rope_type {rope_type!r} needs the keys {missing}"]
        problems = []
        for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
            if key in rope and not (key == "attention_factor" and rope[key] is None):
                problems += _number_problems(f"rope_parameters['{key}']", rope[key], low=0.0, low_inclusive=False)
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                problems += _number_problems(f"rope_parameters['{key}']", rope[key])
        if rope.get("original_max_position_embeddings") is not None:
            problem = _positive_int_problem("rope_parameters['original_max_position_embeddings']",
                                            rope["original_max_position_embeddings"])
            problems += [problem] if problem else []
        factor = rope.get("partial_rotary_factor")
        if not _is_number(factor) or not 0 < factor <= 1:
            problems.append(f"rope_parameters['partial_rotary_factor'] must be in (0, 1], got {brief(factor)}")
        return problems

    def _relation_problems(self) -> list[str]:
        """Checks between fields; each field is already known to be well typed."""
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.gdn_num_value_heads % self.gdn_num_key_heads:
            problems.append(f"gdn_num_value_heads={self.gdn_num_value_heads} must be a multiple of "
                            f"gdn_num_key_heads={self.gdn_num_key_heads}")
        factor = self.rope_parameters["partial_rotary_factor"]
        rotated = int(self.head_dim * factor)
        rope = self.rope_parameters
        least = 4 if rope["rope_type"] == "dynamic" else 2  # dynamic NTK scales the base by a power dim / (dim - 2)
        if rotated % 2 or rotated < least:
            problems.append(f"head_dim * partial_rotary_factor = {self.head_dim} * {factor} must give an even number "
                            f"of rotated dims, at least {least} for rope_type {rope['rope_type']!r}")
        if rope["rope_type"] == "llama3" and not rope["high_freq_factor"] > rope["low_freq_factor"]:
            problems.append("rope_parameters['high_freq_factor'] must be greater than ['low_freq_factor'] (llama3)")
        for key in ("short_factor", "long_factor"):
            if key in rope and not (isinstance(rope[key], list) and len(rope[key]) == rotated // 2
                                    and all(_is_finite_number(x) for x in rope[key])):
                problems.append(f"rope_parameters['{key}'] must be a list of {rotated // 2} finite numbers (one per "
                                f"rotated pair), got {brief(rope[key])}")
        problems += self._token_id_problems()
        problems += self._size_problems()
        return problems

    def _token_id_problems(self) -> list[str]:
        problems = []
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if name == "eos_token_id" and isinstance(value, list) and value else [value]
            if value is not None and not all(_is_int(i) and 0 <= i < self.vocab_size for i in ids):
                kind = "an integer or a non-empty list of integers" if name == "eos_token_id" else "an integer"
                problems.append(f"{name} must be None or {kind} in [0, vocab_size={self.vocab_size}), "
                                f"got {brief(value)}")
        return problems

    def _size_problems(self) -> list[str]:
        """Bounds the weights a model of this config would allocate, so a hostile config fails here, not in torch."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        counts = {"the embeddings": (("vocab_size", "hidden_size"), embeddings)}
        for kind in dict.fromkeys(self.layer_types):
            counts[f"one {kind} layer"] = (_LAYER_SIZE_FIELDS[kind], self._layer_parameter_count(kind))
        over = {what: (fields, count) for what, (fields, count) in counts.items() if count > MAX_PARAMETERS}
        if not over:
            return []
        fields = dict.fromkeys(field for names, _ in over.values() for field in names)
        holding = ", ".join(f"{what} {brief(count)}" for what, (_, count) in over.items())
        return [f"the sizes give more weights than the limit of 2**40 ({holding}): reduce {', '.join(fields)}"]

    def _layer_parameter_count(self, layer_type: str) -> int:
        """Weights of one decoder layer (norms and biases left out: they are small next to the projections)."""
        H = self.hidden_size
        count = 3 * H * self.intermediate_size
        if layer_type in ATTENTION_LAYER_TYPES:
            q = self.num_attention_heads * self.head_dim
            count += H * (q * 2 + 2 * self.num_key_value_heads * self.head_dim) + q * H
        elif layer_type == "gated_deltanet":
            keys = self.gdn_num_key_heads * self.gdn_key_head_dim
            values = self.gdn_num_value_heads * self.gdn_value_head_dim
            count += H * (2 * keys + 2 * values + 2 * self.gdn_num_value_heads) + values * H
            count += (2 * keys + values) * self.gdn_conv_kernel_size
        elif layer_type == "kimi_delta_attention":
            inner = self.kda_num_heads * self.kda_head_dim
            count += H * 5 * inner + inner * H + 3 * inner * self.kda_conv_kernel_size
        return count

    # ------------------------------------------------------------------------------------------------- helpers

    @property
    def partial_rotary_factor(self) -> float:
        return self.rope_parameters.get("partial_rotary_factor", 1.0) if isinstance(self.rope_parameters, dict) else 1.0

    def layers_of_type(self, *types: str) -> list[int]:
        """Indices of the layers whose mixer is one of `types`."""
        return [i for i, t in enumerate(self.layer_types) if t in types]


__all__ = ["HybridLinearConfig", "LAYER_TYPES"]
