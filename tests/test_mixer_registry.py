"""One home per mixer and per MLP: each component module's registration (mixer_registry.MixerSpec,
mlp_registry.MlpSpec) is what the config (its fields, defaults, docs and checks), the model, the cache tables, the
tensor-parallel plan and LoRA read; a new mixer or MLP is its module plus its registration."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from model_helpers import WITHOUT_THE_PACKAGE_PRELUDE, run_without_the_package, tiny_config
from torch import nn
from transformers import configuration_utils
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    DynamicCache,
    LinearAttentionLayer,
)

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models import mlp_registry
from hybrid_linear_models.component_registry import ConfigField
from hybrid_linear_models.configuration_hybrid_linear import MIXER_TYPES
from hybrid_linear_models.conversion import ConversionError
from hybrid_linear_models.conversion.fast_llm.config import hybrid_config_to_fast_llm
from hybrid_linear_models.conversion.model_card import render_model_card
from hybrid_linear_models.mixer_registry import MIXERS, MixerSpec, register, unregister
from hybrid_linear_models.mlp_dense import HybridLinearMLP
from hybrid_linear_models.mlp_registry import MLPS, MlpSpec
from hybrid_linear_models.training.finetune import LORA_TARGET_MODULES


def test_every_layer_type_is_a_registered_mixer_whose_declarations_hold():
    assert MIXER_TYPES == tuple(MIXERS) == ("full_attention", "sliding_attention", "gated_deltanet",
                                            "kimi_delta_attention", "mla_attention")
    config = tiny_config(list(MIXER_TYPES))
    model = HybridLinearForCausalLM(config)
    # with q LoRA, the MLA layer holds its q_a_proj / q_b_proj instead of q_proj (the plan and LoRA name both)
    low_rank_q = HybridLinearForCausalLM(tiny_config(list(MIXER_TYPES), q_lora_rank=8))
    for index, (layer_type, spec) in enumerate(MIXERS.items()):
        for name, declared in spec.fields.items():  # its settings are config fields, with its defaults and docs
            assert HybridLinearConfig.__dataclass_fields__[name].default == declared.default
            assert f"        {name} (`{declared.annotation}`" in HybridLinearConfig.__doc__
        mixer = getattr(model.model.layers[index], spec.attribute)
        assert type(mixer) is spec.module_class
        names = {name.rsplit(".", 1)[-1] for variant in (model, low_rank_q)
                 for name, _ in getattr(variant.model.layers[index], spec.attribute).named_modules()}
        assert set(spec.tensor_parallel_plan) <= names and set(spec.lora_targets) <= names
        for name, style in spec.tensor_parallel_plan.items():
            assert HybridLinearConfig.base_model_tp_plan[f"layers.*.{spec.attribute}.{name}"] == style
        assert set(spec.lora_targets) <= set(LORA_TARGET_MODULES)
        cache_layer = DynamicCache(config=config).layers[index]  # transformers' own, from its layer type
        assert config.layer_types[index] == spec.layer_type
        assert isinstance(cache_layer, LinearAttentionLayer) == (spec.state == "recurrent")
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
        mixer_type="cumulative_mean", layer_type="linear_attention", fields={}, module_class=CumulativeMean,
        attribute="linear_attn", state="recurrent", parameter_count=lambda s: s.hidden_size**2,
        init_weights=init_weights, lora_targets=("proj",),
    ))
    yield spec
    unregister("cumulative_mean")
    assert "cumulative_mean" not in MIXERS and "cumulative_mean" not in DYNAMIC_LAYER_TYPE_MAPPING
    assert "cumulative_mean" not in STATIC_LAYER_TYPE_MAPPING
    assert "cumulative_mean" not in configuration_utils.ALLOWED_LAYER_TYPES


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
    assert config.layer_types == ["linear_attention", "full_attention"]  # transformers' words for the two layers
    assert isinstance(DynamicCache(config=config).layers[0], LinearAttentionLayer)
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


def test_shared_settings_are_declared_once():
    full, sliding = MIXERS["full_attention"].fields, MIXERS["sliding_attention"].fields
    assert all(sliding[name] is declared for name, declared in full.items())  # one declaration, referenced twice
    assert set(sliding) - set(full) == {"sliding_window"}
    # defaults that follow another field are declared by the spec and resolved by the config
    config = tiny_config(rms_norm_eps=1e-4)
    assert MIXERS["gated_deltanet"].fields["gdn_norm_eps"].default_from == "rms_norm_eps"
    assert config.gdn_norm_eps == config.kda_norm_eps == 1e-4
    assert tiny_config(rms_norm_eps=1e-4, gdn_norm_eps=1e-3).gdn_norm_eps == 1e-3


def test_the_dense_mlp_is_a_registered_per_layer_choice():
    spec = MLPS["dense"]
    assert tuple(MLPS) == ("dense", "sparse_moe", "kimi_moe") and spec.module_class is HybridLinearMLP  # + MoEs
    assert set(spec.fields) == {"intermediate_size", "hidden_act", "mlp_bias"}
    config = tiny_config(["gated_deltanet", "full_attention"], per_layer_config={1: {"intermediate_size": 32}})
    assert config.mlp_types == ["dense", "dense"]  # resolved explicitly, like layer_types
    assert config.to_dict()["mlp_types"] == ["dense", "dense"]
    model = HybridLinearForCausalLM(config)
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(type(mlp) is HybridLinearMLP for mlp in mlps)
    assert mlps[0].up_proj.weight.shape == (96, 64) and mlps[1].up_proj.weight.shape == (32, 64)  # its own setting
    for name, style in spec.tensor_parallel_plan.items():
        assert HybridLinearConfig.base_model_tp_plan[f"layers.*.mlp.{name}"] == style
    assert set(spec.lora_targets) <= set(LORA_TARGET_MODULES)


# ------------------------------------------------------------------------------------------------ a toy MLP


class SquaredReluMLP(nn.Module):
    """A toy MLP: down(relu(up(x))^2 * scale), of width `toy_width`."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        settings = config.per_layer_config[layer_idx]
        self.up = nn.Linear(settings.hidden_size, settings.toy_width, bias=False)
        self.down = nn.Linear(settings.toy_width, settings.hidden_size, bias=False)
        self.scale = nn.Parameter(torch.empty(settings.toy_width))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) ** 2 * self.scale)


TOY_FIELDS = {
    "toy_width": ConfigField(kind="size", default=24, doc="width of the toy MLP."),
    "toy_eps": ConfigField(kind="epsilon", default=None, default_from="rms_norm_eps", doc="an epsilon it keeps."),
}


def _toy_relations(s, p):
    return [f"{p}toy_width={s.toy_width} must be even"] if s.toy_width % 2 else []


@pytest.fixture
def toy_mlp():
    spec = mlp_registry.register(MlpSpec(
        mlp_type="squared_relu", title="squared-ReLU MLP", fields=TOY_FIELDS, module_class=SquaredReluMLP,
        parameter_count=lambda s: 2 * s.hidden_size * s.toy_width, relation_problems=_toy_relations,
        init_weights=lambda module: nn.init.constant_(module.scale, 0.25),
        tensor_parallel_plan={"up": "colwise", "down": "rowwise"}, lora_targets=("up", "down"),
    ))
    yield spec
    mlp_registry.unregister("squared_relu")


def test_a_new_mlp_is_its_module_plus_its_registration(toy_mlp, toy_mixer):
    # its fields joined the config class, with their defaults, docs and TP entries (no edit of the config module)
    assert HybridLinearConfig.__dataclass_fields__["toy_width"].default == 24
    assert "toy_width (`int`, defaults to 24; squared_relu): width of the toy MLP." in HybridLinearConfig.__doc__
    assert HybridLinearConfig.base_model_tp_plan["layers.*.mlp.up"] == "colwise"
    assert "up" in mlp_registry.lora_targets()
    types = ["cumulative_mean", "full_attention"]
    config = tiny_config(types, mlp_types=["squared_relu", "dense"], rms_norm_eps=1e-5)
    assert config.toy_width == 24 and config.toy_eps == 1e-5  # its default; its default_from
    assert HybridLinearConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    # validation: the field alone, its relations, per layer, and the size bound
    with pytest.raises(ValueError, match=r"^Invalid HybridLinearConfig: toy_width must be a positive integer, got 0"):
        tiny_config(types, mlp_types=["squared_relu", "dense"], toy_width=0)
    with pytest.raises(ValueError, match=r"per_layer_config\[0\]\.toy_width=7 must be even"):
        tiny_config(types, mlp_types=["squared_relu", "dense"], per_layer_config={0: {"toy_width": 7}})
    with pytest.raises(ValueError, match=r"per_layer_config\[1\]\.toy_width is not read by layer 1, whose MLP is "
                                         r"'dense' \(mlp_types\[1\]; it would be ignored\); remove it, or change "
                                         r"mlp_types\[1\]"):
        tiny_config(types, mlp_types=["squared_relu", "dense"], per_layer_config={1: {"toy_width": 8}})
    with pytest.raises(ValueError, match=r"per_layer_config\[0\]\.intermediate_size is not read by layer 0, whose "
                                         r"MLP is 'squared_relu'"):
        tiny_config(types, mlp_types=["squared_relu", "dense"], per_layer_config={0: {"intermediate_size": 8}})
    with pytest.raises(ValueError, match=r"one cumulative_mean layer with a 'squared_relu' MLP .* reduce hidden_size, "
                                         r"toy_width"):
        tiny_config(types, mlp_types=["squared_relu", "dense"], toy_width=2**40)
    # per-layer use: layer 0 of width 8 beside layer 1's default; its own init ran
    config = tiny_config(["cumulative_mean", "cumulative_mean"], mlp_types=["squared_relu", "squared_relu"],
                         per_layer_config={0: {"toy_width": 8}})
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(config).eval()
    first, second = model.model.layers
    assert isinstance(first.mlp, SquaredReluMLP) and torch.all(first.mlp.scale == 0.25)
    assert first.mlp.up.weight.shape == (8, 64) and second.mlp.up.weight.shape == (24, 64)
    input_ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.model(input_ids, use_cache=False, output_hidden_states=True).hidden_states[1]
        # the reference: the first block written out by hand from the math of both toys
        hidden = model.model.embed_tokens(input_ids)
        toy = first.linear_attn
        mixed = hidden + 0.5 * (first.input_layernorm(hidden) @ toy.proj.weight.T).cumsum(1) / torch.arange(1, 6)[
            None, :, None]
        normed = first.post_attention_layernorm(mixed)
        expected = mixed + (torch.relu(normed @ first.mlp.up.weight.T) ** 2 * 0.25) @ first.mlp.down.weight.T
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # float32, same ops up to the fused add


def test_the_model_card_describes_new_components_from_their_registrations(toy_mlp, toy_mixer):
    config = tiny_config(["cumulative_mean", "gated_deltanet"], mlp_types=["squared_relu", "dense"],
                         per_layer_config={0: {"toy_width": 8}})
    card = render_model_card(config, name="toy", parameter_count=1, dtype="float32", source_format="hf",
                             source_format_description="d", source_path="p")
    assert "| 0 | cumulative_mean (`cumulative_mean`), squared-ReLU MLP (`squared_relu`), toy_width=8 |" in card
    assert "| 1 | Gated DeltaNet (`gated_deltanet`), gated MLP (`dense`) |" in card
    assert "| Layers | 2: 1 cumulative_mean, 1 Gated DeltaNet (2 key heads of 16, 4 value heads of 8) |" in card
    assert "| MLPs | 1 squared-ReLU MLP, 1 gated MLP (intermediate size 96) |" in card


def test_the_fast_llm_writer_refuses_an_mlp_it_cannot_express(toy_mlp):
    config = tiny_config(["gated_deltanet", "full_attention"], mlp_types=["dense", "squared_relu"],
                         zero_centered_norms=False, attention_output_gate=False, attention_qk_norm=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})
    with pytest.raises(ConversionError, match=r"^this model cannot be expressed as a Fast-LLM model: layer 1 "
                                              r"\(full_attention\): mlp_types\[1\]='squared_relu' \(this converter "
                                              r"writes the MLP types 'dense' \(Fast-LLM's gated MLP\), 'sparse_moe' "
                                              r"\(Fast-LLM's mixture of experts\)\)\.$"):
        hybrid_config_to_fast_llm(config)


def test_unregistering_takes_the_fields_out():
    fields_before = len(HybridLinearConfig.__dataclass_fields__)
    mlp_registry.register(MlpSpec(mlp_type="toy", fields={"toy_size": ConfigField(kind="size", default=3, doc="x.")},
                                  module_class=SquaredReluMLP, parameter_count=lambda s: 0,
                                  tensor_parallel_plan={"up": "colwise"}))
    assert tiny_config(mlp_types=["toy"] * 4).toy_size == 3
    mlp_registry.unregister("toy")
    assert "toy_size" not in HybridLinearConfig.__dataclass_fields__ and "toy_size" not in HybridLinearConfig.__doc__
    assert "layers.*.mlp.up" not in HybridLinearConfig.base_model_tp_plan
    assert len(HybridLinearConfig.__dataclass_fields__) == fields_before
    with pytest.raises(ValueError, match=r"mlp_types has unknown entries \['toy'\]"):
        tiny_config(mlp_types=["toy"] * 4)


@pytest.mark.parametrize("fields, message", [
    ({"num_attention_heads": ConfigField(kind="size", default=4, doc="heads.")},
     "MlpSpec of 'bad': field 'num_attention_heads' is declared differently by mixer_types 'full_attention', "
     "mixer_types 'sliding_attention', mixer_types 'mla_attention': declare it once and share the declaration."),
    ({"hidden_size": ConfigField(kind="size", default=4, doc="width.")},
     "a registered component declares a field that HybridLinearConfig owns: hidden_size (declared by bad)"),
    ({"bad_size": ConfigField(kind="length", default=[4], doc="")},
     "MlpSpec of 'bad': field 'bad_size': its kind 'length' must be one of"),
    ({"bad_eps": ConfigField(kind="epsilon", default=1e-5, default_from="rms_norm_eps", doc="eps.")},
     "field 'bad_eps': a field with default_from must default to None"),
])
def test_a_bad_declaration_is_refused_and_leaves_the_registry_as_it_was(fields, message):
    before = (dict(MLPS), dict(HybridLinearConfig.__dataclass_fields__), HybridLinearConfig.__doc__)
    with pytest.raises(ValueError) as caught:
        mlp_registry.register(MlpSpec(mlp_type="bad", fields=fields, module_class=SquaredReluMLP,
                                      parameter_count=lambda s: 0))
    assert message in str(caught.value)
    assert (dict(MLPS), dict(HybridLinearConfig.__dataclass_fields__), HybridLinearConfig.__doc__) == before


# ------------------------------------------------------------------------------------- remote code

_REMOTE_LOAD = WITHOUT_THE_PACKAGE_PRELUDE + textwrap.dedent("""

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, reference = sys.argv[1], load_file(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    print(json.dumps({"mlp_module": type(mlp).__module__, "mlp_types": model.config.mlp_types,
                      "package_imported": any(m.split(".")[0] == "hybrid_linear_models" for m in sys.modules),
                      "max_diff": (logits - reference["logits"]).abs().max().item()}))
""")


@pytest.mark.slow  # a subprocess that loads the model without the package
def test_a_saved_folder_ships_the_mlp_modules_and_loads_without_the_package(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = HybridLinearForCausalLM(tiny_config(["gated_deltanet", "full_attention"])).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    for name in ("mlp_registry.py", "mlp_dense.py", "component_registry.py"):
        assert (folder / name).is_file(), name
    input_ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        save_file({"input_ids": input_ids, "logits": model(input_ids).logits}, tmp_path / "reference.safetensors")
    script = tmp_path / "load.py"
    script.write_text(_REMOTE_LOAD)
    result = run_without_the_package(script, folder, tmp_path / "reference.safetensors", cwd=tmp_path)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["mlp_module"].startswith("transformers_modules") and report["mlp_module"].endswith("mlp_dense")
    assert report["mlp_types"] == ["dense", "dense"] and not report["package_imported"]
    # the same code on the same CPU in float32: equal up to summation order
    assert report["max_diff"] <= 1e-5
