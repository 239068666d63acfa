"""Attention biases per projection: `attention_bias` (q, k, v) and `attention_output_bias` (o_proj), whose unset
value follows attention_bias, per layer too, so configs and folders written before it keep their meaning.

The model with Qwen2-style biases (q/k/v, none on o_proj) is checked against a forward pass written here from the
math with torch.nn.functional ops and the model's own weights.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from conversion_helpers import FAST_LLM_FIXTURES as FIXTURES
from fast_llm_layout import VOCAB, heterogeneous_blocks, write_fast_llm_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file

import hybrid_linear_models  # noqa: F401
from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.component_registry import ConfigField
from hybrid_linear_models.conversion import convert_checkpoint
from hybrid_linear_models.conversion.errors import ConversionError

_TINY = dict(hidden_size=32, vocab_size=64, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, attention_output_gate=False, attention_qk_norm=False, zero_centered_norms=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})


def _biases(model: HybridLinearForCausalLM, index: int) -> dict[str, bool]:
    attention = model.model.layers[index].self_attn
    return {name: getattr(attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_unset_output_bias_follows_attention_bias_globally_and_per_layer():
    """A config without attention_output_bias means what it meant when attention_bias switched all four, layer by
    layer; given explicitly, it wins, and a saved config reads back the same."""
    config = HybridLinearConfig(layer_types=["full_attention"] * 3, **_TINY,
                                per_layer_config={1: {"attention_bias": True},
                                                  2: {"attention_bias": True, "attention_output_bias": False}})
    model = HybridLinearForCausalLM(config)
    assert _biases(model, 0) == dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), False)
    assert _biases(model, 1) == dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), True)
    assert _biases(model, 2) == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}
    again = HybridLinearConfig.from_dict(config.to_dict())
    assert [again.per_layer_config[i].attention_output_bias for i in range(3)] == [False, True, False]
    assert HybridLinearConfig(layer_types=["full_attention"], **_TINY, attention_bias=True).attention_output_bias
    explicit = HybridLinearConfig(layer_types=["full_attention"] * 2, **_TINY, attention_output_bias=False,
                                  per_layer_config={1: {"attention_bias": True}})
    assert not explicit.per_layer_config[1].attention_output_bias  # set globally: a layer's attention_bias is its own


def test_an_old_config_json_without_the_field_keeps_its_biases():
    """config.json as written before the field existed (no attention_output_bias key)."""
    old = HybridLinearConfig(layer_types=["full_attention"] * 2, **_TINY,
                             per_layer_config={1: {"attention_bias": True}}).to_dict()
    old.pop("attention_output_bias")
    loaded = HybridLinearConfig.from_dict(old)
    assert [loaded.per_layer_config[i].attention_output_bias for i in range(2)] == [False, True]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"attention_output_bias": "no"}, "attention_output_bias must be True or False (a bool), got 'no'"),
    ({"per_layer_config": {0: {"attention_output_bias": 1}}},
     "per_layer_config[0].attention_output_bias must be True or False (a bool), got 1"),
    ({"per_layer_config": {1: {"attention_output_bias": True}}},
     "per_layer_config[1].attention_output_bias is not read by layer 1, a 'gated_deltanet' layer"),
])
def test_bad_values_are_named(kwargs, fragment):
    with pytest.raises(ValueError) as caught:
        HybridLinearConfig(layer_types=["full_attention", "gated_deltanet"], **{**_TINY, **kwargs})
    assert fragment in str(caught.value)


def test_a_layer_may_override_the_output_bias_alone():
    config = HybridLinearConfig(layer_types=["full_attention", "sliding_attention"], sliding_window=4, **_TINY,
                                attention_bias=True, per_layer_config={1: {"attention_output_bias": False}})
    model = HybridLinearForCausalLM(config)
    assert _biases(model, 0)["o_proj"] and not _biases(model, 1)["o_proj"] and _biases(model, 1)["q_proj"]


def test_per_layer_default_from_needs_default_from():
    problems = ConfigField(kind="bool", default=None, per_layer_default_from=True, doc="x.").problems("f")
    assert problems == ["field 'f': per_layer_default_from needs default_from (the field whose layer overrides it "
                        "follows)"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_logits(model: HybridLinearForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """One attention layer and its MLP, from the math: q, k, v with biases, Llama rotary over the whole head, causal
    GQA softmax, o_proj (bias or not), SwiGLU MLP, plain RMSNorms."""
    config, layer = model.config, model.model.layers[0]
    attention, mlp, eps = layer.self_attn, layer.mlp, config.rms_norm_eps
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B, T = input_ids.shape
    x = model.model.embed_tokens.weight[input_ids]
    h = _rms_norm(x, layer.input_layernorm.weight, eps)
    q = F.linear(h, attention.q_proj.weight, attention.q_proj.bias).view(B, T, heads, d).transpose(1, 2)
    k = F.linear(h, attention.k_proj.weight, attention.k_proj.bias).view(B, T, kv_heads, d).transpose(1, 2)
    v = F.linear(h, attention.v_proj.weight, attention.v_proj.bias).view(B, T, kv_heads, d).transpose(1, 2)
    inv_freq = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotate(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, heads * d)
    x = x + F.linear(o, attention.o_proj.weight, attention.o_proj.bias)
    h = _rms_norm(x, layer.post_attention_layernorm.weight, eps)
    x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight), mlp.down_proj.weight)
    return F.linear(_rms_norm(x, model.model.norm.weight, eps), model.lm_head.weight)


@pytest.mark.parametrize("output_bias", [False, True])
def test_qkv_biases_without_output_bias_match_the_math(output_bias):
    torch.manual_seed(0)
    config = HybridLinearConfig(layer_types=["full_attention"], **_TINY, attention_bias=True,
                                attention_output_bias=output_bias)
    config._attn_implementation = "eager"
    model = HybridLinearForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # biases away from zero, so that each one counts
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
        input_ids = torch.randint(0, config.vocab_size, (2, 7))
        logits = model(input_ids).logits
        reference = _reference_logits(model, input_ids)
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == output_bias
    # float32, the same products summed in another order (repeat_kv, softmax): measured 6e-8 on logits of ~1
    assert (logits - reference).abs().max().item() <= 1e-6
    assert logits.abs().max().item() > 0.1


# ------------------------------------------------------------------------------------------------------ Fast-LLM

def _qwen2_block(blocks: dict) -> dict:
    """The fixture's attention block with biases as Fast-LLM's Qwen2 importer writes them
    (fast_llm/models/gpt/conversion/qwen2.py: add_linear_biases false, q/k/v bias.enabled true, dense false)."""
    block = copy.deepcopy(blocks["attn"])
    block["mixer"].update(add_linear_biases=False, query_layer={"bias": {"enabled": True}},
                          key_layer={"bias": {"enabled": True}}, value_layer={"bias": {"enabled": True}},
                          dense_layer={"bias": {"enabled": False}})
    return block


def _fast_llm_reference(tensors: dict[str, torch.Tensor], block: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a one-block Fast-LLM attention model from its own tensors and the math: key_value holds K rows then
    V rows, rotary rotate-half over the whole head, query head i reads KV head i // (heads / head_groups), MLP
    layer_1 = [gate | up], layer_2 stored transposed, plain RMSNorms (epsilon 1e-5)."""
    mixer, eps = block["mixer"], 1e-5
    heads, groups, d = mixer["heads"], mixer["head_groups"], mixer["head_size"]
    p = {name.removeprefix("decoder.0."): tensor for name, tensor in tensors.items()}
    B, T = input_ids.shape
    x = p["embeddings.word_embeddings_weight"][input_ids]
    h = _rms_norm(x, p["norm_1.weight"], eps)
    q = F.linear(h, p["mixer.query.weight"], p.get("mixer.query.bias")).view(B, T, heads, d).transpose(1, 2)
    k, v = F.linear(h, p["mixer.key_value.weight"], p.get("mixer.key_value.bias")).chunk(2, dim=-1)
    k, v = (t.reshape(B, T, groups, d).transpose(1, 2).repeat_interleave(heads // groups, 1) for t in (k, v))
    inv_freq = 1.0 / mixer["rotary"]["theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k = (t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin for t in (q, k))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                                                 float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, heads * d)
    x = x + F.linear(o, p["mixer.dense.weight"], p.get("mixer.dense.bias"))
    gate, up = F.linear(_rms_norm(x, p["norm_2.weight"], eps), p["mlp.layer_1.weight"]).chunk(2, dim=-1)
    x = x + (F.silu(gate) * up) @ p["mlp.layer_2.weight"]
    return F.linear(_rms_norm(x, p["head.final_norm.weight"], eps), p["head.output_weights"])


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in folder.glob("*.safetensors") for k, v in load_file(file).items()}


def test_a_qwen2_style_fast_llm_block_converts_and_gives_the_logits_of_the_math(tmp_path):
    blocks = heterogeneous_blocks()
    block = _qwen2_block(blocks)
    tensors = write_fast_llm_checkpoint(tmp_path, {"qwen2": block}, ["qwen2"],
                                        {"type": "fixed", "block": block, "num_blocks": 1})
    assert "decoder.0.mixer.query.bias" in tensors and "decoder.0.mixer.dense.bias" not in tensors
    convert_checkpoint(tmp_path / "fast_llm", tmp_path / "hf", from_format="fast_llm", to_format="hf")
    model = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert model.config.attention_bias and not model.config.attention_output_bias
    assert _biases(model, 0) == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids).logits
        reference = _fast_llm_reference(tensors, block, input_ids)
    # float32, the same products summed in another order: measured 4.8e-7, the bound 1e-4 (with the query
    # bias dropped from the reference they differ by 4e-3, so each bias counts)
    assert (logits - reference).abs().max().item() <= 1e-4
    assert logits.abs().max().item() > 0.1


_MIXED_PATTERN = ["qwen2", "attn", "gdn", "sliding", "qwen2"]  # Qwen2-style, no biases, GDN, all four biased


def test_qwen2_style_blocks_round_trip_bit_exact_and_read_alike_from_distributed(tmp_path):
    blocks = heterogeneous_blocks()
    blocks = {"qwen2": _qwen2_block(blocks), "attn": blocks["attn"], "gdn": blocks["gdn"],
              "sliding": blocks["sliding"]}
    decoder = {"type": "pattern", "blocks": blocks, "pattern": _MIXED_PATTERN, "num_blocks": len(_MIXED_PATTERN)}
    tensors = write_fast_llm_checkpoint(tmp_path / "src", blocks, _MIXED_PATTERN, decoder)
    convert_checkpoint(tmp_path / "src" / "fast_llm", tmp_path / "hf", from_format="fast_llm", to_format="hf")
    layers = HybridLinearConfig.from_pretrained(tmp_path / "hf").per_layer_config
    assert [(layers[i].attention_bias, layers[i].attention_output_bias) for i in (0, 1, 3, 4)] == [
        (True, False), (False, False), (True, True), (True, False)]
    # distributed: the dense bias (no weight decay, not tensor-parallel) sorts with the norms; q/k/v's before them
    convert_checkpoint(tmp_path / "src" / "distributed", tmp_path / "hf_d", from_format="fast_llm_distributed",
                       to_format="hf")
    first, from_distributed = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "hf_d")
    assert first.keys() == from_distributed.keys() and all(torch.equal(first[k], from_distributed[k]) for k in first)
    back = Path(convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf",
                                   to_format="fast_llm").destination)
    stored = {}
    for file in back.glob("*.safetensors"):
        with safe_open(file, "pt") as opened:
            stored.update({key.removesuffix("/weights"): opened.get_tensor(key) for key in opened.keys()})
    assert stored.keys() == tensors.keys() and all(torch.equal(stored[k], tensors[k]) for k in tensors)
    written = yaml.safe_load((back / "metadata.yaml").read_text())["config"]["base_model"]["decoder"]
    qwen2 = written["blocks"][written["pattern"][0]]["mixer"]
    assert qwen2["add_linear_biases"] is False
    assert [qwen2[f"{n}_layer"]["bias"]["enabled"] for n in ("query", "key", "value", "dense")] == [True] * 3 + [False]
    assert "dense_layer" not in written["blocks"][written["pattern"][3]]["mixer"]  # agreeing: add_linear_biases only
    again = convert_checkpoint(back, tmp_path / "again", from_format="fast_llm", to_format="hf").destination
    second = _hf_tensors(Path(again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


# --------------------------------------------------------------------------------------- the other formats

_PLAIN_ATTENTION = dict(zero_centered_norms=False, attention_output_gate=False, attention_qk_norm=False,
                        rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})


def test_apriel2_writes_and_reads_per_layer_attention_biases_bit_exact(tmp_path):
    """Apriel2 builds each projection's bias from its own bias.enabled (modeling_apriel2.py, Apriel2Attention):
    Qwen2-style layers are written as Fast-LLM exports them and read back with the same tensors."""
    from model_helpers import tiny_model

    model = tiny_model(["full_attention", "gated_deltanet", "sliding_attention", "full_attention"], **_PLAIN_ATTENTION,
                       attention_bias=True, attention_output_bias=False,
                       per_layer_config={2: {"attention_output_bias": True}, 3: {"attention_bias": False}})
    model.save_pretrained(tmp_path / "ours")
    written = Path(convert_checkpoint(tmp_path / "ours", tmp_path / "apriel2", from_format="hf",
                                      to_format="apriel2").destination)
    config = json.loads((written / "config.json").read_text())
    mixers = [config["decoder"]["blocks"][name]["mixer"] for name in config["decoder"]["pattern"]]
    assert mixers[0]["add_linear_biases"] is False and mixers[0]["dense_layer"] == {"bias": {"enabled": False}}
    assert [mixers[0][f"{n}_layer"]["bias"]["enabled"] for n in ("query", "key", "value")] == [True] * 3
    assert mixers[2]["add_linear_biases"] is True and "dense_layer" not in mixers[2]
    assert mixers[3]["add_linear_biases"] is False and "query_layer" not in mixers[3]
    stored = _hf_tensors(written)
    assert "model.decoder.blocks.0.mixer.q_proj.bias" in stored
    assert "model.decoder.blocks.0.mixer.o_proj.bias" not in stored
    assert "model.decoder.blocks.2.mixer.o_proj.bias" in stored
    assert "model.decoder.blocks.3.mixer.q_proj.bias" not in stored
    back = convert_checkpoint(written, tmp_path / "back", from_format="apriel2", to_format="hf").destination
    first, second = _hf_tensors(tmp_path / "ours"), _hf_tensors(Path(back))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    layers = HybridLinearConfig.from_pretrained(back).per_layer_config
    assert [(layers[i].attention_bias, layers[i].attention_output_bias) for i in (0, 2, 3)] == [
        (True, False), (True, True), (False, False)]


def test_qwen3_next_refuses_an_output_bias_unlike_attention_bias():
    """Qwen3-Next's attention_bias switches all four projections (Qwen3NextAttention); q/k/v biases alone do not fit."""
    from hybrid_linear_models.conversion.qwen3_next.config import check_fits_qwen3_next
    from model_helpers import tiny_config

    check_fits_qwen3_next(tiny_config(["gated_deltanet", "full_attention"], attention_bias=True))  # all four: fits
    with pytest.raises(ConversionError) as caught:
        check_fits_qwen3_next(tiny_config(["gated_deltanet", "full_attention"], attention_bias=True,
                                          attention_output_bias=False))
    assert "attention_output_bias is False and attention_bias True" in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("explicit, outcome", [
    # every projection's bias.enabled given: add_linear_biases (which Fast-LLM's exporter omits when true) is moot
    ({"query": True, "key": True, "value": True, "dense": False}, (True, False)),
    # the dense layer left to the missing add_linear_biases: ambiguous, refused naming the field
    ({"query": True, "key": True, "value": True}, "decoder.block.mixer.add_linear_biases"),
    # q unlike k/v: refused naming the block and the layers
    ({"query": False, "key": True, "value": True, "dense": True},
     "decoder.block.mixer mixes linear layers with and without biases (query_layer: no bias, key_layer: bias"),
])
def test_apriel2_reads_each_projections_bias(explicit, outcome):
    from test_convert_apriel2 import BLOCKS, FLAT, apriel2_config

    from hybrid_linear_models.conversion.apriel2.config import apriel2_to_hybrid_config

    block = copy.deepcopy(BLOCKS["attn"])
    del block["mixer"]["add_linear_biases"]
    block["mixer"].update({f"{name}_layer": {"bias": {"enabled": on}} for name, on in explicit.items()})
    decoder = {"type": "fixed", "block": block, "num_blocks": 1}
    data = apriel2_config(decoder, FLAT["vocab_size"], FLAT["hidden_size"])
    if isinstance(outcome, str):
        with pytest.raises(ConversionError, match=re.escape(outcome)):
            apriel2_to_hybrid_config(data)
    else:
        config = apriel2_to_hybrid_config(data).config
        assert (config.attention_bias, config.attention_output_bias) == outcome


def test_the_value_layers_bias_setting_is_ignored_as_fast_llm_ignores_it(tmp_path):
    """Fast-LLM builds key_value from key_layer's config (value_layer is declared, never built): a value_layer bias
    setting that disagrees with key_layer's changes nothing, so it converts, its keys' and values' bias as key_layer
    says; a query/key disagreement is refused."""
    source = Path(shutil.copytree(FIXTURES / "kda_attn" / "fast_llm", tmp_path / "src"))
    metadata = yaml.safe_load((source / "metadata.yaml").read_text())
    mixer = metadata["config"]["base_model"]["decoder"]["blocks"]["attn"]["mixer"]
    mixer.update(add_linear_biases=False, value_layer={"bias": {"enabled": True}})
    (source / "metadata.yaml").write_text(yaml.safe_dump(metadata))
    converted = convert_checkpoint(source, tmp_path / "hf", from_format="fast_llm", to_format="hf").destination
    assert HybridLinearForCausalLM.from_pretrained(converted).config.attention_bias is False
    mixer.update(key_layer={"bias": {"enabled": True}})
    (source / "metadata.yaml").write_text(yaml.safe_dump(metadata))
    with pytest.raises(ConversionError, match=r"gives its query and key layers different biases \(query_layer: "
                                              r"no bias, key_layer: bias; Fast-LLM's key_value follows key_layer\)"):
        convert_checkpoint(source, tmp_path / "refused", from_format="fast_llm", to_format="hf")
