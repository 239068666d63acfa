"""The sdpa kernel of a prompt's attention on a GPU: none that builds a plan per prompt length, below a size where
the plan would cost more than the prompt.

On a Hopper GPU torch's sdpa takes cuDNN's fused attention wherever it applies, and cuDNN builds an execution plan for
every new shape (batch, heads, query and key lengths) at its first call: 45 to 60 ms on an H200 (torch 2.11, 16 query
and 2 KV heads of 256, causal, at 8k, 32k and 128k tokens), for a kernel whose warm run at 8k tokens takes 0.9 ms.
Requests arrive with a new prompt length nearly every time, so each would pay the plan: on cuDNN a first call of the
1.2B benchmark model at a new length of 1,000 tokens (batch 16) takes 1.7 times the warm one. Flash attention plans
nothing, and runs at about half cuDNN's speed on long prompts (one layer, 8k tokens: 2.0 against 0.9 ms; 32k: 28.3
against 12.5 ms; 128k: 543 against 256 ms). So a prompt whose batch x length is below `CUDNN_MIN_TOKENS` runs flash
attention; from there on sdpa chooses as it would. At the limit the two cost a first call the same (the benchmark
model's 4 attention layers at 32k tokens take 63 ms longer on flash, about one plan) and the plan is about a fifth of
the model's warm prefill; below it flash's extra time shrinks with the square of the length (4 ms at 8k) while the
plan does not. A warm call at just under the limit pays flash's extra time, about a quarter of that prefill.

A causal prompt into an empty static cache attends over the cache's slots, the prompt's first and the empty ones after
it, sdpa's causal mask (aligned at the first key) hiding those; transformers' sdpa function drops the keys past the last
query before it calls sdpa, so the call is square, which flash takes. The choice here is made on those same keys
(`visible_keys` drops them first): on the whole cache it would see a non-square causal call, which flash refuses, and
leave such prompts to cuDNN and its plan per length (at batch 1, a first call then takes 2.2 to 2.5 times the warm
one at 1,000 to 7,000 tokens).

This applies to the prompts that cuDNN would take and flash can: no gradient (training keeps torch's choice), not
inside torch.compile, a device of `PLANLESS_DEVICE_TYPES`, bf16/fp16, no mask (an unpadded prompt, the causal kernel),
no dropout, and inputs torch's own check says its flash kernel takes (`torch.backends.cuda.can_use_flash_attention`:
the GPU, the head width, GQA). Elsewhere sdpa chooses, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PLANLESS_DEVICE_TYPES = ("cuda",)  # tests add "cpu"
PLANLESS_DTYPES = (torch.bfloat16, torch.float16)  # tests add float32 (the CPU's flash kernel takes it)
CUDNN_MIN_TOKENS = 32_768  # query tokens (batch x length) of a prompt from which sdpa may take cuDNN
PLANLESS_BACKENDS = [SDPBackend.FLASH_ATTENTION]


def flash_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether sdpa's flash kernel takes these causal, unmasked inputs ([B, heads, T, D]; fewer key heads: GQA), by
    torch's own check on CUDA (elsewhere its rules for flash: one head width for q, k and v, and as many keys as
    queries for a causal call)."""
    if any(type(x) is not torch.Tensor for x in (query, key, value)):  # (subclasses, e.g. DTensor: sdpa chooses)
        return False
    if query.device.type != "cuda":
        return query.shape[-1] == key.shape[-1] == value.shape[-1] and query.shape[2] == key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, True, gqa)
    return torch.backends.cuda.can_use_flash_attention(params, False)


def runs_planless(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  dropout: float) -> bool:
    """Whether sdpa of these inputs (query [B, H, T, D]) runs on flash attention rather than sdpa's own choice (the
    module docstring)."""
    batch, _, length, _ = query.shape
    return (query.device.type in PLANLESS_DEVICE_TYPES and query.dtype in PLANLESS_DTYPES
            and attention_mask is None and not dropout and 1 < length and batch * length < CUDNN_MIN_TOKENS
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and flash_applies(query, key, value))


def visible_keys(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value [B, heads, S, D] without the keys no query sees: where transformers' sdpa function runs sdpa's
    causal mask (several queries, no mask, a causal module unless `settings` says otherwise), which aligns the T
    queries at the first key, keys from T on are hidden from all of them."""
    length = query.shape[2]
    causal = settings.get("is_causal", getattr(module, "is_causal", True))
    if causal and attention_mask is None and 1 < length < key.shape[2]:
        return key[:, :, :length], value[:, :, :length]
    return key, value


def planless_for_prompts(attention: Callable) -> Callable:
    """transformers' sdpa attention function `attention` over the `visible_keys` only, with the kernel of
    `runs_planless` prompts fixed to flash attention."""

    def prompt_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        key, value = visible_keys(module, query, key, value, attention_mask, kwargs)
        if not runs_planless(query, key, value, attention_mask, kwargs.get("dropout", 0.0)):
            return attention(module, query, key, value, attention_mask, **kwargs)
        with sdpa_kernel(PLANLESS_BACKENDS):
            return attention(module, query, key, value, attention_mask, **kwargs)

    return prompt_attention


def attention_function(implementation: str, default: Callable) -> Callable:
    """transformers' attention function of `implementation` (`default` where none is registered), its sdpa through
    `planless_for_prompts`."""
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, default)
    return planless_for_prompts(attention) if implementation == "sdpa" else attention


__all__ = ["CUDNN_MIN_TOKENS", "attention_function", "planless_for_prompts", "runs_planless", "visible_keys"]
