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
import weakref
from collections.abc import Callable

import torch
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

from .cache_hybrid_linear import LinearStateLayer
from .configuration_hybrid_linear import config_value
from .derived_weights import ChangeWatch, derived_weights
from .kernels_gemv import decode_gemv_mode
from .mlp_sparse_moe import graph_capturable_expert_dispatch, graph_safe_experts

logger = logging.getLogger(__name__)


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

    def full_layer(self, layer_idx: int) -> StaticLayer | None:
        """The full-attention layer `layer_idx` whose `update` this step cache does by its counter (None for any
        other): a fused attention step may write its token at `cumulative_length` itself (attention_step.py)."""
        layer = self.layers[layer_idx]
        windowed = self.windows is not None and layer_idx in self.windows.layers
        return layer if _is_full(layer) and not windowed else None

    def advance(self) -> None:
        """After every layer of the step (captured): each full layer's counter + 1, as its update would have done."""
        if self._full:
            torch._foreach_add_([layer.cumulative_length for layer in self._full], 1)


def cache_tensors(cache: StaticCache) -> list[torch.Tensor]:
    tensors = []
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            tensors += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            tensors += [layer.keys, layer.values, layer.cumulative_length]
    return tensors


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
                         "decoding step's token has no slot. Create the StaticCache with a larger max_cache_len (at "
                         "least the prompt length plus max_new_tokens), or let generate size it "
                         "(cache_implementation=\"static\" without a cache of your own).")


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


def _full_length(cache: StaticCache) -> int:
    """The key slots of the full-attention layers (1 without any: their key mask is then unused). Sliding layers'
    buffers are shorter, and masked from `WindowSteps.recent`."""
    return max([layer.get_max_length() for layer in cache.layers if _is_full(layer)] + [1])


def bind_to_storage(tensors: list[torch.Tensor], buffers: list[torch.Tensor],
                    bound: list[weakref.ref]) -> list[weakref.ref] | None:
    """Points a cache's `tensors` (`cache_tensors`) at `buffers`, the storage a captured graph reads and writes:
    each tensor elsewhere has its values copied in and is set to that storage, and the tensors `bound` to it before
    (an earlier cache, a user's reference) that are still alive and not among `tensors` keep their values in storage
    of their own. Returns the new bound references; None when the tensors do not fit the buffers (another layout)."""
    if len(tensors) != len(buffers) or any(
            t.shape != b.shape or t.stride() != b.stride() or t.dtype != b.dtype or t.device != b.device
            for t, b in zip(tensors, buffers)):
        return None
    current = {id(t) for t in tensors}
    try:
        for ref, buffer in zip(bound, buffers):
            earlier = ref()
            if earlier is not None and id(earlier) not in current and earlier.data_ptr() == buffer.data_ptr():
                earlier.set_(earlier.clone())
        for tensor, buffer in zip(tensors, buffers):
            if tensor.data_ptr() != buffer.data_ptr():
                buffer.copy_(tensor)
                tensor.set_(buffer)
    except RuntimeError:  # (e.g. inference tensors outside inference mode) a capture binds it instead
        return None
    return [weakref.ref(t) for t in tensors]


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


def record_graph(run: Callable[[], torch.Tensor], device: torch.device, pool=None,
                 reset: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of run() and the output buffer each replay refills, after two warm-up runs on a side stream
    (autotuning, lazy handles). pool: a memory pool shared with other graphs replayed one at a time. reset: called
    before the second warm-up run, so that both start from the same state (a decoding step writes its token at the
    cache's counter and moves it on: a second run from where the first left off would write one slot further, past
    the buffer when the step's token has the cache's last slot)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for warm_up in range(2):
            if warm_up and reset is not None:
                reset()
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class CudaGraphDecoder:
    """Captures `model.model.decode_step` + the LM head for one batch size and cache layout, and replays it.

    The graph reads and writes the storage of the cache tensors it was captured with (`_buffers`). Before each replay
    the cache of the step is bound to that storage (`_bind`): a cache whose tensors are not there (another cache of
    the same layout, as `generate(..., cache_implementation="static")` makes one per call, or tensors that beam
    search's `reorder_cache` replaced with reordered copies) has its values moved into it and its tensors pointed at
    it, and tensors bound before that are still held elsewhere (an earlier cache, a user's reference) keep their
    values in storage of their own. So no replay reads memory the cache has let go of, and a new cache costs a copy
    of its values, not a capture. The weights the graph reads are checked the same way, in two depths (`step`): per
    step, the in-place updates that change a kept derived value; where a run of steps starts (after an uncaptured
    forward, a newly bound cache), also every parameter's and buffer's identity and address, so a weight given new
    storage between two generations is captured again rather than read from the storage it let go of. The host
    work before a replay is what the GPU waits for at batch 1 wherever transformers reads each step's tokens on the
    host before the next step (a stop check not deferred: deferred_stop_check), so the per-step checks read
    memoised layouts (`CacheLayout`) and plain config values (`config_value`)."""

    device_types = ("cuda",)  # tests add "cpu", with `_record` replaced by an eager stand-in

    def __init__(self):
        self._key = None
        self._graph = None
        self._buffers: list[torch.Tensor] = []  # views of the cache storage the graph reads and writes
        self._bound: list[weakref.ref] = []  # the cache tensors viewing that storage, as bound for the last step
        self._step_cache: StepCache | None = None
        self._watch: ChangeWatch | None = None  # the kept tensors the graph reads (norms' 1 + w, stacked weights)
        self._weights: list = []  # every parameter and buffer at capture (`weights_of`), and their addresses
        self._addresses: list[int] = []
        self._new_run = True  # the next step starts a run of steps: the weights' addresses are checked too
        self._layout: CacheLayout | None = None  # of the last cache asked about
        self._windows: WindowSteps | None = None
        self._failed: dict = {}  # capture keys whose capture failed -> the error (not tried again)
        self._warned: set[str] = set()

    def __reduce__(self):
        """Copies (copy.deepcopy of the model, pickling) start with nothing captured: a CUDA graph cannot be copied,
        and it reads the original's weights and cache buffers, not the copy's."""
        return CudaGraphDecoder, ()

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
        reason = self.obstacle(model, cache, attention_mask, kwargs)
        if reason is None:
            layout = self.layout(cache)
            key = (input_ids.shape[0], layout.full_length, input_ids.device)  # (the cache is bound: `_bind`)
            _check_room(layout)
            if key not in self._failed:
                logits = self.step(model, input_ids, position_ids, attention_mask, cache, key)
                if logits is not None:
                    return logits
            reason = self._failed[key]
        self.warn_once(reason)
        return None

    def _bind(self, cache: StaticCache) -> bool:
        """Points the cache's tensors at the graph's storage (see the class docstring); False when they do not fit
        it (another layout: a capture is needed)."""
        tensors = cache_tensors(cache)
        if len(tensors) == len(self._bound) and all(ref() is t for ref, t in zip(self._bound, tensors)):
            return True  # the tensors bound for the last step
        bound = bind_to_storage(tensors, self._buffers, self._bound)
        if bound is None:
            return False
        self._bound = bound
        self._step_cache = StepCache(cache, self._windows)
        if self._windows is not None:
            self._windows.bind(cache)
        self._new_run = True
        return True

    def step(self, model, input_ids, position_ids, attention_mask, cache: StaticCache,
             key: tuple) -> torch.Tensor | None:
        """The logits of the step replayed from the graph (captured first if needed); None if the capture failed
        (the error is kept in `_failed` under the step's `key`, and the cache is left as it was)."""
        batch, max_len = input_ids.shape[0], key[1]
        # Per step: the derived weights' in-place updates (the graph reads the kept values). At the start of a run of
        # steps (after an uncaptured forward, a new cache bound): also the address of every weight, which new data
        # (`module.to`, `.data = `, a replaced parameter) changes: a graph would read the storage it let go of.
        if (key != self._key or not self._bind(cache) or self._watch.changed(addresses=self._new_run)
                or (self._new_run and weights_moved(self._weights, self._addresses))):
            try:
                self._capture(model, cache, batch, max_len, input_ids.device, key)
            except Exception as error:  # an op that cannot be captured (a host synchronisation, an unsupported call)
                self._graph, self._key = None, None
                first_line = (str(error).strip().splitlines() or [""])[0][:200]
                self._failed[key] = (f"capturing the step failed ({type(error).__name__}: {first_line}); "
                                     "model.set_cuda_graph_decoding(False) skips the attempt")
                return None
        self._new_run = False
        self._ids.copy_(input_ids)
        past = cache.get_seq_length() if self._has_attention else None  # a device tensor: no synchronisation
        if position_ids is not None:
            self._positions.copy_(position_ids)
        elif past is not None:
            self._positions.copy_(past.view(1, 1).expand(batch, 1))
        if self._windows is not None:
            self._windows.prepare(past, attention_mask)
        if past is not None and self._has_full:  # cache slots holding real tokens once this step's token is written
            if attention_mask is None:
                # one kernel (the slot numbers kept; comparing into the buffer): not arange, compare, copy
                own_slot = past.view(1, 1) if isinstance(past, torch.Tensor) else past  # (a device counter, or an int)
                torch.le(self._slot_numbers.expand(batch, -1), own_slot, out=self._key_mask)
                self._mask_length = max_len
            else:  # slots past the mask stay False: zeroed at capture, and again where a longer mask wrote
                length = attention_mask.shape[1]
                self._key_mask[:, :length].copy_(attention_mask)
                if length < self._mask_length:
                    self._key_mask[:, length : self._mask_length].zero_()
                self._mask_length = length
        linear = self.layout(cache).linear
        written = [layer.seen_tokens for layer in linear]
        self._graph.replay()
        for layer, count in zip(linear, written):  # set, not added to: a stand-in replay that runs the step's Python
            layer.seen_tokens = count + 1          # (the CPU tests') counts it once as well
        if self._windows is not None:
            self._windows.advance()
        return self._logits.clone()

    @staticmethod
    def _record(run, device, reset) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        return record_graph(run, device, reset=reset)  # (tests stand in an eager replay here)

    def _capture(self, model, cache, batch, max_len, device, key) -> None:
        self._graph = None  # release the previous graph's memory pool first
        self._buffers, self._bound = [], []
        layout = self.layout(cache)
        self._has_attention, self._has_full = bool(layout.attention), layout.has_full
        sliding = any(isinstance(layer, StaticSlidingWindowLayer) for layer in cache.layers)
        self._windows = WindowSteps(cache, batch, device) if sliding else None
        self._step_cache = StepCache(cache, self._windows)
        self._ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self._slot_numbers = torch.arange(max_len, device=device)
        self._mask_length = 0
        linear_layers = layout.linear
        seen = [layer.seen_tokens for layer in linear_layers]
        saved = [t.clone() for t in cache_tensors(cache)]

        def run():
            # sparse MoE layers: an experts implementation without host syncs for this dtype and device; the GEMVs
            # (the LM head's too) through this package's Triton kernel (kernels_gemv)
            with decode_gemv_mode(device):
                with graph_safe_experts(model.config, model.lm_head.weight.dtype, device.type):
                    hidden = model.model.decode_step(self._ids, self._positions, self._key_mask, self._step_cache,
                                                    self._windows)
                self._step_cache.advance()
                return model.lm_head(hidden)

        def restore():  # the cache as the warm-up steps found it
            for tensor, value in zip(cache_tensors(cache), saved):
                tensor.copy_(value)
            for layer, count in zip(linear_layers, seen):
                layer.seen_tokens = count

        try:
            self._graph, self._logits = self._record(run, device, restore)
        finally:  # the warm-up steps advanced the cache (also when the capture failed): undo them
            restore()
        tensors = cache_tensors(cache)
        self._buffers = [t.detach() for t in tensors]  # (views: the storage stays while the graph is kept)
        self._bound = [weakref.ref(t) for t in tensors]
        self._key = key
        self._watch = ChangeWatch(derived_weights(model))
        self._weights = weights_of(model)
        self._addresses = [tensor.data_ptr() for _, _, tensor in self._weights]
