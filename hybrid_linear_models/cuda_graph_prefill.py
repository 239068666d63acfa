"""Prompt prefills replayed from captured CUDA graphs, one graph per length bucket.

At batch 1 the prefill of a ~1B model over a 1k-token prompt is bound by the host, not the GPU: some 600 kernels
(fla's chunked delta rule alone launches 10-15 Triton kernels a layer), each launched from Python in tens of
microseconds on a GPU server's host, so the wall time is several times the kernels' (docs/performance.md). A captured
graph launches them all at once.

A graph holds fixed shapes, so a prompt of L tokens is padded on the right to its length bucket P (`prefill_length`:
a multiple of max(64, a quarter of the largest power of two <= L): fewer than max(64, L / 4) pads, 4 buckets per
doubling), and the padding is exact for everything the prefill leaves behind:
- the model is causal: no real token sees a pad (attention masks later keys, convolution and recurrence run forward);
- GDN/KDA layers see the pads as padding (`SequenceInfo.padding_mask`): beta and log decay 0, so the recurrent state
  stays as the last real token left it, and the convolution's state is read at the last real token
  (`mixer_linear.conv_state_at_last_real`);
- attention layers write the pads' keys into slots L..P-1 of the static cache, which no later query reads before a
  real token overwrites them (a decoding step writes its own slot and masks the later ones); the layers' counters are
  set to L inside the graph;
- the graph returns the logits of token L-1 only, all that `generate` asks of a prefill (`logits_to_keep=1`).
Attention takes sdpa's causal kernel (over the cache's slots, aligned at the first) when no row is padded on the left,
else the mask of each row's real keys (`HybridLinearModel.prefill_step`). The speed against transformers' prefill:
docs/performance.md (`benchmarks/bench_generation.py --device cuda`).

Used by `HybridLinearForCausalLM.forward` for a prompt (more than one token) on CUDA, without gradients, into an empty
`StaticCache` (`generate(..., cache_implementation="static")`), with graph decoding on (`set_cuda_graph_decoding`,
one switch for both), for prompts of up to LARGEST_CAPTURED_TOKENS tokens in all (past it the plain forward runs:
the GPU's work, not the launches, then sets the time). A bucket is captured the second time a prompt falls in it: a
one-off prompt runs the plain forward and does not pay for a capture (a warm-up run and the recording, about two plain
prefills); `HybridLinearForCausalLM.warm_up` captures every bucket up front (`captured_buckets`). A prefill
that cannot be captured (sliding-window layers, whose buffers would keep the pads' keys; a cache already holding
tokens; all the logits asked for; what graph decoding refuses too) runs the plain forward, and a one-line warning says
why, once per model and reason. The cache is bound to the storage of its shape, which the decoding step's graph
shares (graph_cache_storage): a replayed prompt leaves the cache where the step reads it.

Off by default (`CudaGraphPrefill.on_by_default`; `model.set_cuda_graph_decoding(True, prompts=True)` turns it on,
before `warm_up`, which then captures every bucket). After the warm-up, a 1,000-token prompt's time to first token on
an H200 is 16 ms against 43 ms uncaptured (the 1.2B GDN model), 86 against 179 ms (the 48-layer Qwen3-Next FP8
flagship): docs/performance.md. It stays off for two reasons:
- a bucket captured without the warm-up costs its request the capture: about 1.6 s on the FP8 flagship (34 s for its
  20 buckets), more than a first call may pay;
- on an H200, replays of prompts shorter than their bucket, after warm-ups of batch sizes 1 and 4 up to 4,096 tokens,
  have raised an illegal memory access of unknown cause. The scenario (tests/test_gpu_warm_up_prompt_graphs.py: 16
  lengths from 43 to 3,858 tokens at both batch sizes) does not reproduce it with torch 2.11. It is not the known
  mechanism for such faults, a destroyed graph freeing the cuBLAS workspace its stream's other graphs write to (torch
  releases with pytorch/pytorch#193402): the torch 2.11 build measured frees no workspace there, and recorded_graphs.py
  keeps any release from doing so.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter, OrderedDict

import torch
from transformers.cache_utils import StaticCache, StaticSlidingWindowLayer

from .cuda_graph_decoding import (
    CacheLayout,
    WeightsRead,
    capture_failure,
    capture_obstacle,
    records_past,
    storage_key,
)
from .graph_cache_storage import CacheStorage, CacheStorages, allocated
from .mlp_sparse_moe import graph_safe_experts, graph_safe_experts_implementation
from .recorded_graphs import RecordedGraph, record_graph

logger = logging.getLogger(__name__)

SMALLEST_BUCKET = 64  # fla's chunk length: a shorter pad saves no chunk
BUCKETS_PER_DOUBLING = 4  # fewer than a quarter of the length padded; 20 buckets from 64 to 4,096 tokens
# Prompts of up to this many tokens in all (batch x bucket) are captured. Past it the GPU's work, not the host's
# launches, sets a prefill's time (a 1.2B model's 4k-token prefill keeps an H200 busy longer than its ~600 launches
# take), so the plain forward runs, and no capture, and no graph memory, is spent on a length bucket that gains little.
LARGEST_CAPTURED_TOKENS = 4096
KEPT_GRAPHS = 64  # captured buckets kept per model (they share one memory pool and their cache shape's storage)


def prefill_length(length: int, slots: int | None = None) -> int:
    """The bucket a prompt of `length` tokens is padded to: the next multiple of max(64, a quarter of the largest
    power of two <= length), so fewer than 64 or length / 4 pads and 4 buckets per doubling; at most `slots` (the
    static cache's key slots; None for a cache without attention layers)."""
    step = max(SMALLEST_BUCKET, (1 << (length.bit_length() - 1)) // BUCKETS_PER_DOUBLING)
    padded = -(-length // step) * step
    return padded if slots is None else max(min(padded, slots), length)


def captured_buckets(batch: int, slots: int | None) -> list[int]:
    """Every bucket a prompt of `batch` rows is captured at (`LARGEST_CAPTURED_TOKENS`), for a cache of `slots` key
    slots: the lengths the warm-up captures."""
    buckets, length = [], 2
    while batch * (padded := prefill_length(length, slots)) <= LARGEST_CAPTURED_TOKENS:
        if padded not in buckets:
            buckets.append(padded)
        if slots is not None and padded >= slots:
            break
        length = padded + 1
    return buckets


class PrefillGraph:
    """One captured bucket: the graph, its input buffers (refilled before each replay), the logits buffer it
    refills, the cache storage it reads and writes, and the weights it read at capture."""

    def __init__(self, batch: int, padded: int, device: torch.device):
        self.ids = torch.zeros(batch, padded, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, padded, dtype=torch.long, device=device)
        self.real = torch.zeros(batch, padded, dtype=torch.bool, device=device)
        self.length = torch.zeros((), dtype=torch.long, device=device)  # L, the real tokens' count
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # L - 1
        self._arange = torch.arange(padded, device=device).expand(batch, padded)
        self.graph = self.logits = None
        self.cache: weakref.ref | None = None  # the cache bound last (not kept alive)
        self.storage: CacheStorage | None = None  # shared with the other graphs of its cache shape
        self.read: WeightsRead | None = None  # the weights the graph read, at capture

    def fill(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
             attention_mask: torch.Tensor | None) -> None:
        """The prompt into the input buffers: its tokens, positions and real-token flags first, pads after."""
        length = input_ids.shape[1]
        self.ids[:, :length].copy_(input_ids)
        self.positions.copy_(self._arange)
        if position_ids is not None:
            self.positions[:, :length].copy_(position_ids)
        self.real[:, length:].zero_()
        if attention_mask is None:
            self.real[:, :length].fill_(True)
        else:
            self.real[:, :length].copy_(attention_mask[:, -length:])
        self.length.fill_(length)
        self.last.fill_(length - 1)

    def bind(self, cache: StaticCache, storages: CacheStorages, key: tuple) -> bool:
        """Points `cache` at the graph's storage; False where it does not fit, or the storage of its shape is now
        another one (the graph is then captured again)."""
        if self.storage is None or storages.bind(cache, key) is not self.storage:
            return False
        self.cache = weakref.ref(cache)
        return True

    def stale(self) -> bool:
        """Whether the graph was destroyed (recorded_graphs), or a weight it reads was replaced, given new storage, or
        (a kept derived value) updated."""
        return self.graph.expired or self.read.changed()


class CudaGraphPrefill:
    """Captures `model.model.prefill_step` + the LM head on the last real token, per (batch, length bucket, cache
    slots, device, whether a row is left-padded: the attention mask then holds the padding), and replays it (see the
    module docstring). The graphs share one memory pool (they run one at a time) and the storage of their cache shape;
    the KEPT_GRAPHS most recently replayed are kept, or as many as the warm-up captured."""

    device_types = ("cuda",)  # tests add "cpu", with `_record` replaced by an eager stand-in
    on_by_default = False  # (see the module docstring; the CPU tests of this path turn it on)

    def __init__(self, storages: CacheStorages | None = None):
        self.storages = storages if storages is not None else CacheStorages()
        self.capture_first_use = False  # (set by the warm-up: a bucket is captured at its first prompt)
        self._warmed = 0  # buckets the warm-up captured: all are kept (warm_up of several batch sizes: more than 64)
        self._graphs: OrderedDict[tuple, PrefillGraph] = OrderedDict()  # least recently replayed first
        self._uses: Counter = Counter()
        self._failed: dict[tuple, str] = {}
        self._warned: set[str] = set()
        self._pool = None

    def __reduce__(self):
        """Copies (copy.deepcopy of the model, pickling) start with nothing captured, as `CudaGraphDecoder`'s."""
        return CudaGraphPrefill, ()

    @staticmethod
    def wanted(model, input_ids, inputs_embeds, cache) -> bool:
        """Whether this forward is a prefill the graphs serve: a prompt of token ids on a graph device, no gradient,
        into a static cache (`generate(..., cache_implementation="static")`)."""
        return (input_ids is not None and inputs_embeds is None and input_ids.dim() == 2 and input_ids.shape[1] > 1
                and input_ids.device.type in CudaGraphPrefill.device_types and not torch.is_grad_enabled()
                and not model.training and isinstance(cache, StaticCache))

    @staticmethod
    def obstacle(model, cache: StaticCache, layout: CacheLayout, attention_mask, logits_to_keep, kwargs,
                 device_type: str = "cuda") -> str | None:
        """Why a wanted prefill cannot be captured (None when it can): one line, with the fix."""
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions") or kwargs.get("output_router_logits"):
            return "hidden states, attention weights or router logits were requested (the graph returns logits only)"
        if not isinstance(logits_to_keep, int) or logits_to_keep != 1:
            return "the logits of more than the last token were asked for (generate asks for logits_to_keep=1)"
        reason = capture_obstacle(model, attention_mask)
        if reason is not None:
            return reason
        requested = getattr(model.config, "_experts_implementation", None)
        if model._routers() and graph_safe_experts_implementation(
                requested, model.lm_head.weight.dtype, device_type) == "batched_mm" != requested:
            return ("the experts' graph-safe implementation for this dtype gathers an expert matrix per routed token "
                    "(batched_mm), too much memory for a prompt")
        if layout.unknown:
            return "the cache holds layers of a kind this package does not capture"
        if records_past(cache, layout):
            return ("the cache records its past for assisted decoding (a crop restores what uncaptured forwards "
                    "keep: state_rollback.py)")
        if any(isinstance(layer, StaticSlidingWindowLayer) for layer in cache.layers):
            return ("the cache has sliding-window layers, whose buffers would keep the keys of the padding a "
                    "captured prefill adds")
        if (layout.linear and any(layer.seen_tokens for layer in layout.linear)) or (
                not layout.linear and int(cache.get_seq_length())):
            return "the cache already holds tokens (a prompt continuing a cache runs uncaptured)"
        return None

    def warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning(f"CUDA-graph prefill: this prefill runs uncaptured (slower): {reason}.")

    def try_prefill(self, model, input_ids, position_ids, attention_mask, cache: StaticCache, logits_to_keep,
                    kwargs) -> torch.Tensor | None:
        """The last token's logits [B, 1, V] of a prefill replayed from its bucket's graph, or None where the plain
        forward must run: the bucket's first prompt (silently), or a prefill that cannot be captured (warned once
        per reason)."""
        layout = CacheLayout(cache)
        reason = self.obstacle(model, cache, layout, attention_mask, logits_to_keep, kwargs, input_ids.device.type)
        if reason is None:
            slots = layout.full_length if layout.has_full else None
            if slots is not None and input_ids.shape[1] > slots:  # (the write past the buffer: a device assertion)
                raise ValueError(
                    f"the static cache holds {slots} tokens per row and the prompt has {input_ids.shape[1]}. Create "
                    "the StaticCache with a larger max_cache_len (at least the prompt length plus max_new_tokens), or "
                    "let generate size it (cache_implementation=\"static\" without a cache of your own).")
            padded = prefill_length(input_ids.shape[1], slots)
            if input_ids.shape[0] * padded > LARGEST_CAPTURED_TOKENS:
                return None  # (the GPU's work sets this prefill's time: the plain forward, silently)
            rows_padded = attention_mask is not None and not bool(attention_mask.all())  # (one sync, not per token)
            key = (input_ids.shape[0], padded, slots, input_ids.device, rows_padded)
            if key not in self._failed:
                self._uses[key] += 1
                if key not in self._graphs and self._uses[key] < 2 and not self.capture_first_use:
                    return None
                logits = self._replay(model, input_ids, position_ids, attention_mask, cache, layout, key)
                if logits is not None:
                    return logits
            reason = self._failed[key]
        self.warn_once(reason)
        return None

    def _replay(self, model, input_ids, position_ids, attention_mask, cache, layout, key) -> torch.Tensor | None:
        graph = self._graphs.get(key)
        if graph is not None:
            graph.fill(input_ids, position_ids, attention_mask)
        if (graph is None or not graph.bind(cache, self.storages, storage_key(key[0], layout, key[3]))
                or graph.stale()):
            self._graphs.pop(key, None)
            try:
                graph = self._capture(model, cache, layout, key, input_ids, position_ids, attention_mask)
            except Exception as error:  # an op that cannot be captured (a host synchronisation, an unsupported call)
                self._failed[key] = capture_failure("the prefill", error)
                _empty(layout)  # the warm-ups' writes: the plain forward starts from an empty cache
                return None
            self._graphs[key] = graph
            self._warmed += self.capture_first_use
            # each holds a cache's storage and its inputs: the recent kept, and at least what the warm-up captured
            while len(self._graphs) > max(KEPT_GRAPHS, self._warmed):
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        graph.graph.replay()
        for layer in layout.linear:  # the host-side state a prefill leaves (the graph set the devices' counters)
            layer.has_previous_state[0] = True
            layer.seen_tokens = input_ids.shape[1]
        return graph.logits.clone()

    @staticmethod
    def _record(run, device, pool) -> tuple[RecordedGraph, torch.Tensor]:
        return record_graph(run, device, pool)  # (tests stand in an eager replay here)

    def _capture(self, model, cache, layout, key, input_ids, position_ids, attention_mask) -> PrefillGraph:
        batch, padded, slots, device, rows_padded = key
        graph = PrefillGraph(batch, padded, device)
        graph.fill(input_ids, position_ids, attention_mask)
        graph.cache = weakref.ref(cache)

        def run():  # (of the cache bound last: a CPU test's eager stand-in replays it)
            cache = graph.cache()
            layout = CacheLayout(cache)
            _empty(layout)  # each run is the prefill of an empty cache (the warm-ups' writes undone)
            with graph_safe_experts(model.config, model.lm_head.weight.dtype, device.type):
                hidden = model.model.prefill_step(graph.ids, graph.positions, graph.real, cache, slots or padded,
                                                  rows_padded)
            for layer in layout.attention:
                layer.cumulative_length.copy_(graph.length)
            return model.lm_head(hidden.index_select(1, graph.last))

        shape = storage_key(batch, layout, device)
        storage = self.storages.bind(cache, shape)
        if storage is None and not all(allocated(layer) for layer in cache.layers):
            run()  # allocates the cache's tensors (on first update) outside the graph's memory pool
        if self._pool is None and device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        graph.graph, graph.logits = self._record(run, device, self._pool)
        graph.storage = storage or self.storages.adopt(cache, shape)
        graph.read = WeightsRead(model)
        return graph


def _empty(layout: CacheLayout) -> None:
    """The cache's counters and flags as an empty cache has them (its tensors stay allocated): the GDN/KDA layers'
    host-side state, the attention layers' device counters (inside a capture: by the graph)."""
    for layer in layout.linear:
        layer.has_previous_state[0] = False
        layer.seen_tokens = 0
    for layer in layout.attention:
        if layer.is_initialized:
            layer.cumulative_length.zero_()
