"""The model's block-scaled FP8 layers: a Linear and the MoE experts holding float8_e4m3fn weights with their float32
per-block `weight_scale_inv`, as the checkpoint stores them (`fp8_settings`, `kernels_fp8`).

    Fp8Linear:   y = x @ W.T (+ b),   W = W_fp8 * scale_inv (per bn x bk block)    -> kernels_fp8.block_fp8_linear
    Fp8Experts:  the (token, expert) pairs sorted by expert, then per expert e
                 y = down_e( act(gate_e x) * up_e x * w )                           -> block_fp8_grouped_linear
                 (a decoding step's few pairs unsorted, each its expert's product   -> block_fp8_routed_linear)
                 and each token's k outputs summed in float32
                 (gate_up_proj [E, 2I, H] and down_proj [E, H, I] in FP8, each with its scale_inv)

How a folder with a quantization_config loads. transformers' `from_pretrained` hands a config that has a
`quantization_config` attribute with quant_method "fp8" to its FineGrainedFP8 quantizer, which needs the `accelerate`
package, dequantizes the whole model to bfloat16 when no GPU is present, and on a GPU swaps in its own FP8 layers
whose kernels come from the Hub (the `kernels` package). This family's config keeps the setting under its own
attribute (`HybridLinearConfig.block_fp8`, written back to config.json as `quantization_config`), so transformers
sees no quantization and loads the checkpoint tensors as they are into the parameters the model declares: each
decoder layer, and the causal LM for its head, replaces the modules the setting quantizes (`quantize_modules`) by the
layers here when it is built. transformers' loader casts a checkpoint tensor to its parameter's dtype, so the FP8
weights and float32 scales arrive with their stored bytes whatever `dtype=` asks for the rest, and
`save_pretrained` writes them back unchanged. No network, no extra package, and the CPU runs it (the reference
kernels dequantize to the activation dtype).

The weights and scales keep their dtypes through `model.to(dtype)` / `.half()` (a dtype change would round the
scales and turn the FP8 bytes into other values): `_apply` moves them between devices but never casts them. They do
not train (requires_grad False): an FP8 model runs inference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init

from .experts_grouped_gather import expert_offsets
from .experts_routed import is_silu
from .fp8_kernel_contract import TILE_ROW_BOUNDS
from .fp8_settings import SCALE_SUFFIX, BlockFp8Settings
from .kernels_fp8 import (
    RowIndex,
    block_fp8_grouped_linear,
    block_fp8_linear,
    block_fp8_routed_linear,
    block_fp8_routed_swiglu_linear,
    routed_applies,
    scale_shape,
)


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


class _KeepsStoredDtypes(nn.Module):
    """Applies `nn.Module._apply` (device moves, dtype casts) to its FP8 weights and scales through an integer view
    of their bytes: a device move applies, a dtype cast does not."""

    _stored: tuple[str, ...] = ()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        kept = {}
        for name in self._stored:
            param = self._parameters[name]
            view = {1: torch.uint8, 4: torch.int32}[param.element_size()]
            kept[name] = (param.dtype, fn(param.data.view(view)))  # not floating: only the device can change
            self._parameters[name] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for name, (dtype, data) in kept.items():
                self._parameters[name] = nn.Parameter(data.view(dtype), requires_grad=False)
        return self


class Fp8Linear(_KeepsStoredDtypes):
    """A Linear on a block-scaled FP8 weight: `weight` (out, in) float8_e4m3fn, `weight_scale_inv` float32 of shape
    (ceil(out / bn), ceil(in / bk)), optional `bias` in the model's dtype."""

    _stored = ("weight", "weight_scale_inv")

    def __init__(self, in_features: int, out_features: int, settings: BlockFp8Settings, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, settings.block
        self.weight = _frozen((out_features, in_features), getattr(torch, settings.dtype_name))
        self.weight_scale_inv = _frozen(scale_shape(self.weight.shape, self.block), torch.float32)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def rows(self, x: torch.Tensor, index: RowIndex) -> torch.Tensor:
        """forward(x)[..., index.rows]: on CUDA one kernel that reads only those weight rows."""
        return block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias, rows=index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={list(self.block)}"


class Fp8Experts(_KeepsStoredDtypes):
    """E gated experts in FP8: `gate_up_proj` (E, 2I, H), the gate's rows first, and `down_proj` (E, H, I), each
    with its `*_scale_inv` (E, blocks of rows, blocks of columns), as transformers' fused layout names them. Called
    as the experts it replaces: (rows [T, H], top-k experts [T, k], top-k weights [T, k]) -> [T, H]."""

    _stored = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: Callable,
                 settings: BlockFp8Settings):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.act_fn, self.block = act_fn, settings.block
        fp8 = getattr(torch, settings.dtype_name)
        self.gate_up_proj = _frozen((num_experts, 2 * intermediate_dim, hidden_dim), fp8)
        self.gate_up_proj_scale_inv = _frozen(scale_shape(self.gate_up_proj.shape, self.block), torch.float32)
        self.down_proj = _frozen((num_experts, hidden_dim, intermediate_dim), fp8)
        self.down_proj_scale_inv = _frozen(scale_shape(self.down_proj.shape, self.block), torch.float32)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if not self.num_experts:
            return torch.zeros_like(hidden_states)
        routes = self.route_rows(hidden_states, top_k_index, top_k_weights)
        if routes is not None:
            # each token's k rows summed in float32 and rounded once, in one kernel: torch's sum of bf16/fp16 rows
            # accumulates in float32 (its opmath type), as the sorted path's float32 sum and cast do in two
            return routes.sum(1)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        sorted_experts, order = torch.sort(flat, stable=True)  # the pairs grouped by expert
        offsets = expert_offsets(sorted_experts, self.num_experts)
        # every pair keeps its row, so no count is read on the host (a CUDA graph captures this): the pairs of experts
        # numbered num_experts or above (expert parallelism's other ranks) sort past offsets[-1], where no expert
        # computes, and their rows are masked out of the sum
        token_of = order // k
        gate_up = block_fp8_grouped_linear(hidden_states[token_of], self.gate_up_proj, self.gate_up_proj_scale_inv,
                                           offsets, self.block)
        gate, up = gate_up.chunk(2, dim=-1)
        gated = self.act_fn(gate) * up * top_k_weights.reshape(-1, 1)[order].to(gate_up.dtype)
        out = block_fp8_grouped_linear(gated, self.down_proj, self.down_proj_scale_inv, offsets, self.block)
        slots = torch.arange(order.numel(), device=order.device)
        out = torch.where((slots < offsets[-1:])[:, None], out, 0)
        # each token's k rows gathered back to (token, slot) order and summed in float32 (float64 for float64), as the
        # float experts sum them: no atomics (index_add on CUDA adds in the output's dtype, in no fixed order)
        inverse = torch.empty_like(order)
        inverse[order] = slots
        total = torch.promote_types(out.dtype, torch.float32)
        return out[inverse].view(-1, k, out.shape[-1]).sum(1, dtype=total).to(hidden_states.dtype)

    def route_rows(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor | None:
        """A decoding step's experts, [T, k, H]: each (token, slot) pair's weighted product in (token, slot) order,
        with no sort and no gather (an expert of another rank gives a row of zeros), for the caller to sum (the MoE
        block adds them to its shared expert in one kernel); None where the routed kernel does not apply
        (`routed_applies`: more routes, or not a GPU)."""
        if not self.num_experts or not routed_applies(hidden_states, self.gate_up_proj, self.gate_up_proj_scale_inv,
                                                      top_k_index.numel()):
            return None
        routes, k = top_k_index.reshape(-1), top_k_index.shape[1]
        gate_up = block_fp8_routed_linear(hidden_states, self.gate_up_proj, self.gate_up_proj_scale_inv, routes,
                                          self.block)
        route_weights = top_k_weights.reshape(-1).to(gate_up.dtype)
        if is_silu(self.act_fn):  # SwiGLU and the routing weight computed as the down projection reads its input
            out = block_fp8_routed_swiglu_linear(gate_up, self.down_proj, self.down_proj_scale_inv, routes,
                                                 route_weights, self.block)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            gated = self.act_fn(gate) * up * route_weights[:, None]
            out = block_fp8_routed_linear(gated, self.down_proj, self.down_proj_scale_inv, routes, self.block)
        return out.view(-1, k, out.shape[-1])

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, block={list(self.block)}")


def fp8_tuning_prompt_lengths(model: nn.Module) -> list[int]:
    """Prompt lengths (one row) whose forward meets every row tile of the model's FP8 products (TILE_ROW_BOUNDS): a
    prompt of TILE_ROW_BOUNDS[0] tokens for the dense layers' small-row form and, for each FP8 experts module behind a
    router of `top_k` routes a token, the shortest prompts whose routes average past each bound per expert. `warm_up`
    runs them (each tile is a tuning key of its own; the larger dense tiles its other prompts reach)."""
    lengths = set()
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            lengths.add(TILE_ROW_BOUNDS[0])
        experts, top_k = getattr(module, "experts", None), getattr(getattr(module, "gate", None), "top_k", None)
        if isinstance(experts, Fp8Experts) and experts.num_experts and isinstance(top_k, int) and top_k > 0:
            lengths.update(bound * experts.num_experts // top_k + 1 for bound in TILE_ROW_BOUNDS)
    return sorted(lengths)


def _is_experts(name: str, module: nn.Module) -> bool:
    """The MoE experts module (its class says so: `fp8_layout = "experts"`, mlp_sparse_moe.HybridLinearExperts), as
    the checkpoint names it."""
    return getattr(type(module), "fp8_layout", None) == "experts" and name.endswith("experts")


def _fp8_module(name: str, module: nn.Module, settings: BlockFp8Settings) -> nn.Module | None:
    if not settings.quantizes(name):
        return None
    if type(module) is nn.Linear:
        return Fp8Linear(module.in_features, module.out_features, settings, bias=module.bias is not None)
    if _is_experts(name, module):
        return Fp8Experts(module.num_experts, module.hidden_dim, module.intermediate_dim, module.act_fn, settings)
    return None


def quantize_modules(root: nn.Module, prefix: str, settings: BlockFp8Settings | None) -> None:
    """Replaces, in `root` (whose checkpoint names start with `prefix`, e.g. "model.layers.3."), every plain Linear
    and experts module that `settings` quantizes by its FP8 layer; nothing when `settings` is None."""
    if settings is None:
        return
    for name, module in list(root.named_modules()):
        replacement = _fp8_module(prefix + name, module, settings) if name else None
        if replacement is not None:
            parent_name, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent_name), child, replacement)


def quantize_module(module: nn.Module, name: str, settings: BlockFp8Settings | None) -> nn.Module:
    """`module` (a top-level one, named `name`: "lm_head"), or its FP8 layer when `settings` quantizes it."""
    replacement = _fp8_module(name, module, settings) if settings is not None else None
    return module if replacement is None else replacement


def init_fp8_weights(module: nn.Module, std: float) -> bool:
    """A fresh FP8 layer's weights (a model built, not loaded): values of N(0, std) stored as FP8 with unit
    scales. Returns whether `module` is an FP8 layer."""
    if not isinstance(module, _KeepsStoredDtypes):
        return False
    for name in module._stored:  # transformers' init functions: a loaded tensor is left as it is
        param = getattr(module, name)
        if name.endswith(SCALE_SUFFIX):
            init.ones_(param)
        else:
            init.copy_(param, torch.randn(param.shape, device=param.device).mul_(std).to(param.dtype))
    if getattr(module, "bias", None) is not None:
        init.zeros_(module.bias)
    return True


__all__ = ["Fp8Experts", "Fp8Linear", "init_fp8_weights", "quantize_module", "quantize_modules"]
