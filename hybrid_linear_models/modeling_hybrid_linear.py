"""Hybrid linear-attention decoder: every layer picks its token mixer (softmax attention, sliding-window attention,
Gated DeltaNet or Kimi Delta Attention) from `config.mixer_types` and its MLP from `config.mlp_types` (the dense gated
MLP by default), pre-norm residual blocks (Qwen3-Next's architecture, with the mixers freely interleaved). Both come
from their registrations (`mixer_registry`, `mlp_registry`)."""

import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DistributedConfig
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    prepare_padding_mask,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from . import fla_backend
from .block_ops import fused_causal_lm_loss
from .cache_checks import check_cache, check_static_cache_size
from .checkpoint_dtypes import check_checkpoint_dtypes
from .cache_hybrid_linear import adopt_linear_layers, generation_cache, linear_layer_cache, past_length
from .speculative_decoding import (assisted_generate_batch, batched_loop_refuses, cap_drafts,
                                   check_assisted_request)
from .static_window_rollback import adopt_static_window_layers
from .chunked_recurrence import recur_in_token_chunks, recurrence_chunks_apply
from .configuration_hybrid_linear import HybridLinearConfig
from .cuda_graph_decoding import CudaGraphDecoder, capture_obstacle
from .cuda_graph_prefill import CudaGraphPrefill
from .graph_cache_storage import CacheStorages
from .static_cache_slots import static_cache_slots
from .streamed_loading import streamed_state_dict
from .warm_up import WarmUpReport, warm_up
from .deferred_stop_check import deferred_stop_checks
from .derived_weights import DerivedWeight
from .device_memory_check import check_weights_fit
from .device_placement import placement_device
from .fp8_layers import init_fp8_weights, quantize_module, quantize_modules
from .fp8_settings import check_requested_quantization
from .mixer_attention import (  # noqa: F401  (kept importable)
    DESCRIBED_MASK_QUERIES, UNBOUNDED_WINDOW, HybridLinearAttention, RotaryTables, SlidingWindowMask)
from .kept_verify_rounds import KeptVerifyRounds
from .mixer_attention import additive_mask
from .component_registry import all_specs
from .mixer_registry import MIXERS
from .mlp_dense import HybridLinearMLP  # noqa: F401  (defined with its registration in mlp_dense; importable here too)
from .mlp_registry import MLPS
from .model_inputs import check_inputs, token_indices
from .position_limit import model_position_limit, warn_if_input_past_positions, warn_past_positions
from .mlp_sparse_moe import (
    EXPERTS_IMPLEMENTATIONS,
    HybridLinearTopKRouter,
    check_expert_parallel_size,
)
from .moe_load_balancing import load_balancing_loss
from .mtp_drafting import check_mtp_generation
from .mtp_head import (check_mtp_kind, check_mtp_loss_inputs, mtp_positions, shifted_labels, valid_entries,
                       with_carried_head)
from .mtp_heads import MTP_HEADS
from .mtp_parallel_heads import hidden_states_asked, trunk_index, with_hidden_state
from .norms import GatedRMSNorm, HybridLinearRMSNorm
from .sequence_info import SequenceInfo, build_sequence_info, may_hold_padding
from .short_convolution import ShortConvolution


class HybridLinearRotaryEmbedding(nn.Module):
    """cos/sin tables for the rotated part of each attention head (head_dim * partial_rotary_factor dims)."""

    def __init__(self, config: HybridLinearConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        init_fn = (self.compute_default_rope_parameters if self.rope_type == "default"
                   else ROPE_INIT_FUNCTIONS[self.rope_type])
        inv_freq, self.attention_scaling = init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)
        self._signed_inv_freq = DerivedWeight()

    @staticmethod
    def compute_default_rope_parameters(config: HybridLinearConfig, device=None, **kwargs):
        dim = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    @torch.no_grad()
    def whole_head(self, x: torch.Tensor, position_ids: torch.Tensor,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """`RotaryTables.whole_head`'s (cos', sin') straight from the positions, and the rotated width: with the
        frequencies f' = [-f | f | 0], cos(p f') = [cos | cos | 1] and sin(p f') = [-sin_1 | sin_2 | 0] (cos is even,
        sin odd: the same values as `forward`'s, element for element), in a few kernels. None for rope types whose
        frequencies follow the positions (dynamic, longrope): `forward` updates them; and for an attention scaling
        (yarn) with unrotated dims, which must stay 1 and 0 (the caller builds the tables from (cos, sin))."""
        inv_freq = self.inv_freq
        rotary = 2 * inv_freq.shape[0]
        if ("dynamic" in self.rope_type or self.rope_type == "longrope"
                or (self.attention_scaling != 1.0 and rotary < head_dim)):
            return None
        signed = self._signed_inv_freq.get([inv_freq], lambda: torch.cat([
            -inv_freq.float(), inv_freq.float(), inv_freq.new_zeros(head_dim - rotary, dtype=torch.float32)]),
            tag=(head_dim, x.device))
        freqs = position_ids[..., None].float() * signed.to(x.device)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:  # (x * 1.0 is x: skipped)
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype), rotary


class HybridLinearDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        """config: the model's; the layer reads its own settings, config.per_layer_config[layer_idx]."""
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]  # transformers' ("linear_attention", ...)
        self.mixer_type = config.mixer_types[layer_idx]
        mixer = MIXERS[self.mixer_type]  # its registration (mixer_registry)
        self.mixer_attribute, self.mixer_state = mixer.attribute, mixer.state
        setattr(self, mixer.attribute, mixer.module_class(config, layer_idx))
        settings = config.per_layer_config[layer_idx]
        self.mlp_type = config.mlp_types[layer_idx]
        self.mlp = MLPS[self.mlp_type].module_class(config, layer_idx)  # its registration (mlp_registry)
        norm = lambda: HybridLinearRMSNorm(settings.hidden_size, settings.rms_norm_eps, settings.zero_centered_norms)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        quantize_modules(self, f"model.layers.{layer_idx}.", config.block_fp8_settings)  # FP8 layers (fp8_layers)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        sequence_info: SequenceInfo,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self._mix(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                  sequence_info, cache, **kwargs)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual=residual)  # fused add
        return residual + self.mlp(hidden_states)

    def _mix(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor | None,
             sequence_info: SequenceInfo, cache: Cache | None, **kwargs) -> torch.Tensor:
        """The mixer on the normed hidden states: attention-like ("kv") mixers take the rotary tables, mask and
        cache; recurrent ones the sequence layout and their cache layer."""
        mixer = getattr(self, self.mixer_attribute)
        if self.mixer_state == "kv":
            return mixer(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)[0]
        layer_cache = linear_layer_cache(cache, self.layer_idx)
        if recurrence_chunks_apply(hidden_states, sequence_info):  # a long prompt, no gradients: chunked_recurrence
            return recur_in_token_chunks(mixer, hidden_states, sequence_info, layer_cache)
        return mixer(hidden_states, sequence_info, layer_cache)

    def decode(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, position_embeddings,
               attention_mask: torch.Tensor | None, sequence_info: SequenceInfo,
               cache: Cache, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a decoding step (and a speculative round: speculative_decoding.forward_tokens), its last
        residual add left to the next norm: takes the previous layer's (MLP output, residual) (residual None for the
        first layer: hidden_states is the embedding) and returns its own, whose sum is what `forward` returns. The
        input norm adds them in its kernel (one kernel less per layer)."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual=residual)
        hidden_states = self._mix(hidden_states, position_embeddings, attention_mask, sequence_info, cache, **kwargs)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual=residual)
        return self.mlp(hidden_states), residual


def plan_entries_naming(plan: dict[str, str], names: list[str]) -> dict[str, str]:
    """The entries of a parallel plan whose pattern ("layers.*.mlp.gate_proj": `*` one name component, a layer's
    index) names one of `names`, in the plan's order."""
    patterns = {key: re.compile(r"[^.]+".join(re.escape(part) for part in key.split("*"))) for key in plan}
    return {key: style for key, style in plan.items() if any(patterns[key].fullmatch(name) for name in names)}


class HybridLinearPreTrainedModel(PreTrainedModel):
    config: HybridLinearConfig
    config_class = HybridLinearConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridLinearDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = False
    # transformers' refusal of assisted generation (prompt_lookup_num_tokens=, assistant_model=) for models whose
    # cache cannot be cut back after a rejected draft: this family's can, its GDN/KDA layers restored exactly by `crop`
    # (state_rollback.py)
    _is_stateful = False
    # as transformers' Qwen3-Next declares it: the forward traces as one graph (no data-dependent branch under
    # torch.compile: sequence_info.may_hold_padding; the linear layers' token counts are tensors there)
    _can_compile_fullgraph = True
    # router_logits: each sparse MoE layer's router logits [tokens, experts] (output_router_logits)
    # attentions: the weights of every softmax-attention mixer ("kv" registrations: attention, latent attention)
    _can_record_outputs = {"hidden_states": HybridLinearDecoderLayer,
                           "attentions": list(dict.fromkeys(spec.module_class for spec in MIXERS.values()
                                                            if spec.state == "kv")),
                           "router_logits": OutputRecorder(HybridLinearTopKRouter, index=0)}

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        check_requested_quantization(kwargs.get("quantization_config"))  # (FP8: this family's own, from config.json)
        loaded = super().from_pretrained(*args, **kwargs)  # (the model, or it and its loading info)
        (loaded[0] if isinstance(loaded, tuple) else loaded)._load_device_kernels()
        return loaded

    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        self._load_device_kernels()
        return module

    def _load_device_kernels(self) -> None:
        # fla imported where the weights land on a GPU (`to`, `cuda`, `from_pretrained(device_map=...)`), as
        # transformers' Qwen3-Next imports it with its modeling module: seconds (3.6 s on an H200 machine) that the
        # first generate's time to first token would pay otherwise. Nothing on other devices (fla_for)
        weight = next(self.parameters(), None)
        if weight is not None:
            fla_backend.fla_for(weight)

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # The sparse MoE layers' experts (mlp_sparse_moe.py) are a `@use_experts_implementation` class, so
        # `experts_implementation=` and `set_experts_implementation` apply to them. Unset, they run this package's
        # grouped_mm_gather (benchmarks/bench_moe.py: faster than transformers' default grouped_mm, in the same run).
        return super().get_correct_experts_implementation(requested_experts or EXPERTS_IMPLEMENTATIONS[0])

    def init_parallel_plans(self) -> None:
        # The config's tensor- and expert-parallel plans hold every registered mixer's and MLP's entries; a config
        # builds only some of those modules (its mixers and MLPs, a shared expert or not, MLA's q_proj or q_b_proj).
        # The base model keeps the entries that name one of its modules or parameters (the heads take its plans).
        super().init_parallel_plans()
        if self.base_model is self:
            names = [name for name, _ in self.named_modules()] + [name for name, _ in self.named_parameters()]
            self._tp_plan = plan_entries_naming(self._tp_plan, names)
            self._ep_plan = plan_entries_naming(self._ep_plan, names)

    def _resolve_parallel_plans(
            self, distributed_config: DistributedConfig) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        # transformers resolves the plans of `from_pretrained(..., distributed_config=...)` here, before sharding:
        # an expert-parallel size that does not divide a layer's num_experts is refused in our words first
        check_expert_parallel_size(self.config, distributed_config.ep_size)
        return super()._resolve_parallel_plans(distributed_config)

    @staticmethod
    def _load_pretrained_model(model: PreTrainedModel, state_dict: dict | None, checkpoint_files: list[str] | None,
                               load_config, *args, **kwargs):
        # an MTP head the folder carries beside the model's files (mtp_head.with_carried_head) loads with them
        checkpoint_files = with_carried_head(model, checkpoint_files) if state_dict is None else checkpoint_files
        # transformers casts each checkpoint tensor to its parameter's dtype: a tensor of another kind (int8 into a
        # float weight) is refused first, naming it (checkpoint_dtypes; a truncated shard too)
        check_checkpoint_dtypes(model, state_dict, checkpoint_files, load_config)
        check_mtp_kind(model, checkpoint_files)  # (another kind's MTP tensors would fill this head's by name)
        # weights the device map places on a GPU beyond its free memory: refused in one line before any is read
        check_weights_fit(model, load_config)
        # weights bound for an accelerator are read from the shards, not mapped: the host holds the weights in flight,
        # not the folder (streamed_loading)
        with streamed_state_dict(state_dict, checkpoint_files, load_config) as tensors:
            return PreTrainedModel._load_pretrained_model(model, tensors, checkpoint_files, load_config, *args,
                                                          **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, with config.json's `auto_map` naming every Auto class of the family.

        transformers writes only the saved class's own Auto class (and AutoConfig), so a folder saved from the base
        model would not load with AutoModelForCausalLM, nor an LM's with AutoModel, under trust_remote_code. The
        modeling sources travel with it (transformers copies this module and, recursively, its relative imports)."""
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers skips a custom-code module that holds no parameter directly (all of none are "initialised"),
        # which would skip a registered component whose parameters sit in its submodules (the sparse MoE block: its
        # router and experts): such a component's init_weights runs all the same. transformers' `init` functions
        # still leave tensors loaded from a checkpoint alone.
        if any(spec.init_weights is not None and isinstance(module, spec.module_class) for spec in all_specs()):
            is_custom_code = False
        super()._initialize_weights(module, is_custom_code)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if init_fp8_weights(module, self.config.initializer_range):
            return
        if isinstance(module, HybridLinearRMSNorm):
            (init.zeros_ if module.zero_centered else init.ones_)(module.weight)
        elif isinstance(module, GatedRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ShortConvolution):
            bound = module.kernel_size**-0.5
            init.uniform_(module.weight, -bound, bound)
        else:  # a mixer or MLP initialises its own parameters (its registration's init_weights)
            for spec in all_specs():
                if spec.init_weights is not None and isinstance(module, spec.module_class):
                    spec.init_weights(module)
                    break


def _check_forward_inputs(model: "HybridLinearModel", input_ids, inputs_embeds, attention_mask, position_ids, cache,
                          kwargs: dict, labels=None) -> None:
    """The inputs' and the cache's checks (model_inputs, cache_checks), before any work and before any shape is read:
    one clear line instead of an error deep in a mixer that names none of the inputs."""
    config = model.config
    batch, seq_len = check_inputs(
        config.vocab_size, config.hidden_size, input_ids, inputs_embeds, attention_mask, position_ids,
        embedding_dtype=model.embed_tokens.weight.dtype, labels=labels,
        cu_seq_lens={name: kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k")})
    check_cache(model, cache, batch, seq_len)


def _is_padded(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and may_hold_padding(attention_mask)


def _positions_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions restarting at 0 at every document start, so attention masks keep packed documents apart."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return (torch.arange(seq_len, device=cu_seqlens.device)
            - torch.repeat_interleave(starts, lengths, output_size=seq_len))


class HybridLinearModel(HybridLinearPreTrainedModel):
    # Declared here rather than by the package's register_for_auto_class: a model loaded as remote code (where the
    # package is absent) then saves its sources too.
    _auto_class = "AutoModel"

    def __init__(self, config: HybridLinearConfig):
        super().__init__(config)
        # a config changed after construction (config.rope_parameters = {...}) is checked as a new one is: one line
        # naming the field, not an error deep inside a layer
        config.validate()
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HybridLinearDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        final_eps = config._getattr_without_heterogeneous_validation("rms_norm_eps")  # the default (documented)
        self.norm = HybridLinearRMSNorm(config.hidden_size, final_eps, config.zero_centered_norms)
        # one rotary embedding per distinct (head_dim, rope_parameters) of the attention layers (as their
        # registrations' rotary_settings give them), each computed once per forward; rotary_of_layer[i] picks layer
        # i's (None for GDN/KDA layers and attention without rotary)
        rotary_settings, self.rotary_of_layer = {}, []
        for i, mixer_type in enumerate(config.mixer_types):
            spec = MIXERS[mixer_type]
            settings = spec.rotary_settings(config.per_layer_config[i]) if spec.state == "kv" else None
            if settings is None:  # no position embeddings (a recurrent mixer, or attention without rotary)
                self.rotary_of_layer.append(None)
                continue
            key = repr((settings.head_dim, sorted(settings.rope_parameters.items())))
            self.rotary_of_layer.append(rotary_settings.setdefault(key, (len(rotary_settings), settings))[0])
        rotary = [HybridLinearRotaryEmbedding(settings) for _, settings in rotary_settings.values()]
        self.rotary_emb = rotary[0] if len(rotary) == 1 else None  # the usual case keeps its usual name
        self.rotary_embs = nn.ModuleList(rotary) if len(rotary) > 1 else None
        self.gradient_checkpointing = False
        self.post_init()

    def _rotary_embeddings(self) -> list[HybridLinearRotaryEmbedding]:
        return [self.rotary_emb] if self.rotary_emb is not None else list(self.rotary_embs or [])

    def _position_embeddings(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> list:
        """cos/sin of every distinct rotary embedding, for layer i at index rotary_of_layer[i]. Under torch.compile
        (transformers compiles static-cache decoding on CUDA) plain (cos, sin) tuples: dynamo cannot unpack a
        user-defined iterable such as RotaryTables, and the layers take tuples on their general path."""
        pairs = [rotary(hidden_states, position_ids) for rotary in self._rotary_embeddings()]
        if torch.compiler.is_compiling():
            return pairs
        return [RotaryTables(pair=pair) for pair in pairs]

    def _step_rotary_tables(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> list[RotaryTables]:
        """A decoding step's `_position_embeddings`: computed when used, the whole-head tables straight from the
        positions (`HybridLinearRotaryEmbedding.whole_head`)."""
        return [RotaryTables(compute=lambda rotary=rotary: rotary(hidden_states, position_ids),
                             direct=lambda head_dim, rotary=rotary: rotary.whole_head(hidden_states, position_ids,
                                                                                     head_dim))
                for rotary in self._rotary_embeddings()]

    def _layer_masks(self, inputs_embeds, attention_mask, cache, position_ids, weights_wanted: bool,
                     causal: bool = False, described_full: bool = False) -> list:
        """The attention mask of every layer (None for GDN/KDA layers): one for all full (and latent) attention,
        one per distinct sliding window, each built once. A dict given by the caller maps layer indices
        (`create_masks_for_generate`'s) or layer types (transformers') to masks.
        `causal`: sdpa's own causal mask is the full-attention one (`_causal_kernel_suffices`), None is passed.
        `described_full`: a long prompt whose full-attention mask would be materialised (`_describes_full_mask`)
        gets it described, as a sliding window wider than the sequence, applied block by block."""
        if isinstance(attention_mask, dict):
            return [attention_mask[i] if i in attention_mask else attention_mask.get(t)
                    for i, t in enumerate(self.config.layer_types)]
        kwargs = dict(inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                      position_ids=position_ids)
        built, masks = {}, []
        for i, layer_type in enumerate(self.config.layer_types):  # (transformers' words)
            if layer_type == "sliding_attention":
                settings = self.config.per_layer_config[i]
                key = settings.sliding_window
                if key not in built:
                    described = None if weights_wanted else self._described_mask(
                        inputs_embeds, attention_mask, cache, position_ids, key, i)
                    # sized by this window's first layer: transformers' default (the cache's first sliding layer)
                    # has another buffer length in a static cache when the windows differ
                    built[key] = described or create_sliding_window_causal_mask(config=settings, layer_idx=i,
                                                                                **kwargs)
            elif MIXERS[self.config.mixer_types[i]].state == "kv":  # full attention, and every other attention
                key = "full"
                if key not in built:
                    described = self._described_mask(inputs_embeds, attention_mask, cache, position_ids,
                                                      UNBOUNDED_WINDOW, i) if described_full else None
                    built[key] = None if causal and not weights_wanted else described or create_causal_mask(
                        config=self.config, **kwargs)
            else:
                key = None
            masks.append(built.get(key))
        return masks

    def _causal_kernel_suffices(self, inputs_embeds, attention_mask, cache, past, info: SequenceInfo) -> bool:
        """Whether sdpa's own causal mask is the full-attention mask: a prompt of several tokens, none of them
        padding, into an empty static cache. The keys are then the cache's slots, the prompt's first, and sdpa's
        causal mask (aligned at the first key) is the prompt's causal mask and hides the empty slots after it.
        transformers builds a [T, slots] mask there (a static cache has more keys than queries), for which sdpa runs
        its masked kernel, a markedly slower long prefill than with a dynamic cache."""
        return (self.config._attn_implementation == "sdpa" and getattr(cache, "is_compileable", False)
                and inputs_embeds.shape[1] > 1 and not torch.compiler.is_compiling()
                and (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                                and attention_mask.shape[1] == inputs_embeds.shape[1]))
                and info.padding_mask is None and info.cu_seqlens is None and not past)  # (padding: `info` found it)

    def _describes_full_mask(self, inputs_embeds, weights_wanted: bool, causal: bool, past,
                             info: SequenceInfo) -> bool:
        """Whether the full-attention layers get their mask described (`_described_mask` with an unbounded window)
        rather than built: a prompt of DESCRIBED_MASK_QUERIES tokens or more whose mask transformers would
        materialise, [batch, 1, T, keys] (padded rows, packed documents, or keys cached before it), where sdpa's
        own causal mask does not serve. Below that, one masked kernel is faster than blocks, and T x keys small."""
        return (not causal and not weights_wanted and inputs_embeds.shape[1] >= DESCRIBED_MASK_QUERIES
                and (info.padding_mask is not None or info.cu_seqlens is not None or bool(past)))

    def _described_mask(self, inputs_embeds, attention_mask, cache, position_ids, window: int,
                        layer_idx: int) -> SlidingWindowMask | None:
        """Layer `layer_idx`'s sliding-window mask (the first layer of its window; a full-attention layer's with
        UNBOUNDED_WINDOW) described, not built (attention applies it block by block in O(T * min(window, keys))
        memory), wherever transformers would materialise a [batch, 1, T, keys] mask: eager and sdpa, several query
        tokens, no cache or a dynamic one; padded, packed or continuing a cache alike. None otherwise (one-token
        steps, whose mask is one row; static caches, whose key slots do not follow the positions; other attention
        implementations, which take no 4-D mask; and eager attention asked for its weights, which are T x T anyway).
        The sizes and offsets come from the cache exactly as transformers' mask builder takes them."""
        batch, q_length = inputs_embeds.shape[:2]
        four_d_mask = attention_mask is not None and attention_mask.dim() != 2
        if (self.config._attn_implementation not in ("sdpa", "eager") or q_length == 1 or four_d_mask
                or getattr(cache, "is_compileable", False)):
            return None
        if cache is not None:  # (layer_idx: the layer transformers would size the mask by)
            q_offset = cache.get_query_offset(layer_idx)
            kv_length, kv_offset = cache.get_mask_sizes(q_length, layer_idx)
        else:
            q_offset = kv_offset = 0
            kv_length = attention_mask.shape[-1] if attention_mask is not None else q_length
        key_padding = documents = None
        if attention_mask is not None:
            padding = attention_mask.to(inputs_embeds.device, torch.bool)
            key_padding = prepare_padding_mask(padding, kv_length, kv_offset)
        elif cache is None and position_ids is not None:  # packed documents, detected as transformers does
            documents = find_packed_sequence_indices(position_ids.expand(batch, -1))
        return SlidingWindowMask(window, int(q_offset), kv_offset, kv_length, key_padding, documents)

    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        _check_forward_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, kwargs)
        adopt_linear_layers(cache)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(token_indices(input_ids))
        batch, seq_len = inputs_embeds.shape[:2]
        past = past_length(cache)
        if position_ids is None and kwargs.get("cu_seq_lens_q") is not None:
            position_ids = _positions_from_cu_seqlens(kwargs["cu_seq_lens_q"], seq_len).unsqueeze(0)
        if position_ids is None and _is_padded(attention_mask):
            # as `generate` does: positions count the real tokens only, so a padded row sees what it would alone
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_len:]
        given_positions = position_ids  # positions made here never restart: no packing to look for (no sync)
        warn_if_input_past_positions(self, past, seq_len, given_positions)  # (once per model: position_limit)
        if position_ids is None:
            position_ids = (torch.arange(seq_len, device=inputs_embeds.device) + past).unsqueeze(0)
        sequence_info = build_sequence_info(
            batch, seq_len, attention_mask if not isinstance(attention_mask, dict) else None, given_positions,
            has_past=past > 0, cu_seq_lens=kwargs.get("cu_seq_lens_q"),
        )
        if sequence_info.cu_seqlens is not None:
            if cache is not None and past > 0:
                raise ValueError("Packed sequences cannot continue from a cache: pass one sequence per row instead.")
            use_cache = False  # the final states of packed documents do not make a per-row cache
            cache = None
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
            adopt_linear_layers(cache)

        weights_wanted = bool(kwargs.get("output_attentions", self.config.output_attentions))
        causal = self._causal_kernel_suffices(inputs_embeds, attention_mask, cache, past, sequence_info)
        described = self._describes_full_mask(inputs_embeds, weights_wanted, causal, past, sequence_info)
        masks = self._layer_masks(inputs_embeds, attention_mask, cache, position_ids, weights_wanted, causal,
                                  described)
        position_embeddings = self._position_embeddings(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers[: self.config.num_hidden_layers]:
            rotary = self.rotary_of_layer[layer.layer_idx]
            hidden_states = layer(
                hidden_states,
                position_embeddings=position_embeddings[rotary] if rotary is not None else None,
                attention_mask=masks[layer.layer_idx],
                sequence_info=sequence_info,
                cache=cache,
                position_ids=position_ids,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)

    def prefill_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, real: torch.Tensor, cache: Cache,
                     slots: int, rows_padded: bool = True) -> torch.Tensor:
        """A prompt's forward into an empty static cache with no host synchronisation (what a CUDA graph captures:
        cuda_graph_prefill.py). real [B, T] bool marks the tokens that are not padding; the GDN/KDA layers leave
        their states as the last real token left them. Each attention layer attends over the `slots` key slots of its
        static cache (T <= slots), query i over slots 0..i: the real ones among them, and its own (so no pad's row is
        fully masked, which would be NaN), where `rows_padded` says a row has pads before a real token; otherwise
        (pads only after the real tokens) all of them: sdpa's own causal mask, which is that (aligned at the first
        slot), and its flash kernel. Returns the final normed hidden states [B, T, H]."""
        hidden_states = self.embed_tokens(input_ids)
        batch, length = input_ids.shape
        position_embeddings = self._position_embeddings(hidden_states, position_ids)
        mask = None  # no attention layer; or sdpa with no padding before a real token: is_causal
        attends = any(layer.mixer_state == "kv" for layer in self.layers[: self.config.num_hidden_layers])
        if attends and (rows_padded or self.config._attn_implementation != "sdpa"):
            keys = torch.arange(slots, device=input_ids.device)
            queries = torch.arange(length, device=input_ids.device)[:, None]
            mask = (keys <= queries)[None, None]  # [1, 1, T, slots]
            if rows_padded:
                real_keys = torch.nn.functional.pad(real, (0, slots - length))[:, None, None, :]
                mask = (mask & real_keys) | (keys == queries)  # [B, 1, T, slots]
            if self.config._attn_implementation == "eager":  # (an additive mask; sdpa takes the bool one)
                mask = additive_mask(mask, hidden_states.dtype, eager=True)
        info = SequenceInfo(batch, length, padding_mask=real)
        for layer in self.layers[: self.config.num_hidden_layers]:
            rotary = self.rotary_of_layer[layer.layer_idx]
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings[rotary] if rotary is not None
                                  else None, attention_mask=mask if layer.mixer_state == "kv" else None,
                                  sequence_info=info, cache=cache, position_ids=position_ids)
        return self.norm(hidden_states)

    def decode_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_mask: torch.Tensor,
                    cache: Cache, windows=None) -> torch.Tensor:
        """One token per row against a static cache, with no host synchronisation (what a CUDA graph captures).
        key_mask [B, max_len] bool: the full-attention cache slots that hold real tokens once this step's token is
        written. windows (cuda_graph_decoding.WindowSteps): the sliding layers' masks over their window slots, and
        (through `cache`, a StepCache) their branch-free updates."""
        hidden_states = self.embed_tokens(input_ids)
        position_embeddings = self._step_rotary_tables(hidden_states, position_ids)

        def attention_mask_of(mask: torch.Tensor) -> torch.Tensor:
            """The additive mask each attention layer of the step adds, built once per step: eager attention's (finfo
            min where masked), or for sdpa the -inf/0 mask sdpa would otherwise build from a bool mask in every
            layer (the same values: the same scores)."""
            return additive_mask(mask[:, None, None, :], hidden_states.dtype,
                                 eager=self.config._attn_implementation == "eager")

        full_mask = attention_mask_of(key_mask)
        window_masks = windows.masks(attention_mask_of) if windows is not None else {}
        info = SequenceInfo(input_ids.shape[0], 1)
        residual = None  # each layer's last residual add is done by the next norm (HybridLinearDecoderLayer.decode)
        for layer in self.layers[: self.config.num_hidden_layers]:
            attention_mask = None
            if layer.mixer_state == "kv":
                attention_mask = window_masks.get(layer.layer_idx, full_mask)
            rotary = self.rotary_of_layer[layer.layer_idx]
            hidden_states, residual = layer.decode(
                hidden_states, residual, position_embeddings[rotary] if rotary is not None else None,
                attention_mask, info, cache)
        if residual is None:  # no layer
            return self.norm(hidden_states)
        return self.norm(hidden_states, residual=residual)[0]


@dataclass
class HybridLinearCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """transformers' MoE causal-LM output plus `mtp_loss`: the multi-token-prediction loss (unweighted; `loss` holds
    it times the MTP weight), when computed."""

    mtp_loss: torch.FloatTensor | None = None


class HybridLinearForCausalLM(HybridLinearPreTrainedModel, GenerationMixin):
    _auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: HybridLinearConfig):
        super().__init__(config)
        self.model = HybridLinearModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = quantize_module(nn.Linear(config.hidden_size, config.vocab_size, bias=False), "lm_head",
                                       config.block_fp8_settings)
        if config.num_mtp_layers:  # multi-token-prediction layers, "mtp.*", of the kind config.mtp_type (mtp_heads)
            self.mtp = MTP_HEADS[config.mtp_type].head(config, HybridLinearDecoderLayer, HybridLinearRotaryEmbedding)
        self.set_cuda_graph_decoding(True)
        self.post_init()

    def set_cuda_graph_decoding(self, enabled: bool, prompts: bool | None = None) -> None:
        """One-token steps on CUDA against a StaticCache replay captured CUDA graphs, and `generate`'s stop check runs
        a step behind on CUDA (deferred_stop_check) (on by default). prompts: prompts into an empty StaticCache
        replayed from graphs of their length bucket too (cuda_graph_prefill); `CudaGraphPrefill.on_by_default` when
        None (off: see that module's docstring). Speculative decoding's verify rounds are captured too where this is
        on, and kept with their caches for later calls (kept_verify_rounds); a call of this method drops them all
        (their graphs are destroyed once no model on the device holds any: recorded_graphs)."""
        prompts = CudaGraphPrefill.on_by_default if prompts is None else prompts
        storages = CacheStorages()  # one cache storage per shape, shared by the step's graphs and the prompts'
        self._graph_decoder = CudaGraphDecoder(storages) if enabled else None
        self._graph_prefill = CudaGraphPrefill(storages) if enabled and prompts else None
        self._kept_verify_rounds = KeptVerifyRounds()

    def warm_up(self, max_batch_size: int = 1, max_length: int | None = None, batch_sizes: list[int] | None = None,
                verbose: bool = True) -> WarmUpReport:
        """Compiles, tunes and captures what `generate` will need for requests of up to `max_batch_size` rows and
        `max_length` tokens (prompt plus new; the model's positions by default), so that no later request of that
        size pays for it at its first token; prints what it did and its time (warm_up.py). Call it once, after
        loading the model onto its device and dtype."""
        return warm_up(self, max_batch_size=max_batch_size, max_length=max_length, batch_sizes=batch_sizes,
                       verbose=verbose)

    def _validate_generated_length(self, generation_config, input_ids_length: int, has_default_max_length: bool):
        # transformers' checks, then one warning, before the cache is allocated, where the prompt plus the new tokens
        # pass the model's positions (position_limit: transformers generates there, and warns once it is past). The
        # last new token is never fed back: max_length - 1 positions are taken
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        if generation_config.max_length is not None:
            warn_past_positions(self.model, generation_config.max_length - 1,
                                "the prompt plus max_new_tokens (less the last, never fed back)")

    def captures_graphs_on(self, device: torch.device) -> bool:
        """Whether graph decoding is on and captures steps and prompts on `device`: not for a model that a device
        map dispatches over several devices or offloads (`hf_device_map`), whose forward a graph of one device's
        stream would not hold."""
        placements = {placement_device(where) for where in (getattr(self, "hf_device_map", None) or {}).values()}
        return (self._graph_decoder is not None and device.type in CudaGraphDecoder.device_types
                and len(placements) <= 1 and all(where is not None and where.type not in ("cpu", "meta")
                                                 for where in placements))

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        # `generate` would torch.compile the forward for a static cache; on CUDA, our captured decoding step serves
        # that case (compiling around it would capture a graph inside a graph: switch graph decoding off to get
        # transformers' compilation). Elsewhere graph decoding does not apply and transformers' criteria decide.
        if self._graph_decoder is not None and self.device.type == "cuda":
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # a model of GDN/KDA layers alone gets a dynamic cache whose length those layers give (transformers' asks
        # attention layers only, and assisted generation asks it of the assistant's cache: generation_cache)
        # Assisted decoding with a static cache: a verify forward runs the last token and a draft of up to k tokens
        # (the bonus tokens past max_length are dropped afterwards), so the cache gets k slots past transformers'
        # max_length - 1: transformers' prompt lookup drafts up to max_length itself, a drafter may not cap its draft
        args = list(args)
        mode = args[0] if args else kwargs.get("generation_mode")
        if mode == GenerationMode.ASSISTED_GENERATION:
            draft = generation_config.prompt_lookup_num_tokens or generation_config.num_assistant_tokens or 1
            if len(args) == 3:
                args[2] += int(draft)
            elif "max_cache_length" in kwargs:
                kwargs["max_cache_length"] += int(draft)
        chosen = self._chooses_static_cache(generation_config, model_kwargs, mode)
        if chosen:
            generation_config.cache_implementation = "static"
        try:
            prepared = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        except ValueError:  # (a static cache refused: past the positions or the memory; the dynamic one grows)
            if not chosen:
                raise
            generation_config.cache_implementation = None
            prepared = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if "cache" in model_kwargs:
            model_kwargs["cache"] = generation_cache(model_kwargs["cache"])
        return prepared

    def _chooses_static_cache(self, generation_config, model_kwargs, mode) -> bool:
        """Whether `generate` takes a static cache that the user did not name: where graph decoding captures (CUDA,
        graphs on), the mode runs the captured step (greedy, sampling, assisted) and nothing keeps the step from being
        captured (attention weights or hidden states asked for, an attention implementation or expert dispatch that
        is not captured: capture_obstacle), when neither a cache nor a `cache_implementation` is given. The captured
        step decodes over 10x faster than the eager one at batch 1, with the same tokens;
        `cache_implementation="dynamic"` keeps transformers' default cache. Not for a drafter inside transformers'
        assisted loop (`is_assistant`): that loop extends the drafter's cache past the length of its first call; nor
        in a process group of several ranks (tensor or expert parallelism, FSDP, ZeRO-3: a step whose collectives a
        graph would have to hold, every rank alike), where it is asked for by name. Where the static cache is refused
        (past the model's positions or the memory), the dynamic one is taken, as without this choice."""
        ranks = torch.distributed.get_world_size() if (torch.distributed.is_available()
                                                       and torch.distributed.is_initialized()) else 1
        return (mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.ASSISTED_GENERATION)
                and model_kwargs.get("cache") is None and generation_config.cache_implementation is None
                and generation_config.use_cache is not False and not generation_config.is_assistant
                and not generation_config.output_attentions and not generation_config.output_hidden_states
                and ranks == 1 and self.captures_graphs_on(self.device) and capture_obstacle(self, None) is None)

    def _prepare_static_cache(self, *args, **kwargs) -> Cache:
        # `generate`'s static cache: where graph decoding captures (CUDA, graphs on), its key slots rounded up to one
        # of few sizes (static_cache_slots), so what is captured per cache size is captured for few; the exact size
        # elsewhere (nothing is captured per size there, and transformers' own static caches hold exactly the prompt
        # plus the new tokens), and where the rounded one would not fit in memory.
        # A cache is refused before its buffers are allocated when it passes the model's positions or the memory
        # (cache_checks); transformers' size memory (`_previous_max_cache_length`, the size later calls reuse) is then
        # left as it was, so one refused call does not size every later cache.
        kwargs.update(zip(("cache_implementation", "batch_size", "max_cache_len", "prefill_chunk_size",
                           "model_kwargs"), args))
        tokens = kwargs["max_cache_len"]
        previous = self.__dict__.get("_previous_max_cache_length")
        reach = model_position_limit(self.model)  # (the rounding stays within the model's positions)
        captured = self.captures_graphs_on(self.device)
        rounded = static_cache_slots(tokens, reach[0] if reach is not None else None) if captured else tokens
        for slots in dict.fromkeys((rounded, tokens)):
            cache = super()._prepare_static_cache(**{**kwargs, "max_cache_len": slots})
            adopt_static_window_layers(cache)  # (before assisted decoding asks its layers to record their past)
            try:
                check_static_cache_size(self.model, cache, kwargs["batch_size"])
                return cache
            except ValueError:
                if previous is None:
                    self.__dict__.pop("_previous_max_cache_length", None)
                else:
                    self._previous_max_cache_length = previous
                if slots == tokens:
                    raise

    def create_masks_for_generate(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                  cache: Cache | None = None, position_ids: torch.Tensor | None = None,
                                  **kwargs) -> torch.Tensor | dict[int, torch.Tensor | None] | None:
        """`generate`'s masks for a step against a static cache (transformers builds one per layer type there).

        A one-token decoding step gets every layer's mask as the forward builds it (`_layer_masks`, one per distinct
        sliding window), keyed by layer index: shaped by the cache's slots, so the compiled decoding step sees inputs
        of one shape at every step, where the 2-D mask grows by a column a step (a recompilation each step). A
        generated token is never padding, so the GDN/KDA layers need no 2-D mask. The prompt (the first iteration,
        or any step of several tokens) keeps the 2-D mask, from which the forward takes the GDN/KDA layers' padding
        and sdpa's causal kernel; so does a step that graph decoding may capture (it reads the 2-D padding:
        `_valid_auto_compile_criteria` compiles nothing there)."""
        if (inputs_embeds.shape[1] != 1 or kwargs.get("is_first_iteration")
                or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
                or self.captures_graphs_on(inputs_embeds.device)):
            return attention_mask
        masks = self.model._layer_masks(inputs_embeds, attention_mask, cache, position_ids, weights_wanted=False)
        return dict(enumerate(masks))

    def _assisted_decoding(self, input_ids, *args, **kwargs):
        # transformers' assisted decoding takes one row; a batch runs this package's batched greedy speculative
        # decoding, each row accepting its own drafts (speculative_decoding.py), and so does one row where its rounds
        # replay a captured CUDA graph (graph decoding on for the device) and it takes the request: transformers'
        # loop runs each verify forward eagerly, slower than the captured plain step it should beat
        names = ("logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer")
        request = {**dict(zip(names, args)), **kwargs}
        captured_row = self.captures_graphs_on(input_ids.device) and not batched_loop_refuses(
            request.get("logits_processor"), request.get("stopping_criteria"), request["generation_config"],
            request.get("streamer"))
        if input_ids.shape[0] > 1 or captured_row:
            kwargs.update(zip(names, args))
            kwargs.pop("synced_gpus", None)
            for name in ("inputs_tensor", "assistant_tokenizer", "tokenizer", "cache", "use_cache", "logits_to_keep"):
                kwargs.pop(name, None)
            return assisted_generate_batch(self, input_ids, **kwargs)
        return super()._assisted_decoding(input_ids, *args, **kwargs)

    def _sample(self, *args, **kwargs):
        # with graph decoding on, the stop check runs a step behind on CUDA (deferred_stop_check.py): the host queues
        # the next replayed step while the GPU runs this one, instead of waiting for it every token. Not where peers
        # generate in lockstep (synced_gpus, the 5th argument: ZeRO-3, FSDP), which transformers never defers.
        synced = kwargs.get("synced_gpus", args[4] if len(args) > 4 else False)
        with deferred_stop_checks(self._graph_decoder is not None and not synced):
            return super()._sample(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        # A decoding step that replays the captured CUDA graph needs only the new token, the 2-D mask and the positions:
        # transformers' generic preparation (4-D masks for static caches, clones, device checks) would cost more host
        # time per token than the replayed step itself, and its 4-D mask would keep the graph from being used.
        if (self._graph_decoder is not None and not is_first_iteration and next_sequence_length == 1
                and self._graph_decoder.applies(self, input_ids[:, -1:], None, cache, attention_mask, kwargs)):
            # (prompt embeddings only serve the first iteration; later steps feed the generated ids)
            inputs = {"input_ids": input_ids[:, -1:], "cache": cache, "attention_mask": attention_mask}
            position_ids = kwargs.pop("position_ids", None)
            if position_ids is not None:
                inputs["position_ids"] = position_ids[..., -1:]
            inputs.update((key, value) for key, value in kwargs.items() if key != "labels")
            return inputs
        return super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mtp_loss_weight: float | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        """mtp_loss_weight (default config.mtp_loss_weight): with labels and MTP layers, the MTP loss (mtp_head.py)
        is returned as `mtp_loss` and added to `loss` times this weight; 0 computes none.

        output_router_logits (default config.output_router_logits): return each MoE layer's router logits and the
        load-balancing loss `aux_loss` (moe_load_balancing.py; padding excluded by the 2-D attention_mask) of the
        softmax-routed ("sparse_moe") layers, added to `loss` times config.router_aux_loss_coef when labels are given,
        as Qwen3-Next does ("kimi_moe" layers balance by their bias: recorded, not counted)."""
        _check_forward_inputs(self.model, input_ids, inputs_embeds, attention_mask, position_ids, cache, kwargs, labels)
        mtp_weight = self._mtp_loss_weight(mtp_loss_weight, labels, position_ids, attention_mask, kwargs)
        input_ids, labels = token_indices(input_ids), token_indices(labels)  # (any integer dtype, taken exactly)
        adopt_linear_layers(cache)
        if (labels is None and self._graph_decoder is not None
                and CudaGraphDecoder.wanted(self, input_ids, inputs_embeds, cache)):
            # (None: this step cannot be captured; the decoder said why, once, and the forward below runs)
            logits = self._graph_decoder.try_step(self, input_ids, position_ids, attention_mask, cache, kwargs)
            if logits is not None:
                return MoeCausalLMOutputWithPast(logits=logits, cache=cache)
        if (labels is None and self._graph_prefill is not None
                and CudaGraphPrefill.wanted(self, input_ids, inputs_embeds, cache)):
            # (None: the first prompt of its length bucket, or one that cannot be captured: the forward below runs)
            logits = self._graph_prefill.try_prefill(self, input_ids, position_ids, attention_mask, cache,
                                                     logits_to_keep, kwargs)
            if logits is not None:
                if self._graph_decoder is not None:
                    self._graph_decoder.ran_uncaptured()  # (a run of decoding steps starts)
                return MoeCausalLMOutputWithPast(logits=logits, cache=cache)
        if self._graph_decoder is not None:
            self._graph_decoder.ran_uncaptured()
        if output_router_logits is None:  # resolved here: the base model records the routers only when asked
            output_router_logits = getattr(self.config, "output_router_logits", False)
        # the MTP heads that read the last layer's input get it as a selected hidden state (transformers' selection
        # by index; what the caller asked for, the config's flag included, is what the output returns)
        asked_hidden = kwargs.get("output_hidden_states", getattr(self.config, "output_hidden_states", False))
        trunk = trunk_index(self.config) if mtp_weight and self.mtp.reads == "trunk" else None
        if trunk is not None:
            kwargs["output_hidden_states"] = with_hidden_state(asked_hidden, trunk, self.config.num_hidden_layers + 1)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        mtp_input = outputs.last_hidden_state
        if trunk is not None:
            mtp_input = outputs.hidden_states[trunk]
            outputs.hidden_states = hidden_states_asked(outputs.hidden_states, asked_hidden, trunk)
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = None
        loss = self._fused_loss(hidden_states, labels, kwargs.get("shift_labels"),
                                kwargs.get("num_items_in_batch")) if labels is not None else None
        if loss is None:
            logits = self.lm_head(hidden_states)
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits:
            # the routers balanced by the loss (softmax top-k); Kimi's bias-balanced routers are recorded, not counted
            balanced = [(logits, router.top_k) for logits, router in zip(outputs.router_logits or (), self._routers())
                        if router.balanced_by_aux_loss]
            aux_loss = load_balancing_loss(tuple(logits for logits, _ in balanced), [k for _, k in balanced],
                                           attention_mask)
            if loss is not None and aux_loss is not None:
                loss = loss + getattr(self.config, "router_aux_loss_coef", 0.001) * aux_loss.to(loss.device)
        mtp_loss = None
        if mtp_weight:
            mtp_loss = self._mtp_loss(mtp_input, input_ids, inputs_embeds, labels, attention_mask,
                                      position_ids, kwargs)
            loss = loss + mtp_weight * mtp_loss.to(loss.device)
        return HybridLinearCausalLMOutputWithPast(
            loss=loss,
            mtp_loss=mtp_loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )

    def _fused_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, shift_labels: torch.Tensor | None,
                    num_items_in_batch) -> torch.Tensor | None:
        """The loss of the LM head over `hidden_states` by fla's fused linear + cross-entropy (no [tokens, vocab]
        logits kept), or None where it is not taken: not training, `fuse_linear_cross_entropy` off, or an FP8 head
        (fp8_layers), which has no float weight to fuse (the caller then computes the logits, then the loss)."""
        if not (self.training and self.config.fuse_linear_cross_entropy and isinstance(self.lm_head, nn.Linear)):
            return None
        return fused_causal_lm_loss(hidden_states, self.lm_head.weight, labels, shift_labels=shift_labels,
                                    num_items_in_batch=num_items_in_batch)

    def _mtp_loss_weight(self, given: float | None, labels, position_ids, attention_mask, kwargs: dict) -> float:
        """The MTP loss weight of this forward (0: no MTP loss), its inputs checked before any work."""
        weight = self.config.mtp_loss_weight if given is None else given
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mtp_loss_weight must be a finite number >= 0, got {weight!r}.")
        if not weight or labels is None:
            return 0.0
        if getattr(self, "mtp", None) is None:
            raise ValueError(f"mtp_loss_weight={weight} but this model has no MTP layers (config.num_mtp_layers is 0); "
                             "build it with num_mtp_layers=1 (from_pretrained(..., num_mtp_layers=1) adds fresh ones) "
                             "or set mtp_loss_weight=0.")
        check_mtp_loss_inputs(position_ids, attention_mask, kwargs)
        return float(weight)

    def _mtp_loss(self, hidden_states: torch.Tensor, input_ids, inputs_embeds, labels: torch.Tensor,
                  attention_mask, position_ids, kwargs: dict) -> torch.Tensor:
        """The mean over the MTP depths with a target of each depth's cross-entropy (depth d: token t + d + 1;
        mtp_head.py, mtp_parallel_heads.py), each normalised as the main loss is (mean over the counted targets, or
        sum / num_items_in_batch); 0 where no depth has one. hidden_states: what the heads read (`mtp.reads`)."""
        embeddings = None  # (the token embeddings, for the heads that read them: Qwen3-Next's)
        if self.mtp.reads == "final":
            embeddings = inputs_embeds if inputs_embeds is not None else self.model.embed_tokens(input_ids)
        batch, length = hidden_states.shape[:2]
        positions = mtp_positions(position_ids, attention_mask, batch, length, hidden_states.device)
        given_shift = kwargs.get("shift_labels")
        losses = []
        for depth, g in enumerate(self.mtp.depths(hidden_states, embeddings, positions, attention_mask), start=1):
            # targets: token t + depth + 1 (from shift_labels when given: its [t] is token t + 1)
            targets = given_shift[:, depth:] if given_shift is not None else shifted_labels(labels, depth)
            valid = valid_entries(attention_mask, depth)
            if valid is not None:  # (an entry from a pad's hidden state predicts nothing)
                targets = targets.masked_fill(valid.to(targets.device) == 0, -100)
            loss = self._fused_loss(g, labels, targets, kwargs.get("num_items_in_batch"))
            if loss is None:
                loss = self.loss_function(logits=self.lm_head(g), labels=None, vocab_size=self.config.vocab_size,
                                          shift_labels=targets, num_items_in_batch=kwargs.get("num_items_in_batch"))
            losses.append(loss)
        if not losses:  # a sequence of 2 tokens or fewer: no depth has a target, the MTP loss adds nothing
            return hidden_states.new_zeros((), dtype=torch.float32)
        return torch.stack(losses).mean()

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        # `use_mtp` (True or a draft length 1..4), prompt lookup's length and an assistant's vocabulary: checked
        # here, before the cache or any forward (mtp_drafting, speculative_decoding)
        check_mtp_generation(self, generation_config, generation_mode_kwargs)
        check_assisted_request(self, generation_config, generation_mode_kwargs)
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _get_candidate_generator(self, generation_config, *args, **kwargs):
        # `use_mtp`: this family's drafter, the MTP head of its kind (mtp_heads); transformers' own
        # MTPCandidateGenerator loads an `MtpModel` of another layout. Every drafter's rounds are cut to what a
        # GDN/KDA layer can restore after a rejection (speculative_decoding.cap_drafts)
        if generation_config.use_mtp:
            generator = MTP_HEADS[self.config.mtp_type].candidate_generator(self, generation_config,
                                                                            kwargs.get("logits_processor"))
        else:
            generator = super()._get_candidate_generator(generation_config, *args, **kwargs)
        return cap_drafts(generator, generation_config.max_length)

    def _routers(self) -> list[HybridLinearTopKRouter]:
        """The router of each MoE layer, in layer order (the order their logits are recorded)."""
        return [layer.mlp.gate for layer in self.model.layers
                if isinstance(getattr(layer.mlp, "gate", None), HybridLinearTopKRouter)]


def _auto_map_entry(cls: type) -> str:
    # "module.Class", the module named by its file: in a saved folder the sources sit flat beside config.json
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


# What every saved folder's config.json maps, whichever class was saved (a converted folder's, conversion.hf.AUTO_MAP,
# is the same).
AUTO_MAP = {
    "AutoConfig": _auto_map_entry(HybridLinearConfig),
    "AutoModel": _auto_map_entry(HybridLinearModel),
    "AutoModelForCausalLM": _auto_map_entry(HybridLinearForCausalLM),
}

__all__ = ["HybridLinearPreTrainedModel", "HybridLinearModel", "HybridLinearForCausalLM"]
