"""Reading Fast-LLM's model config (metadata.yaml `config.base_model`): typed getters bounded by the stored weights,
and the readers and writers of the sub-configs several mixers share (linear layers' biases, the short convolution,
the gated output norm).

Fast-LLM omits fields left at their default. The defaults used here are the ones documented for the fixtures (conv
kernel 4; gated norms: silu gate, epsilon 1e-5; block norms epsilon 1e-5) and Fast-LLM's own (a linear layer's
`bias.enabled` falls back to its module's `add_linear_biases`, itself true by default, except in the GDN and KDA
mixers, whose layers default to no bias: `default_add_bias=False` in fast_llm/layers/ssm/gdn.py and kda.py). Every
refusal names the dotted path of the field, which holds the name of the Fast-LLM block (`decoder.blocks.<name>`).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConversionError
from ..pipeline import TensorCensus
from ..untrusted import REQUIRED, Fields, clip

METADATA = "metadata.yaml"
DEFAULT_NORM_EPS = 1e-5
DEFAULT_CONV_KERNEL = 4

# Keys that only matter for training (initialisation, learning rates, dropout, losses, kernels): safe to ignore.
TRAINING_ONLY = frozenset({
    "initialization", "lr_scale", "dropout", "apply_peft", "implementation", "use_flash_attention",
    "recompute_level", "debug", "activation_distillation_factor", "distillation_model", "losses",
    "cross_entropy_implementation", "cross_entropy_splits", "dpo_reference_model", "enable_dpo", "dpo_beta",
    "logit_z_loss", "language_model_loss_factor", "distillation_loss_factor", "teacher_softmax_temperature",
    "sequence_first", "full_precision_residual", "num_position_embeddings", "word_embeddings", "output_weight",
    "dt_bias_weight", "a_log_weight", "prediction_loss_coefficient", "distillation_loss_weight",
    "vocab_parallel",  # (how the embeddings are split over tensor-parallel ranks)
})


class MetadataFields(Fields):
    """A `config.base_model` mapping of metadata.yaml, read through typed getters; sizes are bounded by what the
    stored tensors can hold (`census`), so that no size read here can make a later table or allocation explode."""

    def __init__(self, data: Any, path: str, census: TensorCensus | None = None):
        super().__init__(data, path, METADATA)
        self.census = census

    def _child(self, data: Any, path: str) -> MetadataFields:
        return MetadataFields(data, path, self.census)

    def missing(self, key: str, hint: str = "") -> ConversionError:
        return ConversionError(
            f"metadata.yaml does not give {self.where(key)}. Fast-LLM omits fields left at their default and this "
            f"converter does not assume that default; add the value the model was trained with to metadata.yaml"
            f"{hint}."
        )

    def size(self, key: str, default: Any = REQUIRED, hint: str = "") -> int:
        """A positive integer no larger than the number of weight elements stored (a dimension of some tensor)."""
        census = self.census
        return self.integer(key, default, minimum=1, maximum=census.elements if census else None,
                            too_large=census.elements_phrase if census else "", hint=hint)

    def finish(self, extra_ignorable: frozenset = frozenset()) -> None:
        unknown = self.unread(TRAINING_ONLY | extra_ignorable)
        if unknown:
            raise ConversionError(
                f"metadata.yaml: field(s) {clip(', '.join(unknown))} not supported by this converter "
                "(they may change the model's math, and HybridLinearConfig cannot express them)."
            )


def check_no_bias(layer: MetadataFields) -> None:
    """A GDN/KDA linear or convolution sub-config (`qkv_projection_layer`, `convolution_layer`, ...), whose bias
    Fast-LLM leaves off unless `bias.enabled` says otherwise: no bias, nothing else that changes the math."""
    bias = layer.sub("bias")
    enabled = bias.boolean("enabled", None)
    bias.finish()
    if enabled:
        raise ConversionError(f"metadata.yaml: {layer.path} has a bias ({bias.where('enabled')} is true); the same "
                              "layer of HybridLinearConfig's mixer has none (nor do Qwen3-Next's and Kimi's), so only "
                              "a model trained without this bias converts.")
    weight = layer.sub("weight")
    weight.finish()
    layer.finish()


def linear_layers_without_bias(mixer: MetadataFields, names: tuple[str, ...]) -> None:
    """The linear layers `names` of a GDN/KDA mixer: Fast-LLM gives them no bias unless `bias.enabled` says so."""
    for name in names:
        check_no_bias(mixer.sub(name))


def linear_biases(module: MetadataFields, names: tuple[str, ...]) -> dict[str, bool]:
    """Whether each of the linear layers `names` of `module` has a bias: its `bias.enabled`, else the module's
    `add_linear_biases`, which Fast-LLM defaults to true (OptionalParameterConfig.get_parameter)."""
    default = module.boolean("add_linear_biases", True)
    enabled = {}
    for name in names:
        layer = module.sub(name)
        bias = layer.sub("bias")
        explicit = bias.boolean("enabled", None)
        bias.finish()
        layer.sub("weight").finish()
        layer.finish()
        enabled[name] = default if explicit is None else explicit
    return enabled


def shared_bias(module: MetadataFields, names: tuple[str, ...], field: str) -> bool:
    """Whether the linear layers `names` of `module` have biases (`linear_biases`). Our model has one switch
    (`field`) for all of them, so they must agree."""
    enabled = linear_biases(module, names)
    if len(set(enabled.values())) > 1:
        listing = ", ".join(f"{name}: {'bias' if on else 'no bias'}" for name, on in enabled.items())
        raise ConversionError(f"metadata.yaml: {module.path} mixes linear layers with and without biases ({listing}); "
                              f"HybridLinearConfig has one {field} switch for them, so give them all the same "
                              "bias.enabled.")
    return next(iter(enabled.values()))


def convolution(mixer: MetadataFields) -> int:
    """The short convolution's kernel size (silu, no bias: the only kind our GDN/KDA mixers run)."""
    conv = mixer.sub("convolution_layer")
    kernel = conv.size("kernel_size", DEFAULT_CONV_KERNEL)
    conv.expect("activation", ("silu", None), None, "the short convolution's activation")
    check_no_bias(conv)
    return kernel


def gated_norm(mixer: MetadataFields) -> tuple[float, str]:
    """The gated output norm: (epsilon, gate activation)."""
    norm = mixer.sub("normalization")
    norm.expect("type", ("gated_rms_norm", None), None, "the output norm type")
    eps = float(norm.number("epsilon", DEFAULT_NORM_EPS, positive=True))
    activation = norm.name("activation", ("silu", "sigmoid"), "silu")
    norm.sub("weight").finish()
    norm.finish()
    return eps, activation


def gated_norm_config(eps: float, activation: str) -> dict[str, Any]:
    """Fast-LLM's config of the gated output norm (the activation only when not its default)."""
    norm: dict[str, Any] = {"type": "gated_rms_norm", "epsilon": eps}
    if activation != "silu":
        norm["activation"] = activation
    return norm


__all__ = ["METADATA", "DEFAULT_NORM_EPS", "DEFAULT_CONV_KERNEL", "TRAINING_ONLY", "MetadataFields", "check_no_bias",
           "linear_layers_without_bias", "linear_biases", "shared_bias", "convolution", "gated_norm",
           "gated_norm_config"]
