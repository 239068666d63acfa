"""One home per mixer: each mixer module's registration (mixer_registry.MixerSpec) is what the config, the model,
the cache tables, the tensor-parallel plan and LoRA read; a new mixer is its module plus its registration."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_config
from torch import nn
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING, DynamicCache

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer
from hybrid_linear_models.configuration_hybrid_linear import LAYER_TYPES
from hybrid_linear_models.training.finetune import LORA_TARGET_MODULES
from hybrid_linear_models.mixer_registry import MIXERS, MixerSpec, register


def test_every_layer_type_is_a_registered_mixer_whose_declarations_hold():
    assert LAYER_TYPES == tuple(MIXERS) == ("full_attention", "sliding_attention", "gated_deltanet",
                                            "kimi_delta_attention")
    config = tiny_config(["full_attention", "sliding_attention", "gated_deltanet", "kimi_delta_attention"])
    model = HybridLinearForCausalLM(config)
    for index, (layer_type, spec) in enumerate(MIXERS.items()):
        assert set(spec.fields) <= set(HybridLinearConfig.__dataclass_fields__)  # its settings are config fields
        mixer = getattr(model.model.layers[index], spec.attribute)
        assert type(mixer) is spec.module_class
        names = {name.rsplit(".", 1)[-1] for name, _ in mixer.named_modules()}
        assert set(spec.tensor_parallel_plan) <= names and set(spec.lora_targets) <= names
        for name, style in spec.tensor_parallel_plan.items():
            assert HybridLinearConfig.base_model_tp_plan[f"layers.*.{spec.attribute}.{name}"] == style
        assert set(spec.lora_targets) <= set(LORA_TARGET_MODULES)
        cache_layer = DynamicCache(config=config).layers[index]
        assert isinstance(cache_layer, LinearStateLayer) == (spec.state == "recurrent")
    # each mixer's own initialisation ran (through its registration): GDN's A in [0.01, 16], KDA's dt_bias finite
    gdn, kda = model.model.layers[2].linear_attn, model.model.layers[3].linear_attn
    assert torch.all(gdn.dt_bias == 1) and gdn.A_log.exp().min() >= 0.01 - 1e-6 and gdn.A_log.exp().max() <= 16
    assert kda.A_log.exp().min() >= 1 - 1e-5 and torch.isfinite(kda.dt_bias).all()


class CumulativeMean(nn.Module):
    """A toy mixer: the running mean over the sequence of a projection of the input, scaled per channel (no cache
    support)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        settings = config.per_layer_config[layer_idx]
        self.proj = nn.Linear(settings.hidden_size, settings.hidden_size, bias=False)
        self.scale = nn.Parameter(torch.empty(settings.hidden_size))

    def forward(self, hidden_states, info, cache=None):
        projected = self.proj(hidden_states)
        counts = torch.arange(1, hidden_states.shape[1] + 1, dtype=projected.dtype)[None, :, None]
        return projected.cumsum(1) / counts * self.scale


@pytest.fixture
def toy_mixer():
    def init_weights(module):  # its own parameters (submodules such as proj get the generic init)
        nn.init.constant_(module.scale, 0.5)

    spec = register(MixerSpec(
        layer_type="cumulative_mean", fields={}, module_class=CumulativeMean, attribute="linear_attn",
        state="recurrent", parameter_count=lambda s: s.hidden_size**2, init_weights=init_weights,
        cache_layer=LinearStateLayer, lora_targets=("proj",),
    ))
    yield spec
    del MIXERS["cumulative_mean"]
    DYNAMIC_LAYER_TYPE_MAPPING.pop("cumulative_mean")
    STATIC_LAYER_TYPE_MAPPING.pop("cumulative_mean")


def test_a_new_mixer_is_its_module_plus_its_registration(toy_mixer):
    config = tiny_config(["cumulative_mean", "full_attention"])
    with pytest.raises(ValueError, match=r"per_layer_config\[0\]\.gdn_num_key_heads is not read by layer 0, a "
                                         r"'cumulative_mean' layer"):
        tiny_config(["cumulative_mean", "full_attention"], per_layer_config={0: {"gdn_num_key_heads": 1}})
    with pytest.raises(ValueError, match="reduce hidden_size, intermediate_size"):  # its weight count is bounded
        tiny_config(["cumulative_mean"], hidden_size=2**21, vocab_size=8)
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(config).eval()
    toy = model.model.layers[0].linear_attn
    assert isinstance(toy, CumulativeMean) and torch.all(toy.scale == 0.5)  # its own init ran
    assert isinstance(DynamicCache(config=config).layers[0], LinearStateLayer)
    input_ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.model(input_ids, use_cache=False, output_hidden_states=True).hidden_states[1]
        # the reference: the decoder block written out by hand around the toy mixer
        layer = model.model.layers[0]
        hidden = model.model.embed_tokens(input_ids)
        normed = layer.input_layernorm(hidden)
        mixed = hidden + 0.5 * (normed @ toy.proj.weight.T).cumsum(1) / torch.arange(1, 8)[None, :, None]
        expected = mixed + layer.mlp(layer.post_attention_layernorm(mixed))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # float32, same ops up to the fused add
