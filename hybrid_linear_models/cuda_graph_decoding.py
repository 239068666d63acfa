"""One-token decoding steps replayed from a captured CUDA graph.

At batch 1 a decoding step of a ~1B model is a few hundred small kernels, so Python and launch overhead, not the GPU,
set the speed. With a `StaticCache` every tensor a decoding step touches has a fixed address (KV buffers, GDN/KDA
states, and the cache's length counter on the device), so the whole step (embedding, every layer, LM head) is
captured once per cache and batch size, then replayed: one launch per token.

Used automatically by `HybridLinearForCausalLM.forward` for one-token steps on CUDA without gradients against a
`StaticCache` (`generate(..., cache_implementation="static")`), unless disabled with
`model.set_cuda_graph_decoding(False)`. A step that asks for graph decoding (one token, CUDA, a static cache, no
gradient) but cannot have it (an attention implementation other than eager/sdpa, attention weights or hidden states
requested, a 4-D mask, a cache whose prefill has not run, or a capture that fails) runs the uncaptured forward, and
a one-line warning says why, once per model and reason.

Sliding-window layers are captured too (`WindowSteps`). transformers' `StaticSlidingWindowLayer.update` branches on a
Python counter (fill the buffer, or roll it once full), which a captured graph would freeze at its capture-time value.
The captured step does the same update without Python branches: the cache index of the step's token lives in a device
tensor, the buffer is rolled or not by a `torch.where` on it, the new key is written in place at slot min(index,
window - 1), and the step's mask over the window's slots is built on the device from that index and the real-token
flags of the last tokens (left pads and unwritten slots masked out). The buffers end up exactly as transformers' own
update leaves them (keys in order, the newest last once full), so eager steps, prefills and crops can follow.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

from .attention_step import KernelKVLayer
from .cache_checks import static_cache_room_fix
from .cache_hybrid_linear import LinearStateLayer
from .configuration_hybrid_linear import config_value
from .derived_weights import ChangeWatch, derived_weights
from .graph_cache_storage import CacheStorage, CacheStorages, cache_tensors
from .kernels_gemv import decode_gemv_mode
from .mlp_sparse_moe import graph_capturable_expert_dispatch, graph_safe_experts
from .recorded_graphs import RecordedGraph, record_graph

logger = logging.getLogger(__name__)


def capture_failure(what: str, error: BaseException) -> str:
    """The one-line reason a capture of `what` failed: the error's type and first line, the deepest line of this
    package it passed through (where the uncapturable op was called), and the switch that skips the attempt."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    package = Path(__file__).resolve().parent
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if Path(frame.filename).resolve().is_relative_to(package)]
    site = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return (f"capturing {what} failed ({type(error).__name__}{site}: {first_line}); "
            "model.set_cuda_graph_decoding(False) skips the attempt")


class WindowSteps:
    """Capturable one-token steps of the sliding-window layers of a static cache (see the module docstring).

    `index` (a device scalar) is the cache index of the step's token, `recent` [B, width] the real-token flags of the
    last `width` cache indices, the step's token in the last column; both are refilled before each replay
    (`prepare`), then read by the captured `mask` and `update`. width: the largest window buffer of the cache."""

    def __init__(self, cache: StaticCache, batch: int, device: torch.device):
        self.bind(cache)
        self.width = max(layer.max_cache_len for layer in self.layers.values())
        self.index = torch.zeros((), dtype=torch.long, device=device)
        self.recent = torch.zeros(batch, self.width, dtype=torch.bool, device=device)
        self._offsets = torch.arange(self.width - 1, -1, -1, device=device)  # how far back each column of `recent` is

    def bind(self, cache: StaticCache) -> None:
        """The sliding-window layers of `cache`, whose host counters `advance` moves (a cache of the same layout as
        the one captured: `CudaGraphDecoder._bind`)."""
        self.layers = {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, StaticSlidingWindowLayer)}

    def prepare(self, past: int | torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Before a replay (host side): the step's cache index `past` and the row's real tokens. The mask of a
        generation step covers every cache index up to the step's token (as the full layers' key mask assumes)."""
        if isinstance(past, torch.Tensor):
            self.index.copy_(past)
        else:
            self.index.fill_(past)
        if attention_mask is None:  # no padding: every index from 0 on holds a real token
            self.recent.copy_(self._offsets <= self.index)
            return
        kept = min(attention_mask.shape[1], self.width)
        self.recent[:, self.width - kept:].copy_(attention_mask[:, -kept:])
        self.recent[:, : self.width - kept].zero_()

    def mask(self, layer_idx: int) -> torch.Tensor:
        """[B, window] bool, captured: the slots of layer `layer_idx` this step's query sees. Slot j holds the key of
        cache index start + j, start = max(index - window + 1, 0) (transformers' layout); slots past the index are
        not written yet, and padding keys are masked by `recent`."""
        window = self.layers[layer_idx].max_cache_len
        start = (self.index - window + 1).clamp(min=0)
        slots = start + torch.arange(window, device=self.index.device)
        columns = (slots - self.index + self.width - 1).clamp(0, self.width - 1)
        return (slots <= self.index) & self.recent[:, columns]

    def masks(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
        """convert(`mask`) of every sliding layer, built once per window length (layers of one window share it)."""
        by_window: dict[int, torch.Tensor] = {}
        for i, layer in self.layers.items():
            if layer.max_cache_len not in by_window:
                by_window[layer.max_cache_len] = convert(self.mask(i))
        return {i: by_window[layer.max_cache_len] for i, layer in self.layers.items()}

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' StaticSlidingWindowLayer.update for one token, without a Python branch (captured): roll the
        buffers left once they are full, then write the token at slot min(index, window - 1), in place."""
        layer = self.layers[layer_idx]
        window = layer.max_cache_len
        full = self.index >= window
        slot = self.index.clamp(max=window - 1).view(1)
        for buffer, new in ((layer.keys, key), (layer.values, value)):
            shifted = torch.where(full, buffer.roll(-1, dims=2), buffer)
            shifted.index_copy_(2, slot, new.to(buffer.dtype))
            buffer.copy_(shifted)
        # transformers counts on the device only until the buffer is full (then its Python counter alone is read)
        layer.cumulative_length.copy_(torch.where(full, layer.cumulative_length, self.index + 1))
        return layer.keys, layer.values

    def advance(self) -> None:
        """After a replay (host side): the Python counters transformers' layer reads outside the graph."""
        for layer in self.layers.values():
            layer.cumulative_length_int += 1


class StepCache:
    """The cache as a captured step sees it: GDN/KDA layers as they are, the sliding-window layers' `update` through
    `WindowSteps` (the attention mixer only calls `cache.update`), and the full-attention layers' update without
    its per-layer index arithmetic: the token is written at the slot the layer's own counter holds (transformers'
    StaticLayer.update: arange + counter, then the counter advanced, per layer), and `advance` moves every full
    layer's counter on at the end of the step in one kernel."""

    def __init__(self, cache: StaticCache, windows: WindowSteps | None):
        self.cache, self.windows, self.layers = cache, windows, cache.layers
        self._full = [layer for layer in cache.layers if _is_full(layer)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.windows is not None and layer_idx in self.windows.layers:
            return self.windows.update(layer_idx, key, value)
        layer = self.layers[layer_idx]
        if not _is_full(layer) or key.shape[-2] != 1:
            return self.cache.update(key, value, layer_idx, *args, **kwargs)
        slot = layer.cumulative_length.view(1)  # this step's cache index (advanced after the step: `advance`)
        layer.keys.index_copy_(2, slot, key)
        layer.values.index_copy_(2, slot, value)
        return layer.keys, layer.values

    def kernel_kv_layer(self, layer_idx: int) -> KernelKVLayer | None:
        """The full-attention layer `layer_idx`, whose `update` this step cache does by its counter, as the fused
        attention kernels write it (attention_step.py: the token at `cumulative_length`); None for any other layer."""
        layer = self.layers[layer_idx]
        if not _is_full(layer) or (self.windows is not None and layer_idx in self.windows.layers):
            return None
        return KernelKVLayer(layer.keys, layer.values, layer.cumulative_length)

    def advance(self) -> None:
        """After every layer of the step (captured): each full layer's counter + 1, as its update would have done."""
        if self._full:
            torch._foreach_add_([layer.cumulative_length for layer in self._full], 1)


def _is_full(layer) -> bool:
    return isinstance(layer, StaticLayer) and not isinstance(layer, StaticSlidingWindowLayer)


def _check_room(layout: "CacheLayout") -> None:
    """Refuses a step whose token has no slot left in a full-attention layer of the static cache: the captured write
    would index past the buffer, which on a GPU is a device-side assertion that leaves the process's CUDA context
    unusable. Read from the host-side token count of the GDN/KDA layers (no synchronisation); a cache without them or
    without full-attention layers has nothing to check."""
    if not layout.linear or not layout.has_full:
        return
    written, slots = layout.linear[0].seen_tokens, layout.full_length
    if written >= slots:
        raise ValueError(f"the static cache holds {slots} tokens per row and all {written} slots are written: this "
                         f"decoding step's token has no slot. {static_cache_room_fix(written + 1)}")


class CacheLayout:
    """What the per-step checks read of one cache, found once per cache object (its layer list is fixed): the
    GDN/KDA layers, the attention layers, the key slots of the full-attention ones (`_full_length`)."""

    def __init__(self, cache: StaticCache):
        self.cache = weakref.ref(cache)
        self.count = len(cache.layers)
        self.linear = [layer for layer in cache.layers if isinstance(layer, LinearStateLayer)]
        self.attention = [layer for layer in cache.layers if isinstance(layer, StaticLayer)]
        self.unknown = self.count - len(self.linear) - len(self.attention)  # neither: never ready for a capture
        self.has_full = any(_is_full(layer) for layer in cache.layers)
        self.full_length = _full_length(cache)

    def describes(self, cache: StaticCache) -> bool:
        return self.cache() is cache and len(cache.layers) == self.count

    def ready(self) -> bool:
        """Whether the prefill has run (eagerly) and sized every buffer."""
        return (not self.unknown and all(layer.has_previous_state[0] for layer in self.linear)
                and all(layer.is_initialized for layer in self.attention))


def weights_of(model: torch.nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """(holder, name, tensor) for every parameter and buffer of the model: what a captured step reads by address."""
    return [(holder, name, tensor) for module in model.modules()
            for holder in (module._parameters, module._buffers) for name, tensor in holder.items()
            if tensor is not None]


def weights_moved(weights: list[tuple[dict, str, torch.Tensor]], addresses: list[int]) -> bool:
    """Whether a parameter or buffer was replaced (`load_state_dict(assign=True)`) or given new data (`.data = `,
    `module.to`) since `weights` and their `addresses` were taken."""
    return (any(holder.get(name) is not tensor for holder, name, tensor in weights)
            or [tensor.data_ptr() for _, _, tensor in weights] != addresses)


class WeightsRead:
    """What a captured graph read of the model's weights, taken at its capture, to tell when a replay would read
    stale ones: the kept derived values (`ChangeWatch`: norms' 1 + w, stacked weights) and every parameter and buffer
    with its address (`weights_of`). Shared by the decoding step's, the prompts' and the verify rounds' graphs."""

    def __init__(self, model: torch.nn.Module):
        self.watch = ChangeWatch(derived_weights(model))
        self.weights = weights_of(model)
        self.addresses = [tensor.data_ptr() for _, _, tensor in self.weights]

    def changed(self, check_addresses: bool = True) -> bool:
        """Whether a kept derived value was updated, or (with `check_addresses`) a parameter or buffer replaced or
        given new storage."""
        return self.watch.changed(addresses=check_addresses) or (
            check_addresses and weights_moved(self.weights, self.addresses))


def _full_length(cache: StaticCache) -> int:
    """The key slots of the full-attention layers (1 without any: their key mask is then unused). Sliding layers'
    buffers are shorter, and masked from `WindowSteps.recent`."""
    return max([layer.get_max_length() for layer in cache.layers if _is_full(layer)] + [1])


def records_past(cache: StaticCache, layout: CacheLayout | None = None) -> bool:
    """Whether the cache records its past (`activate_past_recording`, as assisted generation asks): its forwards then
    keep what a crop restores (state_rollback.py, static_window_rollback.py), which a replayed graph does not. With
    the cache's `layout`, its first GDN/KDA layer answers (the call reaches every layer; one read per step)."""
    if layout is not None and layout.linear:
        return layout.linear[0].record_past
    return any(getattr(layer, "record_past", False) for layer in cache.layers)


def capture_obstacle(model, attention_mask) -> str | None:
    """What keeps any forward of `model` from being captured, a step or a prompt (None when nothing does): one line,
    with the fix."""
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        return "the attention mask is not a 2-D [batch, length] tensor (pass the 2-D padding mask)"
    attention = config_value(model.config, "_attn_implementation", "_attn_implementation_internal")
    if attention not in ("sdpa", "eager"):
        return f"attn_implementation {attention!r} is not captured (use 'sdpa' or 'eager')"
    if not graph_capturable_expert_dispatch(config_value(model.config, "distributed_config")):
        return ("expert parallelism's all-to-all dispatch reads its split sizes on the host (use the all-reduce "
                "dispatch to capture)")
    return None


KEPT_STEP_GRAPHS = 8  # captured steps kept per model (batch sizes and cache sizes), the least recently replayed dropped


class StepGraph:
    """One captured step: the graph, its input buffers (refilled before each replay), the logits buffer it refills,
    the cache storage it reads and writes, and the weights it read at capture."""

    def __init__(self, cache: StaticCache, layout: "CacheLayout", batch: int, max_len: int, device: torch.device):
        self.has_attention, self.has_full = bool(layout.attention), layout.has_full
        sliding = any(isinstance(layer, StaticSlidingWindowLayer) for layer in cache.layers)
        self.windows = WindowSteps(cache, batch, device) if sliding else None
        self.step_cache = StepCache(cache, self.windows)
        self.cache: weakref.ref = weakref.ref(cache)  # the cache served last (not kept alive)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.slot_numbers = torch.arange(max_len, device=device)
        self.mask_length = 0
        self.graph = self.logits = None
        self.storage: CacheStorage | None = None
        self.read: WeightsRead | None = None  # the weights the graph read, at capture

    def serve(self, cache: StaticCache) -> bool:
        """Points the step's Python-side helpers at `cache` (bound to the storage already); True for a cache other
        than the one served last (a run of steps starts)."""
        if self.cache() is cache:
            return False
        self.cache = weakref.ref(cache)
        self.step_cache = StepCache(cache, self.windows)
        if self.windows is not None:
            self.windows.bind(cache)
        return True

    def stale(self, check_addresses: bool) -> bool:
        """Whether the graph was destroyed (recorded_graphs), or a weight it reads changed: a kept derived value
        updated in place (per step), or (where a run of steps starts) a parameter or buffer replaced or given new
        storage."""
        return self.graph.expired or self.read.changed(check_addresses)


class CudaGraphDecoder:
    """Captures `model.model.decode_step` + the LM head per (batch size, cache key slots, device), and replays it.

    Each captured step (`StepGraph`) reads and writes the storage of its cache shape (`graph_cache_storage`), shared
    with the prompt graphs of that shape. Before each replay the cache of the step is bound to that storage: a cache
    whose tensors are not there (another cache of the same shape, as `generate(..., cache_implementation="static")`
    makes one per call, or tensors that beam search's `reorder_cache` replaced with reordered copies) has its values
    moved into it and its tensors pointed at it, and tensors bound before that are still held elsewhere (an earlier
    cache, a user's reference) keep their values in storage of their own. So no replay reads memory the cache has let
    go of, and a new cache costs a copy of its values, not a capture. The weights the graph reads are checked the same
    way, in two depths (`step`): per step, the in-place updates that change a kept derived value; where a run of
    steps starts (after an uncaptured forward, another cache or another captured step), also every parameter's and
    buffer's identity and address, so a weight given new storage between two generations is captured again rather
    than read from the storage it let go of. The KEPT_STEP_GRAPHS most recently replayed steps are kept; `generate`
    sizes static caches in few buckets (static_cache_slots), so a process meets few keys. The host work before a
    replay is what the GPU waits for at batch 1 wherever transformers reads each step's tokens on the host before the
    next step (a stop check not deferred: deferred_stop_check), so the per-step checks read memoised layouts
    (`CacheLayout`) and plain config values (`config_value`)."""

    device_types = ("cuda",)  # tests add "cpu", with `_record` replaced by an eager stand-in

    def __init__(self, storages: CacheStorages | None = None):
        self.storages = storages if storages is not None else CacheStorages()
        self._graphs: OrderedDict[tuple, StepGraph] = OrderedDict()  # least recently replayed first
        self._last_key = None
        self._new_run = True  # the next step starts a run of steps: the weights' addresses are checked too
        self._layout: CacheLayout | None = None  # of the last cache asked about
        self._failed: dict = {}  # capture keys whose capture failed -> the error (not tried again)
        self._warned: set[str] = set()
        self._pool = None  # one memory pool for the captured steps (replayed one at a time)

    def __reduce__(self):
        """Copies (copy.deepcopy of the model, pickling) start with nothing captured: a CUDA graph cannot be copied,
        and it reads the original's weights and cache buffers, not the copy's."""
        return CudaGraphDecoder, ()

    @property
    def captured_keys(self) -> list[tuple]:
        """The (batch, key slots, device) of each kept captured step, least recently replayed first."""
        return list(self._graphs)

    @property
    def last_graph(self):
        """The CUDA graph of the step replayed last (None before any): what profiling replays on its own."""
        step = self._graphs.get(self._last_key)
        return step.graph if step is not None else None

    @staticmethod
    def wanted(model, input_ids, inputs_embeds, cache) -> bool:
        """Whether this forward is a step graph decoding serves: one token per row on a graph device, no gradient,
        against a static cache (`generate(..., cache_implementation="static")`)."""
        return (input_ids is not None and inputs_embeds is None and input_ids.dim() == 2 and input_ids.shape[1] == 1
                and input_ids.device.type in CudaGraphDecoder.device_types and not torch.is_grad_enabled()
                and not model.training and isinstance(cache, StaticCache))

    def layout(self, cache: StaticCache) -> CacheLayout:
        if self._layout is None or not self._layout.describes(cache):
            self._layout = CacheLayout(cache)
        return self._layout

    def obstacle(self, model, cache, attention_mask, kwargs) -> str | None:
        """Why a wanted step cannot be captured (None when it can): one line, with the fix."""
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            return "attention weights or hidden states were requested (the captured step returns logits only)"
        reason = capture_obstacle(model, attention_mask)
        if reason is not None:
            return reason
        if not self.layout(cache).ready():
            return "the static cache has not been filled by a prefill of this model (run the prompt first)"
        if records_past(cache, self.layout(cache)):
            return ("the cache records its past for assisted decoding (a crop restores what uncaptured forwards "
                    "keep: state_rollback.py)")
        return None

    def applies(self, model, input_ids, inputs_embeds, cache, attention_mask, kwargs) -> bool:
        return (self.wanted(model, input_ids, inputs_embeds, cache)
                and self.obstacle(model, cache, attention_mask, kwargs) is None)

    def ran_uncaptured(self) -> None:
        """Told by the model's uncaptured forward (a prefill, a step that could not be captured): the next replay
        starts a new run of steps, for which the weights' addresses are checked again (see `step`)."""
        self._new_run = True

    def warn_once(self, reason: str) -> None:
        """The one-line warning that a step runs uncaptured, once per model (this decoder) and reason."""
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning(f"CUDA-graph decoding: this step runs uncaptured (slower): {reason}.")

    def try_step(self, model, input_ids, position_ids, attention_mask, cache, kwargs) -> torch.Tensor | None:
        """The logits of a captured step, or None (after a once-per-reason warning) when the uncaptured forward must
        run: the step cannot be captured, or its capture failed."""
        layout = self.layout(cache)
        if not layout.unknown and not layout.ready():  # (a one-token prompt: this forward is the prefill, run as one)
            return None
        reason = self.obstacle(model, cache, attention_mask, kwargs)
        if reason is None:
            key = storage_key(input_ids.shape[0], layout, input_ids.device)
            _check_room(layout)
            if key not in self._failed:
                logits = self.step(model, input_ids, position_ids, attention_mask, cache, key)
                if logits is not None:
                    return logits
            reason = self._failed[key]
        self.warn_once(reason)
        return None

    def step(self, model, input_ids, position_ids, attention_mask, cache: StaticCache,
             key: tuple) -> torch.Tensor | None:
        """The logits of the step replayed from the graph of `key` (captured first if needed); None if the capture
        failed (the error is kept in `_failed` under `key`, and the cache is left as it was)."""
        graph = self._graphs.get(key)
        bound = graph is not None and self.storages.bind(cache, key) is graph.storage  # (None: it did not fit)
        if bound:
            fresh = graph.serve(cache) or self._new_run or key != self._last_key
        if not bound or graph.stale(check_addresses=fresh):
            self._graphs.pop(key, None)
            try:
                graph = self._capture(model, cache, key)
            except Exception as error:  # an op that cannot be captured (a host synchronisation, an unsupported call)
                self._failed[key] = capture_failure("the step", error)
                return None
            self._graphs[key] = graph
            while len(self._graphs) > KEPT_STEP_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        self._new_run, self._last_key = False, key
        return self._replay(graph, input_ids, position_ids, attention_mask, cache)

    def _replay(self, graph: StepGraph, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        batch, max_len = input_ids.shape[0], graph.key_mask.shape[1]
        graph.ids.copy_(input_ids)
        past = cache.get_seq_length() if graph.has_attention else None  # a device tensor: no synchronisation
        if position_ids is not None:
            graph.positions.copy_(position_ids)
        elif past is not None:
            graph.positions.copy_(past.view(1, 1).expand(batch, 1))
        if graph.windows is not None:
            graph.windows.prepare(past, attention_mask)
        if past is not None and graph.has_full:  # cache slots holding real tokens once this step's token is written
            if attention_mask is None:
                # one kernel (the slot numbers kept; comparing into the buffer): not arange, compare, copy
                own_slot = past.view(1, 1) if isinstance(past, torch.Tensor) else past  # (a device counter, or an int)
                torch.le(graph.slot_numbers.expand(batch, -1), own_slot, out=graph.key_mask)
                graph.mask_length = max_len
            else:  # slots past the mask stay False: zeroed at capture, and again where a longer mask wrote
                length = attention_mask.shape[1]
                graph.key_mask[:, :length].copy_(attention_mask)
                if length < graph.mask_length:
                    graph.key_mask[:, length : graph.mask_length].zero_()
                graph.mask_length = length
        linear = self.layout(cache).linear
        written = [layer.seen_tokens for layer in linear]
        graph.graph.replay()
        for layer, count in zip(linear, written):  # set, not added to: a stand-in replay that runs the step's Python
            layer.seen_tokens = count + 1          # (the CPU tests') counts it once as well
        if graph.windows is not None:
            graph.windows.advance()
        return graph.logits.clone()

    @staticmethod
    def _record(run, device, reset, pool) -> tuple[RecordedGraph, torch.Tensor]:
        return record_graph(run, device, pool, reset=reset)  # (tests stand in an eager replay here)

    def _capture(self, model, cache, key) -> StepGraph:
        batch, _, device = key
        layout = self.layout(cache)
        graph = StepGraph(cache, layout, batch, layout.full_length, device)
        graph.storage = self.storages.storage_for(cache, key)  # (the cache's tensors are that storage from here)
        linear_layers = layout.linear
        seen = [layer.seen_tokens for layer in linear_layers]
        saved = [t.clone() for t in cache_tensors(cache)]

        def run():
            # sparse MoE layers: an experts implementation without host syncs for this dtype and device; the GEMVs
            # (the LM head's too) through this package's Triton kernel (kernels_gemv)
            with decode_gemv_mode(device):
                with graph_safe_experts(model.config, model.lm_head.weight.dtype, device.type):
                    hidden = model.model.decode_step(graph.ids, graph.positions, graph.key_mask, graph.step_cache,
                                                    graph.windows)
                graph.step_cache.advance()
                return model.lm_head(hidden)

        def restore():  # the cache as the warm-up steps found it
            for tensor, value in zip(cache_tensors(cache), saved):
                tensor.copy_(value)
            for layer, count in zip(linear_layers, seen):
                layer.seen_tokens = count

        if self._pool is None and device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        try:
            graph.graph, graph.logits = self._record(run, device, restore, self._pool)
        finally:  # the warm-up steps advanced the cache (also when the capture failed): undo them
            restore()
        graph.read = WeightsRead(model)
        return graph


def storage_key(batch: int, layout: CacheLayout, device: torch.device) -> tuple:
    """The key of a cache's captured graphs and their storage: (batch, the full-attention layers' key slots, or None
    without any, device)."""
    return batch, layout.full_length if layout.has_full else None, device
