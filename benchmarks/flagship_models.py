"""The released flagships at their real shapes with random weights, built on the device without a download: this
family's model beside transformers' own class with the same weights.

Models (their released config.json fields are data here: `QWEN3_NEXT_80B`, `KIMI_LINEAR_48B`):
- Qwen3-Next-80B-A3B: 48 layers, 3 Gated DeltaNet : 1 gated attention (layers 4, 8, ... attention), hidden 2048,
  512 experts top-10 of width 512 plus a shared expert of width 512 behind its sigmoid gate, GDN 16 key / 32 value
  heads of 128, attention 16 query / 2 KV heads of 256, vocabulary 151,936. On one H200 it runs as the released
  fine-grained FP8 build (`qwen3_next_fp8_setting`): every Linear and the experts in float8_e4m3fn with one float32
  scale per 128 x 128 block, the embeddings, lm_head, norms, routers, shared expert gate and GDN's A_log, dt_bias,
  conv1d, in_proj_ba and norm in bfloat16.
- Kimi-Linear-48B-A3B: 27 layers, 3 KDA : 1 MLA (the released layer lists), hidden 2304, 256 experts top-8 of width
  1024 plus a shared expert, KDA 32 heads of 128, MLA kv_lora_rank 512, vocabulary 163,840; bfloat16 (~96 GB).
`layers=N` keeps the first N layers (the released pattern), `tiny=True` gives the same layouts in miniature (FP8
with 16 x 16 blocks, so a tiny weight spans several blocks) for CPU tests.

How a model is built (never the whole model on the CPU): our config comes from the fields through the converter's
own config mapping (what a downloaded folder would give); the model is made on the meta device, its bytes are
summed from the shapes (`model_bytes`) and checked against the device's free memory (`check_fits`: one line and
exit when it does not fit), then `to_empty` on the device and every tensor drawn there, layer by layer:

    tensor named n  <-  rule(n) drawn from a generator seeded by (seed, crc32(n))    (`draw`)

The names are transformers' checkpoint names, so ours and transformers' models get the same weights one at a time
(never both on the device): Qwen3-Next's names are ours too; Kimi-Linear's reach ours through the kimi_linear
converter's rows (`build_kimi_rows`, each row's `converter.forward`). A weight the FP8 setting quantizes is drawn
in bfloat16 (expert by expert for the experts) and quantized per block (`kernels_fp8.quantize_block_fp8`):

    scale[b] = amax(|W_b|) / 448 (float32),   W_fp8 = e4m3(W_b / scale[b]),   W ~ W_fp8 * scale (`weight_scale_inv`)

so that the largest value of each block lands on e4m3's largest finite value, 448, as the released build does.
"""

from __future__ import annotations

import copy
import re
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import (
    KimiLinearConfig,
    KimiLinearForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion.kimi_linear.config import kimi_to_hybrid_config
from hybrid_linear_models.conversion.kimi_linear.parameters import build_kimi_rows
from hybrid_linear_models.conversion.qwen3_next.config import (
    qwen3_next_to_hybrid_config,
)
from hybrid_linear_models.fp8_layers import Fp8Experts, Fp8Linear
from hybrid_linear_models.kernels_fp8 import quantize_block_fp8

FP8_BLOCK = (128, 128)  # the released build's weight_block_size
TINY_FP8_BLOCK = (16, 16)

# Qwen3-Next-80B-A3B's released config.json (the fields that shape the model).
QWEN3_NEXT_80B: dict = {
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "intermediate_size": 5120, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "full_attention_interval": 4,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
}
# Kimi-Linear-48B-A3B's released config.json (the fields that shape the model; 1-indexed layer lists).
_KIMI_MLA_LAYERS = [4, 8, 12, 16, 20, 24, 27]
KIMI_LINEAR_48B: dict = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
    "intermediate_size": 9216, "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts": 256, "num_experts_per_token": 8, "moe_intermediate_size": 1024, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.446, "num_expert_group": 1,
    "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "model_max_length": 1048576,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                           "full_attn_layers": _KIMI_MLA_LAYERS,
                           "kda_layers": [n for n in range(1, 28) if n not in _KIMI_MLA_LAYERS]},
}
# The same layouts in miniature (CPU tests, `bench_flagships.py --tiny`).
QWEN3_NEXT_TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8, "intermediate_size": 96,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "max_position_embeddings": 4096}
KIMI_LINEAR_TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8, "intermediate_size": 96,
                    "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8, "v_head_dim": 8, "num_experts": 16, "num_experts_per_token": 4,
                    "moe_intermediate_size": 32, "model_max_length": 4096,
                    "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4}}
# kept in bfloat16 by the released FP8 build, as module names (transformers' matching: fp8_settings)
QWEN3_NEXT_FP8_KEPT = ("lm_head", "model.embed_tokens", "model.norm", r"model\.layers\.\d+\.input_layernorm",
                       r"model\.layers\.\d+\.post_attention_layernorm", r"model\.layers\.\d+\.linear_attn\.in_proj_ba",
                       r"model\.layers\.\d+\.linear_attn\.conv1d", r"model\.layers\.\d+\.linear_attn\.norm",
                       r"model\.layers\.\d+\.mlp\.gate", r"model\.layers\.\d+\.mlp\.shared_expert_gate",
                       r"model\.layers\.\d+\.self_attn\.[qk]_norm")


def _first_layers(types: list[str], layers: int | None) -> list[str]:
    if layers is None:
        return types
    if not 1 <= layers <= len(types):
        raise SystemExit(f"{layers} layers asked: the model has {len(types)} layers; ask for 1 to {len(types)}.")
    return types[:layers]


def qwen3_next_fields(layers: int | None = None, tiny: bool = False, fp8: bool = False) -> dict:
    """Qwen3-Next-80B-A3B's config.json fields: whole, its first `layers` layers, or in miniature (`tiny`); with
    the released FP8 build's quantization_config (`fp8`)."""
    fields = copy.deepcopy(QWEN3_NEXT_80B)
    if tiny:
        fields.update(QWEN3_NEXT_TINY)
        fields["layer_types"] = fields["layer_types"][: fields["num_hidden_layers"]]
    fields["layer_types"] = _first_layers(fields["layer_types"], layers)
    fields["num_hidden_layers"] = len(fields["layer_types"])
    if fp8:
        fields["quantization_config"] = qwen3_next_fp8_setting(TINY_FP8_BLOCK if tiny else FP8_BLOCK)
    return fields


def qwen3_next_fp8_setting(block: tuple[int, int] = FP8_BLOCK) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic",
            "modules_to_not_convert": list(QWEN3_NEXT_FP8_KEPT)}


def kimi_linear_fields(layers: int | None = None, tiny: bool = False) -> dict:
    """Kimi-Linear-48B-A3B's config.json fields: whole, its first `layers` layers, or in miniature (`tiny`, 8 layers
    with MLA at 4 and 8)."""
    fields = copy.deepcopy(KIMI_LINEAR_48B)
    linear = fields["linear_attn_config"]
    if tiny:
        fields.update({k: v for k, v in KIMI_LINEAR_TINY.items() if k != "linear_attn_config"})
        linear.update(KIMI_LINEAR_TINY["linear_attn_config"])
    total = fields["num_hidden_layers"]
    mla = [4, 8] if tiny else linear["full_attn_layers"]
    types = _first_layers(["full_attention" if n in mla else "linear_attention" for n in range(1, total + 1)], layers)
    fields["num_hidden_layers"] = len(types)
    linear["full_attn_layers"] = [n for n, t in enumerate(types, 1) if t == "full_attention"]
    linear["kda_layers"] = [n for n, t in enumerate(types, 1) if t == "linear_attention"]
    return fields


def ours_config(fields: dict):
    """Our config for a Qwen3-Next or Kimi-Linear config.json, through the converter's config mapping."""
    if fields["model_type"] == "qwen3_next":
        return qwen3_next_to_hybrid_config(fields, "the flagship's Qwen3-Next fields")[0]
    return kimi_to_hybrid_config(copy.deepcopy(fields), "the flagship's Kimi-Linear fields")


def theirs_config(fields: dict):
    """transformers' config for the same fields (its own classes read the released spellings)."""
    kwargs = {k: v for k, v in fields.items() if k not in ("model_type", "quantization_config")}
    if fields["model_type"] == "qwen3_next":
        return Qwen3NextConfig(**kwargs)
    return KimiLinearConfig(**kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=2)


# ------------------------------------------------------------------------------------------------ drawing weights


def _zero_centered(name: str, model_type: str) -> bool:
    """Qwen3-Next's RMSNorms compute x_hat * (1 + w), except GDN's gated norm (x_hat * w); Kimi-Linear's x_hat * w."""
    return model_type == "qwen3_next" and not name.endswith("linear_attn.norm.weight")


def _rule(name: str, model_type: str) -> Callable[[torch.Tensor, torch.Generator], None]:
    """How the tensor named `name` is drawn (in place into a float32 tensor): the rules of a freshly initialised
    model, with norms and biases given small random offsets so that a mixed-up name shows in the logits."""
    if name.endswith("A_log"):
        return lambda t, g: t.uniform_(1, 16, generator=g).log_()
    if "conv1d" in name or name.endswith("conv.weight"):
        return lambda t, g: t.uniform_(-0.5, 0.5, generator=g)  # kernel 4: bound 4 ** -0.5
    if re.search(r"norm\.weight$|layernorm\.weight$", name):
        base = 0.0 if _zero_centered(name, model_type) else 1.0
        return lambda t, g: t.normal_(base, 0.02, generator=g)
    if name.endswith(("dt_bias", "e_score_correction_bias", ".bias")):
        return lambda t, g: t.normal_(0.0, 0.1, generator=g)
    return lambda t, g: t.normal_(0.0, 0.02, generator=g)


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 4_294_967_311 + zlib.crc32(name.encode()))


def draw(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, model_type: str,
         seed: int = 0) -> Iterator[torch.Tensor]:
    """The tensor named `name`, drawn on `device` by its rule, slice by slice along the first dimension of a 3-D
    tensor (the experts: one expert in float32 at a time), each slice in `dtype`."""
    rule, generator = _rule(name, model_type), _generator(name, seed, device)
    for part in (shape[1:],) * shape[0] if len(shape) == 3 else (shape,):
        values = torch.empty(part, dtype=torch.float32, device=device)
        rule(values, generator)
        yield values.to(dtype)


def drawn(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, model_type: str,
          seed: int = 0) -> torch.Tensor:
    parts = list(draw(name, shape, dtype, device, model_type, seed))
    return torch.stack(parts) if len(shape) == 3 else parts[0]


# ------------------------------------------------------------------------------------------------ building models


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (each once), from their shapes and dtypes: on meta, what the device
    will hold."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def check_fits(needed: int, device: torch.device, what: str) -> None:
    """One line and exit when `needed` bytes exceed the CUDA device's free memory (on the CPU: no check)."""
    print(f"{what}: {needed / 2**30:.2f} GiB of weights and buffers", flush=True)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if needed > free:
            raise SystemExit(f"{what} needs {needed / 2**30:.1f} GiB and {device} has {free / 2**30:.1f} GiB free; "
                             "ask for fewer of its layers (the script's layer option) or free the device.")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    kept = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(kept)


def _on_meta(make: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"), _default_dtype(dtype):
        return make()


def _materialised(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` (on meta) on `device`, its parameters uninitialised, its rotary tables computed."""
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
                model._init_weights(module)
    return model


def _fill_fp8(module: Fp8Linear | Fp8Experts, prefix: str, model_type: str, seed: int) -> None:
    """Each FP8 weight of `module` drawn in bfloat16 and quantized per block, expert by expert."""
    for name in ("weight", "gate_up_proj", "down_proj"):
        param = getattr(module, name, None)
        if param is None:
            continue
        scale = getattr(module, name + "_scale_inv")
        full = prefix + (".weight" if name == "weight" else f".{name}")
        parts = draw(full, tuple(param.shape), torch.bfloat16, param.device, model_type, seed)
        for index, part in enumerate(parts):
            fp8, scale_inv = quantize_block_fp8(part, module.block)
            if param.dim() == 3:
                param.data[index], scale.data[index] = fp8, scale_inv
            else:
                param.data.copy_(fp8)
                scale.data.copy_(scale_inv)


def _drawn_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers a model draws: all but the rotary tables (computed)."""
    tensors = dict(model.named_parameters())
    tensors.update((name, buffer) for name, buffer in model.named_buffers() if "inv_freq" not in name)
    return tensors


def _fill_plain(model: nn.Module, model_type: str, seed: int, skip: set[str]) -> None:
    for name, param in _drawn_tensors(model).items():
        if name in skip:
            continue
        if param.dim() == 3:
            for index, part in enumerate(draw(name, tuple(param.shape), param.dtype, param.device, model_type, seed)):
                param.data[index] = part
        else:
            param.data.copy_(drawn(name, tuple(param.shape), param.dtype, param.device, model_type, seed))


def theirs_on_meta(fields: dict, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """transformers' model for `fields` on the meta device (shapes and dtypes, no memory)."""
    cls = Qwen3NextForCausalLM if fields["model_type"] == "qwen3_next" else KimiLinearForCausalLM
    return _on_meta(lambda: cls(theirs_config(fields)), dtype)


def ours_on_meta(fields: dict, dtype: torch.dtype = torch.bfloat16) -> HybridLinearForCausalLM:
    """Our model for `fields` on the meta device (FP8 layers where its quantization_config says)."""
    config = ours_config(fields)
    return _on_meta(lambda: HybridLinearForCausalLM(config), dtype)


def build_theirs(fields: dict, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
                 ) -> nn.Module:
    """transformers' Qwen3NextForCausalLM / KimiLinearForCausalLM for `fields`, drawn on `device`."""
    model = theirs_on_meta(fields, dtype)
    check_fits(model_bytes(model), device, f"transformers' {type(model).__name__}")
    with torch.no_grad():
        _fill_plain(_materialised(model, device), fields["model_type"], seed, skip=set())
    return model.eval()


def build_ours(fields: dict, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
               ) -> HybridLinearForCausalLM:
    """This family's model for `fields` (FP8 where its quantization_config says), drawn on `device` with the same
    values `build_theirs` gives transformers' model (the FP8 weights: those values quantized)."""
    model, model_type = ours_on_meta(fields, dtype), fields["model_type"]
    check_fits(model_bytes(model), device, f"ours ({model_type}{', FP8' if model.config.block_fp8 else ''})")
    _materialised(model, device)
    with torch.no_grad():
        fp8 = {name: module for name, module in model.named_modules() if isinstance(module, Fp8Linear | Fp8Experts)}
        for name, module in fp8.items():
            _fill_fp8(module, name, model_type, seed)
        quantized = {f"{name}.{p}" for name, module in fp8.items() for p, _ in module.named_parameters()}
        if model_type == "qwen3_next":  # the same names as transformers'
            _fill_plain(model, model_type, seed, skip=quantized)
        else:
            _fill_through_rows(model, fields, seed, dtype)
    return model.eval()


def _fill_through_rows(model: HybridLinearForCausalLM, fields: dict, seed: int, dtype: torch.dtype) -> None:
    """Kimi-Linear: each converter row's transformers tensors drawn by their names (shapes from transformers' model
    on meta), converted to ours."""
    theirs = theirs_on_meta(fields, dtype)
    shapes = {name: tuple(t.shape) for name, t in theirs.state_dict().items()}
    params = _drawn_tensors(model)
    device = params["lm_head.weight"].device
    written = set()
    for row in build_kimi_rows(model.config, keys=shapes.keys()):
        sources = [drawn(key, shapes[key], dtype, device, "kimi_linear", seed) for key in row.format_keys]
        for name, tensor in zip(row.canonical_keys, row.converter.forward(sources)):
            params[name].data.copy_(tensor)
            written.add(name)
    if written != set(params):  # a tensor no row writes would stay as to_empty left it
        raise RuntimeError(f"the kimi_linear rows leave {sorted(set(params) - written)[:3]} undrawn")


__all__ = ["FP8_BLOCK", "KIMI_LINEAR_48B", "QWEN3_NEXT_80B", "build_ours", "build_theirs", "check_fits", "draw",
           "kimi_linear_fields", "model_bytes", "ours_config", "ours_on_meta", "qwen3_next_fields", "theirs_config",
           "theirs_on_meta"]
