"""Per-layer settings (`per_layer_config`): the config holds, validates and saves them; the model follows them.

The heterogeneous model of the issue's "done when": two GDN blocks of different head counts, a 1-KV-head sliding block
and a 2-KV-head full block (plus a KDA block and different MLP widths, epsilons and rotary settings)."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import assert_cached_generation_equals_uncached, assert_padded_and_packed_rows_run_alone
from model_helpers import assert_same_generation, greedy, randomize, replay_graphs_eagerly, run_without_the_package
from model_helpers import tiny_config
from safetensors.torch import load_file, save_file
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM, HybridLinearModel
from hybrid_linear_models.configuration_hybrid_linear import PER_LAYER_FIELDS

LAYER_TYPES = ["gated_deltanet", "sliding_attention", "gated_deltanet", "full_attention", "kimi_delta_attention"]
PER_LAYER = {
    0: {"gdn_num_key_heads": 1, "gdn_num_value_heads": 2, "gdn_value_head_dim": 16, "intermediate_size": 48},
    1: {"num_key_value_heads": 1, "head_dim": 8, "sliding_window": 3, "rope_parameters": {"rope_theta": 500.0},
        "attention_output_gate": False, "rms_norm_eps": 1e-5},
    3: {"num_key_value_heads": 2, "num_attention_heads": 2, "attention_qk_norm": False, "hidden_act": "gelu"},
    4: {"kda_num_heads": 1, "kda_conv_kernel_size": 3, "kda_gate_activation": "silu", "mlp_bias": True},
}


def heterogeneous_config(**overrides) -> HybridLinearConfig:
    return tiny_config(LAYER_TYPES, per_layer_config=PER_LAYER, **overrides)


# ------------------------------------------------------------------------------------------------------ config


def test_each_layer_reads_its_overrides_and_the_defaults_elsewhere():
    config = heterogeneous_config()
    layers = config.per_layer_config
    assert [layers[i].gdn_num_value_heads for i in (0, 2)] == [2, 4]
    assert [layers[i].num_key_value_heads for i in (1, 3)] == [1, 2]
    assert layers[1].sliding_window == 3 and layers[1].head_dim == 8 and layers[3].head_dim == 16
    # a per-layer rope dict is completed from the global one (partial_rotary_factor 0.25 by default)
    assert layers[1].rope_parameters == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}
    assert layers[0].intermediate_size == 48 and layers[2].intermediate_size == 96
    with pytest.raises(AmbiguousGlobalPerLayerAttributeError):
        config.num_key_value_heads  # noqa: B018 (a field that varies is not read from the global config)
    assert config.hidden_size == 64  # one that cannot vary is


def test_round_trips_are_exact_and_config_json_keys_are_strings(tmp_path):
    config = heterogeneous_config()
    data = config.to_dict()
    assert set(data["per_layer_config"]) == {"0", "1", "3", "4"}
    assert HybridLinearConfig.from_dict(data).to_dict() == data
    config.save_pretrained(tmp_path)  # runs validate() (transformers' strict-config hook) on the heterogeneous config
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["per_layer_config"]["1"]["num_key_value_heads"] == 1
    loaded = HybridLinearConfig.from_pretrained(tmp_path).to_dict()
    for entry in (loaded, data):
        for key in ("_name_or_path", "auto_map", "transformers_version"):
            entry.pop(key, None)
    assert loaded == data


def test_overrides_equal_to_the_defaults_leave_a_homogeneous_config():
    config = tiny_config(per_layer_config={1: {"num_key_value_heads": 2}, "2": {}})
    assert not config.is_heterogeneous and "per_layer_config" not in config.to_dict()
    assert config.num_key_value_heads == 2


@pytest.mark.parametrize("per_layer, expected", [
    ({1: {"num_key_value_heads": 3}},
     "per_layer_config[1].num_attention_heads=4 must be a multiple of per_layer_config[1].num_key_value_heads=3"),
    ({1: {"num_key_value_heads": "2"}}, "per_layer_config[1].num_key_value_heads must be a positive integer"),
    ({3: {"sliding_window": 0}}, "per_layer_config[3].sliding_window must be a positive integer"),
    ({1: {"attention_bias": 1}}, "per_layer_config[1].attention_bias must be True or False"),
    ({0: {"gdn_num_key_heads": 3}}, "per_layer_config[0].gdn_num_value_heads=4 must be a multiple of"),
    ({2: {"kda_norm_eps": 0.0}}, "per_layer_config[2].kda_norm_eps must be in (0.0, inf)"),
    ({1: {"rope_parameters": {"rope_type": "yarn"}}}, "per_layer_config[1].rope_parameters with rope_type 'yarn'"),
    ({1: {"head_dim": 2, "rope_parameters": {"partial_rotary_factor": 0.5}}}, "per_layer_config[1].head_dim * "),
    ({1: {"hidden_act": "nope"}}, "per_layer_config[1].hidden_act='nope' is not a known activation"),
    ({1: {"head_dim": 2**39}}, "reduce per_layer_config[1].hidden_size"),
    ({1: {"hidden_size": 32}}, "per_layer_config[1].hidden_size cannot differ between layers"),
    ({1: {"zero_centered_norms": False}}, "per_layer_config[1].zero_centered_norms cannot differ between layers"),
    ({1: {"gdn_num_key_heads": 1}}, "per_layer_config[1].gdn_num_key_heads is not read by layer 1, a "
                                    "'full_attention' layer"),
    ({1: {"sliding_window": 4}}, "per_layer_config[1].sliding_window is not read by layer 1"),
    ({1: {"skip": ["mlp"]}}, "per_layer_config[1].skip: every layer of this model runs its mixer and its MLP"),
    ({1: {"bogus": 1}}, "per_layer_config[1].bogus is not a field of HybridLinearConfig"),
    ({4: {"intermediate_size": 8}}, "per_layer_config has the key 4; its keys must be layer indices in [0, "),
    ({"one": {}}, "per_layer_config has the key 'one'"),
    ({1: {}, "01": {}}, "per_layer_config names layer 1 twice"),
    ({1: 5}, "per_layer_config[1] must be a dict"),
    ([1, 2], "per_layer_config must be a dict"),
])
def test_bad_per_layer_settings_name_the_layer_and_the_field(per_layer, expected):
    with pytest.raises(ValueError) as caught:
        tiny_config(per_layer_config=per_layer)  # layers: GDN, full attention, KDA, sliding attention
    message = str(caught.value)
    assert expected in message, message
    assert "\n" not in message and len(message) < 1000


def test_a_sliding_layer_needs_a_window_globally_or_its_own():
    config = tiny_config(["sliding_attention", "sliding_attention"], sliding_window=None,
                         per_layer_config={0: {"sliding_window": 2}, 1: {"sliding_window": 5}})
    assert [layer.sliding_window for layer in config.per_layer_config] == [2, 5]
    with pytest.raises(ValueError, match="so sliding_window must be a positive integer, got None"):
        tiny_config(["sliding_attention", "sliding_attention"], sliding_window=None,
                    per_layer_config={0: {"sliding_window": 2}})


def test_hostile_per_layer_configs_give_a_bounded_message():
    per_layer = {i: {"num_key_value_heads": -1, "bogus" * 1000: 1} for i in range(4)}
    with pytest.raises(ValueError) as caught:
        tiny_config(per_layer_config=per_layer)
    assert len(str(caught.value)) < 2000


# ------------------------------------------------------------------------------------------------------- model


def heterogeneous_model(layer_types=LAYER_TYPES, per_layer=PER_LAYER, seed: int = 0) -> HybridLinearForCausalLM:
    """In float64: paths that sum in different orders (chunked prefill, recurrent steps, padded and packed kernels)
    then agree to ~1e-12, so a tolerance of 1e-9 leaves no room for a real difference (a wrong window, head count or
    state shape moves logits by O(1)), where float32 rounding alone reaches 2e-5 on these random weights."""
    torch.manual_seed(seed)
    config = tiny_config(layer_types, per_layer_config=per_layer)
    return randomize(HybridLinearForCausalLM(config), seed).double().eval()


def test_each_layer_has_the_shapes_of_its_settings():
    model = heterogeneous_model()
    layers = model.model.layers
    assert layers[0].linear_attn.in_proj_ba.weight.shape == (2 * 2, 64)  # 2 GDN value heads
    assert layers[2].linear_attn.in_proj_ba.weight.shape == (2 * 4, 64)  # 4: the default
    assert layers[1].self_attn.k_proj.weight.shape == (1 * 8, 64)  # 1 KV head of 8 dims
    assert layers[3].self_attn.k_proj.weight.shape == (2 * 16, 64)
    assert layers[1].self_attn.sliding_window == 3 and layers[3].self_attn.q_norm is None
    assert layers[0].mlp.up_proj.weight.shape == (48, 64) and layers[4].mlp.up_proj.bias is not None
    assert layers[1].input_layernorm.eps == 1e-5 and model.model.norm.eps == 1e-6
    assert len(model.model.rotary_embs) == 2  # (8 dims, theta 500) and (16 dims, theta 1e4), each computed once


def _homogeneous_layer(config: HybridLinearConfig, index: int) -> HybridLinearModel:
    """Layer `index` of a heterogeneous config built alone from a homogeneous one-layer config of its settings."""
    settings = config.per_layer_config[index]
    fields = {name: getattr(settings, name) for name in PER_LAYER_FIELDS}
    return HybridLinearModel(tiny_config([config.mixer_types[index]], **fields)).double().eval()


def test_the_forward_equals_a_composition_of_homogeneous_layers():
    """The independent reference: each layer run by a one-layer model of a homogeneous config (its own rotary
    embedding, mask and cache-free path), with the same weights, chained by hand."""
    model = heterogeneous_model()
    input_ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids).logits
        hidden = model.model.embed_tokens(input_ids)
        for index, layer in enumerate(model.model.layers):
            alone = _homogeneous_layer(model.config, index)
            alone.layers[0].load_state_dict(layer.state_dict(), strict=True)
            alone.norm = torch.nn.Identity()  # the layer's output itself
            hidden = alone(inputs_embeds=hidden, use_cache=False).last_hidden_state
        logits = model.lm_head(model.model.norm(hidden))
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)  # float64 (see heterogeneous_model)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_equals_uncached(cache):
    model = heterogeneous_model()
    input_ids = torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    assert_cached_generation_equals_uncached(model, input_ids, cache, tolerance=1e-9)  # float64 (heterogeneous_model)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt_length", [2, 7])  # shorter and longer than the sliding block's window of 3
def test_graph_decoding_of_a_heterogeneous_model_equals_uncached(monkeypatch, attention, prompt_length):
    """The issue's "done when" on the CUDA-graph path (its graph stood in by an eager replay of the captured step, as
    in test_graph_decoding_cpu.py): two GDN layers of different head counts, a 1-KV-head sliding layer (window 3)
    and a 2-KV-head full layer, a left-padded batch, and 16 steps, so that the window's buffer rolls over 5 times."""
    captured = replay_graphs_eagerly(monkeypatch)
    model = heterogeneous_model()
    model.config._attn_implementation = attention
    input_ids = torch.randint(2, 128, (3, prompt_length), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :1] = 0  # left pads: one, and (for the long prompt) more than the window
    attention_mask[2, : prompt_length - 1] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=16, min_new_tokens=16)
    without = greedy(model, input_ids, use_cache=False, **kwargs)
    graphed = greedy(model, input_ids, cache_implementation="static", **kwargs)
    assert sum(step.replays for step in captured) == 15  # every decoding step went through the replayed graph
    assert_same_generation(graphed, without, tolerance=1e-9)  # float64 (see heterogeneous_model)


def test_left_padding_and_packing_follow_per_layer_settings():
    model = heterogeneous_model()
    # each row/document as run alone (float64, see heterogeneous_model)
    assert_padded_and_packed_rows_run_alone(model, seed=4, tolerance=1e-9)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = heterogeneous_model().train()
    model.config.fuse_linear_cross_entropy = False
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids, labels=input_ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)  # recomputed


def test_a_saved_heterogeneous_model_loads_with_its_logits(tmp_path):
    model = heterogeneous_model()
    input_ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(6))
    model.save_pretrained(tmp_path)
    loaded = HybridLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert loaded.model.layers[1].self_attn.k_proj.weight.shape == (8, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=1e-9, atol=1e-9)


@pytest.mark.slow  # a subprocess that loads the model without the package
def test_a_saved_heterogeneous_folder_loads_as_remote_code_without_the_package(tmp_path):
    """The folder's own sources (auto_map, trust_remote_code) run the per-layer settings where the package cannot be
    imported: the subprocess of test_first_hour.py, on this folder."""
    from test_first_hour import _WITHOUT_THE_PACKAGE

    model = heterogeneous_model().float()
    model.config.tie_word_embeddings = True  # AutoModel's hidden states then feed the LM head exactly
    model.save_pretrained(tmp_path / "het")
    input_ids = torch.tensor([[3, 5, 7, 2, 11, 4, 9, 1, 6, 8]])
    save_file({"input_ids": input_ids}, tmp_path / "input_ids.safetensors")
    job = {"models": {"het": str(tmp_path / "het")}, "resaved": {"het": str(tmp_path / "resaved")}, "tokenizers": {},
           "text": "", "input_ids": str(tmp_path / "input_ids.safetensors"),
           "tensors": str(tmp_path / "outputs.safetensors"), "report": str(tmp_path / "report.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "run.py").write_text(_WITHOUT_THE_PACKAGE)
    run_without_the_package(tmp_path / "run.py", tmp_path / "job.json", cwd=tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["package_imported"]
    loaded = HybridLinearForCausalLM.from_pretrained(tmp_path / "het").eval()
    with torch.no_grad():
        expected = loaded(input_ids).logits
    # the same code on the same weights in the same dtype: equal
    assert torch.equal(load_file(tmp_path / "outputs.safetensors")["het/AutoModelForCausalLM"], expected)


def test_tensor_parallelism_names_the_layer_whose_heads_do_not_divide(monkeypatch):
    """A layer's head count that the tensor-parallel size does not divide fails in its first forward, naming the layer
    and its field (the mesh of a 2-rank shard stood in, as the check reads only its size and rank)."""
    from hybrid_linear_models import tensor_parallel_heads

    class TwoRanks:
        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    model = heterogeneous_model()
    monkeypatch.setattr(tensor_parallel_heads, "device_mesh", lambda tensor: TwoRanks())
    with pytest.raises(ValueError, match=r"needs layer 0's gdn_num_key_heads divisible by 2, got 1.*"
                                         r"per_layer_config\[0\]\.gdn_num_key_heads"):
        model(torch.tensor([[1, 2, 3]]))
    attention = model.model.layers[1].self_attn
    with pytest.raises(ValueError, match=r"layer 1's num_key_value_heads divisible by 2, got 1"):
        attention(torch.zeros(1, 3, 64, dtype=torch.float64), None, None)
