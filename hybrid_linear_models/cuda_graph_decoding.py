"""One-token decoding steps replayed from a captured CUDA graph.

At batch 1 a decoding step of a ~1B model is a few hundred small kernels, so Python and launch overhead, not the GPU,
set the speed. With a `StaticCache` every tensor a decoding step touches has a fixed address (KV buffers, GDN/KDA
states, and the cache's length counter on the device), so the whole step (embedding, every layer, LM head) is
captured once per cache and batch size, then replayed: one launch per token.

Used automatically by `HybridLinearForCausalLM.forward` for one-token steps on CUDA without gradients against a
`StaticCache` (`generate(..., cache_implementation="static")`), unless disabled with
`model.set_cuda_graph_decoding(False)`. Models with sliding-window layers decode eagerly (their rolling buffers
are not covered here).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

from .cache_hybrid_linear import LinearStateLayer
from .derived_weights import derived_weights


def _cache_tensors(cache: StaticCache) -> list[torch.Tensor]:
    tensors = []
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            tensors += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            tensors += [layer.keys, layer.values, layer.cumulative_length]
    return tensors


class CudaGraphDecoder:
    """Captures `model.model.decode_step` + the LM head for one cache and batch size, and replays it."""

    device_types = ("cuda",)  # tests add "cpu", with `_record` replaced by an eager stand-in

    def __init__(self):
        self._key = None
        self._graph = None
        self._derived = []

    @staticmethod
    def applies(model, input_ids, inputs_embeds, cache, attention_mask, kwargs) -> bool:
        if (input_ids is None or inputs_embeds is not None or input_ids.shape[1] != 1
                or input_ids.device.type not in CudaGraphDecoder.device_types):
            return False
        if torch.is_grad_enabled() or model.training or not isinstance(cache, StaticCache):
            return False
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            return False
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            return False
        if model.config._attn_implementation not in ("sdpa", "eager"):
            return False
        layers = cache.layers
        if any(isinstance(layer, StaticSlidingWindowLayer) for layer in layers):
            return False
        ready = [
            layer.has_previous_state[0] if isinstance(layer, LinearStateLayer)
            else isinstance(layer, StaticLayer) and layer.is_initialized
            for layer in layers
        ]
        return all(ready)  # the prefill has run (eagerly) and sized every buffer

    def step(self, model, input_ids, position_ids, attention_mask, cache: StaticCache) -> torch.Tensor:
        batch = input_ids.shape[0]
        max_len = max(cache.get_max_length(), 1)  # -1 without attention layers: no key mask is needed then
        key = (id(cache), batch, max_len, input_ids.device)
        if key != self._key or any(d.value is not kept or d.stale() for d, kept in self._derived):
            self._capture(model, cache, batch, max_len, input_ids.device, key)
        self._ids.copy_(input_ids)
        past = cache.get_seq_length() if self._has_attention else None  # a device tensor: no synchronisation
        if position_ids is not None:
            self._positions.copy_(position_ids)
        elif past is not None:
            self._positions.copy_(past.view(1, 1).expand(batch, 1))
        if past is not None:  # cache slots holding real tokens once this step's token is written
            if attention_mask is None:
                self._key_mask.copy_(torch.arange(max_len, device=input_ids.device) <= past)
                self._mask_length = max_len
            else:  # slots past the mask stay False: zeroed at capture, and again where a longer mask wrote
                length = attention_mask.shape[1]
                self._key_mask[:, :length].copy_(attention_mask)
                if length < self._mask_length:
                    self._key_mask[:, length : self._mask_length].zero_()
                self._mask_length = length
        self._graph.replay()
        for layer in cache.layers:
            if isinstance(layer, LinearStateLayer):
                layer.seen_tokens += 1
        return self._logits.clone()

    @staticmethod
    def _record(run, device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A CUDA graph of run() and the output buffer each replay refills, after two warm-up runs on a side stream
        (autotuning, lazy handles)."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = run()
        return graph, logits

    def _capture(self, model, cache, batch, max_len, device, key) -> None:
        self._graph = None  # release the previous graph's memory pool first
        self._has_attention = any(isinstance(layer, StaticLayer) for layer in cache.layers)
        self._ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self._mask_length = 0
        linear_layers = [layer for layer in cache.layers if isinstance(layer, LinearStateLayer)]
        seen = [layer.seen_tokens for layer in linear_layers]
        saved = [t.clone() for t in _cache_tensors(cache)]

        def run():
            hidden = model.model.decode_step(self._ids, self._positions, self._key_mask, cache)
            return model.lm_head(hidden)

        self._graph, self._logits = self._record(run, device)
        for tensor, value in zip(_cache_tensors(cache), saved):  # the warm-up steps advanced the cache: undo them
            tensor.copy_(value)
        for layer, count in zip(linear_layers, seen):
            layer.seen_tokens = count
        self._key = key
        self._derived = [(d, d.value) for d in derived_weights(model)]  # kept tensors the graph reads (norms' 1 + w)
