"""The cache of batched speculative decoding: per-row lengths, so each row keeps its own accepted prefix.

A verify step runs k tokens per row (the row's last token, then k - 1 drafted ones) and each row accepts its own
number of them. transformers' caches hold one length for the whole batch, so rows that accept fewer tokens would
leave rejected keys between their accepted ones. This cache keeps, on the device:

- `lengths` [B]: the slots each row has written (its left padding included), `pads` [B]: its left padding. Row b's
  tokens sit in slots pads[b] .. lengths[b] - 1, contiguous: a verify step writes its k tokens at slots
  lengths[b] .. lengths[b] + k - 1 of each row (a scatter), and keeping m of them is `lengths[b] += m`. The rejected
  keys past the new length are stale, never attended (the mask below), and overwritten by the next step. So the
  slots are the row's positions shifted by its padding: position = slot - pads[b], the same for every layer.
- per attention layer (full, sliding window and latent attention alike), key and value buffers [B, H, slots, D]:
  query t of row b (slot lengths[b] + t) sees slot s when pads[b] <= s <= lengths[b] + t, and for a sliding layer of
  window w also s > lengths[b] + t - w (`key_mask`). Exact: each row attends to exactly the keys, at exactly the
  positions, that it would alone, whatever the other rows accepted. A sliding layer keeps every slot (its window is
  in the mask), so nothing it needs is ever pushed out.
- per GDN/KDA layer, its conv and recurrent states (a `LinearStateLayer`, updated in place by the forward) and the
  window of the last verify step's tokens, from which `restore` puts each row back to its own kept prefix: a
  `RollbackWindow` (state_rollback.py: the delta rule over the step's tokens from the state before it, the tokens past
  the row's count neutral, as pads are), or on CUDA a `verify_delta_rule.KernelRoundWindow` (a kernel that runs each
  row's own count of them).

Every tensor has a fixed size and address once allocated (the first prefill), and nothing reads a value on the host:
a verify step, its acceptance and its restore can be captured in one CUDA graph (speculative_decoding.py).
"""

from __future__ import annotations

import torch

from .attention_step import KernelKVLayer
from .cache_hybrid_linear import LinearStateLayer
from .mixer_attention import additive_mask
from .state_rollback import MAX_ROLLBACK_TOKENS


class VerifyLinearLayer(LinearStateLayer):
    """A GDN/KDA layer's states in a `VerifyCache`: a forward of 2 to MAX_ROLLBACK_TOKENS tokens onto a filled state
    keeps its window (also while a CUDA graph captures it: the window's tensors are the graph's, refilled by each
    replay, and read by `restore` in the same graph); a prompt keeps none. The window holds the forward's own tensors,
    not copies: nothing writes them before `restore` reads them in the same round. Such a forward leaves the states
    as they were (its window's base is the recurrent state itself, its own final states are not stored): `restore`,
    which `verify_round` runs after it, writes each row's."""

    window_copies = False
    restores_every_window = True

    def window_plan(self, tokens: int, packed: bool) -> str | None:
        if (packed or torch.is_grad_enabled() or not self.has_previous_state[0]
                or not 1 < tokens <= MAX_ROLLBACK_TOKENS):
            self.rollback = None
            return None
        return "new"

    def keep_window(self, window, plan: str) -> None:
        self.rollback = window

    def restore(self, kept: torch.Tensor, shared: dict) -> None:
        """Each row back to the state after its first kept[b] tokens of the last forward (kept [B] on the device;
        `shared`: what the round's layers share, made by the first: `RollbackWindow.restore_into`)."""
        if self.rollback is None:
            raise ValueError("restore: this GDN/KDA layer's last forward kept no window (a verify step of 2 to "
                             f"{MAX_ROLLBACK_TOKENS} tokens onto the prompt's state keeps one).")
        # the base is the state itself (restores_every_window): the rule may write the restored state over it
        self.rollback.restore_into(kept, self.recurrent_states[0], self.conv_states[0], shared)


class VerifyKVLayer:
    """An attention layer's keys and values in a `VerifyCache` ([B, H, slots, D], allocated by the first update)."""

    def __init__(self, window: int | None):
        self.window = window  # the sliding window, None for full attention
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None


class VerifyCache:
    """Fixed-size device state of batched speculative decoding with per-row lengths (see the module docstring).

    model: a HybridLinearForCausalLM; batch rows; slots per row (the prompt, the new tokens and two verify steps:
    speculative_generate says why); layers: the decoder layers whose states it holds, by their layer_idx (default:
    the model's; an MTP head passes its own, with the head as `model`: mtp_drafting.MtpBatchDrafter)."""

    every_query_sees_a_key = True  # (`key_mask`: a pad's query sees its own slot; attention_one_query relies on it)

    def __init__(self, model, batch: int, slots: int, device: torch.device, layers=None):
        config = model.config
        layers = model.model.layers[: config.num_hidden_layers] if layers is None else layers
        self.layers: list[VerifyKVLayer | VerifyLinearLayer] = []
        for i, layer in enumerate(layers):
            if layer.mixer_state == "kv":
                window = (config.per_layer_config[i].sliding_window
                          if config.layer_types[i] == "sliding_attention" else None)
                self.layers.append(VerifyKVLayer(window))
            else:
                self.layers.append(VerifyLinearLayer())
        self.batch, self.slots, self.device = batch, slots, device
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.pads = torch.zeros(batch, dtype=torch.long, device=device)
        self._slot_numbers = torch.arange(slots, device=device)
        # whether the prompts are in (`prompts_written`): the fused attention kernels then take its forwards
        self.holds_prompts = False

    @property
    def linear_layers(self) -> list[VerifyLinearLayer]:
        return [layer for layer in self.layers if isinstance(layer, VerifyLinearLayer)]

    @property
    def windows(self) -> set[int | None]:
        """The distinct sliding windows of the attention layers (None: full attention)."""
        return {layer.window for layer in self.layers if isinstance(layer, VerifyKVLayer)}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes the step's keys and values [B, H, T, D] at each row's slots lengths[b] .. lengths[b] + T - 1 (the
        lengths move on in `restore`); returns the whole buffers."""
        layer = self.layers[layer_idx]
        B, H, T, _ = key.shape
        if layer.keys is None:
            layer.keys = key.new_zeros(B, H, self.slots, key.shape[-1])
            layer.values = value.new_zeros(B, value.shape[1], self.slots, value.shape[-1])
        index = (self.lengths[:, None] + torch.arange(T, device=key.device))[:, None, :, None]  # [B, 1, T, 1]
        layer.keys.scatter_(2, index.expand(B, H, T, key.shape[-1]), key.to(layer.keys.dtype))
        layer.values.scatter_(2, index.expand(B, value.shape[1], T, value.shape[-1]),
                              value.to(layer.values.dtype))
        return layer.keys, layer.values

    def kernel_kv_layer(self, layer_idx: int) -> KernelKVLayer | None:
        """The attention layer `layer_idx` as the fused attention kernels write it (attention_step.py: token t of row
        b at slot lengths[b] + t, as `update`), for the verify rounds and drafting steps after the prompts; None for
        a GDN/KDA layer, and for the prompts' forward (the torch path, whatever their length: so a call's tokens do
        not depend on whether an earlier call allocated the buffers, kept_verify_rounds.py)."""
        layer = self.layers[layer_idx]
        if not self.holds_prompts or not isinstance(layer, VerifyKVLayer) or layer.keys is None:
            return None
        return KernelKVLayer(layer.keys, layer.values, self.lengths)

    def prompt_padding(self, attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
        """Takes each row's left padding (`pads`) from the prompts' 2-D mask [B, `length`] (None: no padding) and
        returns their real tokens [B, length] bool, or None where every token is real (a host read: before the
        prompts' forward, never in a captured round)."""
        if attention_mask is None:
            return None
        real = attention_mask.to(self.device).bool()
        self.pads.copy_(length - real.sum(-1))
        return None if bool(real.all()) else real

    def prompts_written(self, length: int) -> None:
        """After the prompts' forward: every row holds `length` slots (its padding included); a prompt keeps no
        rollback window."""
        self.lengths.fill_(length)
        self.holds_prompts = True
        for layer in self.linear_layers:
            layer.rollback = None

    def query_slots(self, tokens: int) -> torch.Tensor:
        """[B, T]: the slot of each of the step's tokens."""
        return self.lengths[:, None] + torch.arange(tokens, device=self.lengths.device)

    def positions(self, tokens: int) -> torch.Tensor:
        """[B, T]: the position of each of the step's tokens (its slot less the row's padding; pads at 0)."""
        return (self.query_slots(tokens) - self.pads[:, None]).clamp(min=0)

    def key_mask(self, tokens: int, window: int | None) -> torch.Tensor:
        """[B, 1, T, slots] bool: the slots each query of the step sees (module docstring); a query in the padding
        (a prompt's) sees its own slot alone, so no row of the mask is empty."""
        slots = self._slot_numbers[None, None, :]
        query = self.query_slots(tokens)[:, :, None]
        visible = (slots <= query) & (slots >= self.pads[:, None, None])
        if window is not None:
            visible &= slots > query - window
        return (visible | (slots == query))[:, None]

    def attention_mask(self, tokens: int, window: int | None, dtype: torch.dtype, eager: bool) -> torch.Tensor:
        """`key_mask` as the additive [B, 1, T, slots] mask the attention layers take: 0 where a query sees a slot,
        -inf elsewhere (eager attention: the dtype's lowest finite value, as transformers' eager masks)."""
        return additive_mask(self.key_mask(tokens, window), dtype, eager)

    def restore(self, kept: torch.Tensor) -> None:
        """Keeps the first kept[b] tokens of the last forward in row b ([B] on the device, 0 to its tokens)."""
        shared: dict = {}  # (the masks every layer's restore reads, made once)
        for layer in self.linear_layers:
            layer.restore(kept, shared)
        self.lengths.add_(kept)

    def start_over(self) -> None:
        """Empties the cache for new prompts, every buffer kept where it is (a captured round reads them by address:
        kept_verify_rounds.py): no row holds a token, the GDN/KDA layers' states are zero and unseen; the attention
        layers' stale keys are past every row's length: never attended, and overwritten as the next call writes its."""
        self.lengths.zero_()
        self.pads.zero_()
        self.holds_prompts = False
        for layer in self.linear_layers:
            layer.reset()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a verify step reads and writes (what a capture saves and puts back around its warm-up)."""
        tensors = [self.lengths, self.pads]
        for layer in self.layers:
            if isinstance(layer, VerifyLinearLayer):
                tensors += [layer.conv_states[0], layer.recurrent_states[0]]
            else:
                tensors += [layer.keys, layer.values]
        return tensors


__all__ = ["VerifyCache", "VerifyKVLayer", "VerifyLinearLayer"]
