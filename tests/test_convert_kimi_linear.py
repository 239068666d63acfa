"""The kimi_linear format: folders of transformers' own KimiLinearForCausalLM (random tiny models, saved by
transformers, or laid out as the released checkpoints are) convert to our format with transformers' logits, back bit
for bit, and our models that fit Kimi-Linear convert to folders transformers loads with our logits; those that do not
fit are refused by the first layer or setting.

Tolerance: logits within 1e-4 (float32, logits of order 1). Both models compute the same math in float32 through
different kernels (transformers' reference chunked KDA and eager attention vs our chunked kernel and sdpa), so they
differ only by summation order: ~1e-7 per op, a few ops deep in 3-4 layers (measured: below 1e-5). A mapping mistake
(A_log reshaped across heads, q/k/v convolutions swapped, gate and up swapped, a norm taken as 1 + w) moves logits by
1e-2 or more.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_helpers import randomize, tiny_config, tiny_model
from safetensors.torch import save_file
from test_convert_qwen3_next import tensors_of
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.formats import FORMATS
from hybrid_linear_models.conversion.kimi_linear.checkpoint import kimi_linear_rows
from hybrid_linear_models.conversion.kimi_linear.config import IRRELEVANT, KIMI_DEFAULTS, kimi_to_hybrid_config
from hybrid_linear_models.conversion.kimi_linear.parameters import HeadsInDim2

LOGITS_TOLERANCE = 1e-4  # see the module docstring
VOCAB = 64


def tiny_kimi_config(kda_heads: int = 2, kda_head_dim: int = 8, kernel: int = 4, layers: int = 3,
                     full_attn_layers: tuple[int, ...] = (), **overrides) -> KimiLinearConfig:
    """A tiny KimiLinearConfig in the hub's terms (1-indexed layer lists, first_k_dense_replace)."""
    kda = [n for n in range(1, layers + 1) if n not in full_attn_layers]
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                    linear_attn_config={"kda_layers": kda, "full_attn_layers": list(full_attn_layers),
                                        "num_heads": kda_heads, "head_dim": kda_head_dim,
                                        "short_conv_kernel_size": kernel},
                    first_k_dense_replace=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    settings.update(overrides)
    return KimiLinearConfig(**settings)


def save_kimi(folder: Path, seed: int = 0, **overrides) -> KimiLinearForCausalLM:
    """A tiny KimiLinearForCausalLM with random weights everywhere (norms and A_log included), saved by transformers."""
    torch.manual_seed(seed)
    model = randomize(KimiLinearForCausalLM(tiny_kimi_config(**overrides)), seed).eval()
    model.save_pretrained(folder)
    return model


def as_hub_layout(folder: Path) -> None:
    """Rewrites a folder transformers saved into the released checkpoints' layout: transformers' save_pretrained
    reverts its block_sparse_moe -> mlp renaming on every layer, dense ones included, where the hub keeps dense
    layers' MLPs under mlp."""
    tensors = {}
    for key, (dtype, shape, data) in tensors_of(folder).items():
        tensor = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.empty(shape,
                                                                                                         dtype=dtype)
        name = key
        for part in ("gate_proj", "up_proj", "down_proj"):
            name = name.replace(f"block_sparse_moe.{part}.", f"mlp.{part}.")
        tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def assert_same_logits(theirs: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Logits within LOGITS_TOLERANCE over a batch without padding (transformers' KimiLinear cannot build its cache
    for a model without attention layers, hence use_cache=False)."""
    tokens = torch.randint(1, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = theirs(tokens, use_cache=False).logits, ours(tokens, use_cache=False).logits
    difference = (expected - got).abs().max().item()
    assert difference <= LOGITS_TOLERANCE, difference
    assert expected.abs().max() > 0.1  # logits of a real size: the comparison means something


# --------------------------------------------------------------------------------------------- kimi_linear -> hf

KDA_CASES = {
    "2_heads_of_8": dict(),
    "1_head_of_16_kernel_3": dict(kda_heads=1, kda_head_dim=16, kernel=3, rms_norm_eps=1e-6),
    "4_heads_of_4": dict(kda_heads=4, kda_head_dim=4, layers=2),
}


@pytest.mark.parametrize("case", sorted(KDA_CASES))
def test_kda_kimi_linear_converts_with_transformers_logits(tmp_path, case):
    theirs = save_kimi(tmp_path / "kimi", **KDA_CASES[case])
    convert_checkpoint(tmp_path / "kimi", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert ours.config.kda_gate_activation == "sigmoid" and not ours.config.zero_centered_norms
    assert_same_norm_epsilons(theirs, ours)
    assert_same_logits(theirs, ours.eval())


def test_hub_layout_round_trip_is_bit_identical(tmp_path):
    """kimi_linear (hub layout) -> hf -> kimi_linear: the same tensors byte for byte, names and A_log's (1, 1, H, 1)
    included, and a config transformers reads as the source's."""
    theirs = save_kimi(tmp_path / "source")
    as_hub_layout(tmp_path / "source")
    source = tensors_of(tmp_path / "source")
    assert source["model.layers.0.self_attn.A_log"][1] == (1, 1, 2, 1) and "model.layers.0.mlp.up_proj.weight" in source
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="kimi_linear")
    assert tensors_of(tmp_path / "back") == source
    again, info = KimiLinearForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    assert again.config.layer_types == theirs.config.layer_types
    assert again.config.mlp_layer_types == theirs.config.mlp_layer_types
    assert (again.config.linear_num_heads, again.config.linear_head_dim) == (2, 8)
    assert_same_logits(theirs, again.eval())


def test_saved_and_fused_layouts_read_the_same(tmp_path):
    """transformers' save_pretrained folder (dense MLPs under block_sparse_moe), the hub layout and the in-memory
    layout (save_original_format=False: one fused conv1d, forget_gate.*) convert to the same tensors."""
    theirs = save_kimi(tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "hub")
    as_hub_layout(tmp_path / "hub")
    theirs.save_pretrained(tmp_path / "fused", save_original_format=False)
    fused = tensors_of(tmp_path / "fused")
    assert "model.layers.0.self_attn.conv1d.weight" in fused and "model.layers.0.self_attn.forget_gate.A_log" in fused
    converted = {}
    for source in ("saved", "hub", "fused"):
        convert_checkpoint(tmp_path / source, tmp_path / f"{source}-hf", from_format="kimi_linear", to_format="hf")
        converted[source] = tensors_of(tmp_path / f"{source}-hf")
    assert converted["saved"] == converted["hub"] == converted["fused"]


def test_sharded_source_and_output(tmp_path):
    theirs = save_kimi(tmp_path / "saved")
    theirs.save_pretrained(tmp_path / "source", max_shard_size="20KB")
    assert (tmp_path / "source" / "model.safetensors.index.json").is_file()
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="kimi_linear",
                       max_shard_size="30KB")
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    as_hub_layout(tmp_path / "saved")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "saved")  # the same model, bit for bit


def test_released_dtypes_survive_the_round_trip(tmp_path):
    """The released checkpoints are bfloat16 with float32 A_log and dt_bias: every tensor keeps its own dtype and
    bytes through hf and back."""
    save_kimi(tmp_path / "source")
    as_hub_layout(tmp_path / "source")
    tensors = {}
    for key, (dtype, shape, data) in tensors_of(tmp_path / "source").items():
        tensor = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
        tensors[key] = tensor if key.endswith(("A_log", "dt_bias")) else tensor.to(torch.bfloat16)
    save_file(tensors, tmp_path / "source" / "model.safetensors", metadata={"format": "pt"})
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    assert tensors_of(tmp_path / "hf")["model.layers.0.linear_attn.A_log"][0] == torch.float32
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="kimi_linear")
    back = tensors_of(tmp_path / "back")
    assert back == tensors_of(tmp_path / "source")
    assert back["model.layers.0.self_attn.q_proj.weight"][0] == torch.bfloat16


def test_defaults_are_transformers_own():
    """An absent field means what it means to transformers' KimiLinearConfig."""
    defaults = KimiLinearConfig(pad_token_id=None, bos_token_id=None, eos_token_id=None).to_dict()
    assert {name: defaults[name] for name in KIMI_DEFAULTS} == KIMI_DEFAULTS
    config = kimi_to_hybrid_config({"model_type": "kimi_linear", "num_hidden_layers": 2, "first_k_dense_replace": 2,
                                    "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": []}},
                                   "config.json")
    assert config.mixer_types == ["kimi_delta_attention"] * 2 and config.mlp_types == ["dense"] * 2
    assert (config.kda_num_heads, config.kda_head_dim, config.rms_norm_eps, config.kda_norm_eps) == (32, 128, 1e-5,
                                                                                                    1e-5)
    assert set(IRRELEVANT) >= {"architectures", "transformers_version", "dtype", "auto_map"}


def test_a_log_reshape():
    converter = HeadsInDim2()
    stored = torch.arange(3.0).reshape(1, 1, 3, 1)
    (ours,) = converter.forward([stored])
    assert ours.shape == (3,) and torch.equal(converter.inverse([ours])[0], stored)
    assert converter.forward_shapes([(1, 1, 3, 1)]) == [(3,)] and converter.inverse_shapes([(3,)]) == [(1, 1, 3, 1)]
    with pytest.raises(ValueError, match="not \\(1, 1, heads, 1\\)"):
        converter.forward_shapes([(1, 3, 1, 1)])


# --------------------------------------------------------------------------------------------- hf -> kimi_linear


def test_our_kda_model_converts_to_transformers_kimi_linear(tmp_path):
    """hf -> kimi_linear -> hf: bit for bit; transformers loads the Kimi folder (hub layout) with our logits."""
    ours = tiny_model(["kimi_delta_attention"] * 3, hidden_size=32, kda_num_heads=2, kda_head_dim=8,
                      vocab_size=VOCAB, rms_norm_eps=1e-5, zero_centered_norms=False)
    ours.save_pretrained(tmp_path / "ours")
    convert_checkpoint(tmp_path / "ours", tmp_path / "kimi", from_format="hf", to_format="kimi_linear")
    assert sorted(p.name for p in (tmp_path / "kimi").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    written = tensors_of(tmp_path / "kimi")
    assert written["model.layers.1.self_attn.A_log"][1] == (1, 1, 2, 1)
    assert "model.layers.1.self_attn.q_conv1d.weight" in written and "model.layers.1.mlp.gate_proj.weight" in written
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    assert config["linear_attn_config"]["kda_layers"] == [1, 2, 3] and config["first_k_dense_replace"] == 3
    theirs, info = KimiLinearForCausalLM.from_pretrained(tmp_path / "kimi", output_loading_info=True)
    assert not any(info.values()), info
    assert_same_logits(theirs.eval(), ours)
    convert_checkpoint(tmp_path / "kimi", tmp_path / "back", from_format="kimi_linear", to_format="hf")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "ours")


KDA_ONLY = ["kimi_delta_attention", "kimi_delta_attention"]
FITS = dict(zero_centered_norms=False)


@pytest.mark.parametrize("layer_types, overrides, fragments", [
    (["kimi_delta_attention", "gated_deltanet"], FITS, ("layer 1 is 'gated_deltanet'",)),
    (["sliding_attention", "kimi_delta_attention"], FITS, ("layer 0 is 'sliding_attention'",)),
    (["kimi_delta_attention", "full_attention"], FITS, ("layer 1 is 'full_attention'",)),
    (KDA_ONLY, {}, ("zero_centered_norms is True",)),
    (KDA_ONLY, {**FITS, "kda_gate_activation": "silu"}, ("kda_gate_activation is 'silu'",)),
    (KDA_ONLY, {**FITS, "kda_gate_bias": True}, ("kda_gate_bias is True",)),
    (KDA_ONLY, {**FITS, "kda_norm_eps": 1e-3}, ("kda_norm_eps (0.001) differs",)),
    (KDA_ONLY, {**FITS, "hidden_act": "gelu"}, ("hidden_act is 'gelu'",)),
    (KDA_ONLY, {**FITS, "mlp_bias": True}, ("mlp_bias is True",)),
    (KDA_ONLY, {**FITS, "tie_word_embeddings": True}, ("tie_word_embeddings is True", "random lm_head")),
    (KDA_ONLY, {**FITS, "per_layer_config": {1: {"kda_num_heads": 4}}}, ("layer 1 has its own kda_num_heads",)),
    (KDA_ONLY, {**FITS, "mlp_types": ["dense", "sparse_moe"], "num_experts": 2, "num_experts_per_tok": 1,
                "moe_intermediate_size": 8}, ("layer 1's MLP is 'sparse_moe'",)),
])
def test_models_that_do_not_fit_are_refused_by_name(layer_types, overrides, fragments):
    with pytest.raises(ConversionError) as caught:
        kimi_linear_rows(tiny_config(layer_types, **overrides))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("this model does not fit Kimi-Linear: ")
    assert all(fragment in message for fragment in fragments), message
    assert "convert it to the hf format instead" in message


def test_refusal_comes_before_any_output(tmp_path):
    tiny_model(["kimi_delta_attention", "gated_deltanet"]).save_pretrained(tmp_path / "ours")
    with pytest.raises(ConversionError, match="layer 1 is 'gated_deltanet'"):
        convert_checkpoint(tmp_path / "ours", tmp_path / "out", from_format="hf", to_format="kimi_linear")
    assert not (tmp_path / "out").exists()


def test_catalogue_entry():
    fmt = FORMATS["kimi_linear"]
    assert fmt.can_read and fmt.can_write and not fmt.keeps_extra_tensors
    assert fmt.output.marker_fields == {"model_type": "kimi_linear"} and fmt.output.writes("model.safetensors")
    assert fmt.model_types == ("kimi_linear",)


# --------------------------------------------------------------------------------------------- MLA layers


MLA = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8)
MLA_CASES = {
    # KDA, MLA, KDA, MLA: 2 heads, a plain q_proj
    "q_proj_2_heads": dict(layers=4, full_attn_layers=(2, 4), **MLA),
    # q LoRA (q_a_proj / q_a_layernorm / q_b_proj), 4 heads, v_head_dim unlike qk_nope_head_dim, MLA first,
    # biases on q_a_proj, kv_a_proj_with_mqa and o_proj (attention_bias)
    "q_lora_4_heads": dict(layers=3, full_attn_layers=(1,), attention_bias=True,
                           **{**MLA, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 12,
                              "v_head_dim": 4}),
    # 1 head, no rope part (qk_rope_head_dim 0), 3 KDA heads
    "1_head_no_rope": dict(layers=3, full_attn_layers=(3,), kda_heads=3,
                           **{**MLA, "num_attention_heads": 1, "num_key_value_heads": 1, "qk_rope_head_dim": 0}),
}


def assert_same_generation(theirs: torch.nn.Module, ours: torch.nn.Module, new_tokens: int = 20) -> None:
    """Greedy cached generation of both models, token for token (a batch of 2 prompts without padding)."""
    tokens = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(tokens))
    with torch.no_grad():
        expected, got = theirs.generate(tokens, **greedy), ours.generate(tokens, **greedy)
    assert expected.shape == (2, 7 + new_tokens)
    assert torch.equal(expected, got), (expected, got)


def assert_same_norm_epsilons(theirs: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Every RMSNorm's epsilon is transformers' (the block norms, KDA's gated norm, MLA's latent norms): an epsilon
    moves tiny models' logits by ~1e-6 only, below the logits tolerance, so it is compared directly."""
    compared = 0
    for index, (their_layer, our_layer) in enumerate(zip(theirs.model.layers, ours.model.layers)):
        mixer = our_layer.self_attn if hasattr(our_layer, "self_attn") else our_layer.linear_attn
        pairs = [(their_layer.input_layernorm, our_layer.input_layernorm),
                 (their_layer.post_attention_layernorm, our_layer.post_attention_layernorm)]
        pairs += [(getattr(their_layer.self_attn, name), getattr(mixer, name))
                  for name in ("o_norm", "q_a_layernorm", "kv_a_layernorm")
                  if getattr(their_layer.self_attn, name, None) is not None]
        for their_norm, our_norm in pairs:
            assert their_norm.variance_epsilon == our_norm.eps, (index, their_norm, our_norm.eps)
            compared += 1
    assert theirs.model.norm.variance_epsilon == ours.model.norm.eps
    assert compared >= 3 * len(ours.model.layers)


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_kimi_linear_converts_with_transformers_logits_and_generation(tmp_path, case):
    theirs = save_kimi(tmp_path / "kimi", **MLA_CASES[case])
    convert_checkpoint(tmp_path / "kimi", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert "mla_attention" in ours.config.mixer_types
    assert_same_norm_epsilons(theirs, ours)
    assert_same_logits(theirs, ours.eval())
    assert_same_generation(theirs, ours)


def test_mla_round_trips_are_bit_identical(tmp_path):
    """kimi_linear (hub layout) -> hf -> kimi_linear and hf -> kimi_linear -> hf, byte for byte; transformers loads
    the written folder with the source's logits and generation."""
    theirs = save_kimi(tmp_path / "source", **MLA_CASES["q_lora_4_heads"])
    as_hub_layout(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="kimi_linear")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "source")
    convert_checkpoint(tmp_path / "back", tmp_path / "hf2", from_format="kimi_linear", to_format="hf")
    assert tensors_of(tmp_path / "hf2") == tensors_of(tmp_path / "hf")
    again, info = KimiLinearForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    assert again.config.q_lora_rank == 12 and again.config.layer_types == theirs.config.layer_types
    assert_same_logits(theirs, again.eval())
    assert_same_generation(theirs, again)


# --------------------------------------------------------------------------------------------- Kimi's MoE

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1)
MOE_CASES = {
    # dense layer 0, then MoE; KDA and MLA; 2 groups of 2 experts, 1 group kept; renormalised top-2, scaled
    "grouped": dict(layers=3, full_attn_layers=(2,), **MLA, **MOE, n_group=2, topk_group=1,
                    routed_scaling_factor=2.5),
    # one group, top-2 of 4 not renormalised, 2 shared experts
    "not_renormalised": dict(layers=3, full_attn_layers=(3,), **MLA, **MOE, norm_topk_prob=False,
                             n_shared_experts=2, routed_scaling_factor=1.0),
}


def save_kimi_moe(folder: Path, **overrides) -> KimiLinearForCausalLM:
    """save_kimi with random router correction biases too (a buffer, which `randomize` leaves at zero)."""
    theirs = save_kimi(folder, **overrides)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buffer in theirs.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    shutil.rmtree(folder)
    theirs.save_pretrained(folder)
    return theirs


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_kimi_linear_converts_with_transformers_logits_and_generation(tmp_path, case):
    theirs = save_kimi_moe(tmp_path / "kimi", **MOE_CASES[case])
    stored = tensors_of(tmp_path / "kimi")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in stored  # the hub's per-expert layout
    convert_checkpoint(tmp_path / "kimi", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert ours.config.mlp_types == ["dense", "kimi_moe", "kimi_moe"]
    assert_same_norm_epsilons(theirs, ours)
    assert_same_logits(theirs, ours.eval())
    assert_same_generation(theirs, ours)
    as_hub_layout(tmp_path / "kimi")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="kimi_linear")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "kimi")  # per expert again, bit for bit
    convert_checkpoint(tmp_path / "back", tmp_path / "hf2", from_format="kimi_linear", to_format="hf")
    assert tensors_of(tmp_path / "hf2") == tensors_of(tmp_path / "hf")


def released_config(theirs: KimiLinearConfig) -> dict:
    """config.json with exactly the fields of the released Kimi-Linear-48B-A3B-Instruct's (their hub names, the
    original remote code's auto_map, its vestigial head_dim and rope fields), sized as `theirs`."""
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "first_k_dense_replace": 1, "head_dim": 72,
        "hidden_act": "silu", "hidden_size": theirs.hidden_size, "initializer_range": 0.02,
        "intermediate_size": theirs.intermediate_size, "kv_lora_rank": theirs.kv_lora_rank,
        "linear_attn_config": {"full_attn_layers": [i + 1 for i, t in enumerate(theirs.layer_types)
                                                    if t == "full_attention"],
                               "kda_layers": [i + 1 for i, t in enumerate(theirs.layer_types)
                                              if t == "linear_attention"],
                               "head_dim": theirs.linear_head_dim, "num_heads": theirs.linear_num_heads,
                               "short_conv_kernel_size": theirs.linear_conv_kernel_dim},
        "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": theirs.moe_intermediate_size,
        "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "num_attention_heads": theirs.num_attention_heads, "num_expert_group": theirs.n_group,
        "num_experts": theirs.num_local_experts, "num_experts_per_token": theirs.num_experts_per_tok,
        "num_hidden_layers": theirs.num_hidden_layers, "num_key_value_heads": theirs.num_attention_heads,
        "num_nextn_predict_layers": 0, "num_shared_experts": theirs.n_shared_experts, "q_lora_rank": None,
        "qk_nope_head_dim": theirs.qk_nope_head_dim, "qk_rope_head_dim": theirs.qk_rope_head_dim,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "routed_scaling_factor": theirs.routed_scaling_factor, "tie_word_embeddings": False,
        "topk_group": theirs.topk_group, "transformers_version": "4.57.1", "use_cache": True,
        "use_grouped_topk": True, "v_head_dim": theirs.v_head_dim, "vocab_size": theirs.vocab_size,
    }


def test_released_checkpoint_layout_converts_with_transformers_logits(tmp_path):
    """A folder laid out as the released checkpoints are (hub tensor names, the released config.json's field set)
    converts with the logits and generation of transformers' model, and back to the same bytes."""
    theirs = save_kimi_moe(tmp_path / "released", **MOE_CASES["grouped"])
    as_hub_layout(tmp_path / "released")
    (tmp_path / "released" / "config.json").write_text(json.dumps(released_config(theirs.config)))
    convert_checkpoint(tmp_path / "released", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    ours = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert ours.config.mixer_types == ["kimi_delta_attention", "mla_attention", "kimi_delta_attention"]
    assert_same_logits(theirs, ours)
    assert_same_generation(theirs, ours)
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="kimi_linear")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "released")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    released = released_config(theirs.config)
    bookkeeping = {"auto_map", "head_dim", "rope_scaling", "rope_theta", "transformers_version"}
    assert {k: v for k, v in written.items() if k not in bookkeeping} == {
        k: v for k, v in released.items() if k not in bookkeeping | {"output_router_logits"}} | {
        "output_router_logits": False, "attention_bias": False, "attention_dropout": 0.0}


def test_moe_with_kda_layers_only_converts_and_round_trips(tmp_path):
    """Kimi's MoE without MLA layers (logits only: transformers cannot cache a model without attention layers)."""
    theirs = save_kimi_moe(tmp_path / "kimi", layers=3, **MOE, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    convert_checkpoint(tmp_path / "kimi", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert ours.config.mlp_types == ["dense", "kimi_moe", "kimi_moe"] and ours.config.n_group == 2
    assert_same_logits(theirs, ours.eval())
    as_hub_layout(tmp_path / "kimi")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="kimi_linear")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "kimi")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["first_k_dense_replace"], config["num_expert_group"], config["num_experts_per_token"]) == (1, 2, 2)


def test_moe_fused_layout_reads_the_same(tmp_path):
    theirs = save_kimi_moe(tmp_path / "saved", **MOE_CASES["grouped"])
    theirs.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors_of(tmp_path / "fused")
    for source in ("saved", "fused"):
        convert_checkpoint(tmp_path / source, tmp_path / f"{source}-hf", from_format="kimi_linear", to_format="hf")
    assert tensors_of(tmp_path / "saved-hf") == tensors_of(tmp_path / "fused-hf")


def test_dense_layer_after_moe_does_not_fit():
    config = tiny_config(KDA_ONLY + ["kimi_delta_attention"], zero_centered_norms=False,
                         mlp_types=["kimi_moe", "dense", "kimi_moe"], num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8)
    with pytest.raises(ConversionError, match="layer 1 has a dense MLP after MoE layers"):
        kimi_linear_rows(config)


@pytest.mark.parametrize("overrides, fragments", [
    ({"mla_use_nope": False}, ("mla_use_nope is False",)),
    ({"mla_norm_eps": 1e-5}, ("mla_norm_eps is 1e-05", "1e-06")),
    ({"per_layer_config": {1: {"kv_lora_rank": 4}}}, ("layer 1 has its own kv_lora_rank",)),
])
def test_mla_models_that_do_not_fit_are_refused_by_name(overrides, fragments):
    config = tiny_config(["kimi_delta_attention", "mla_attention"], zero_centered_norms=False, kv_lora_rank=8,
                         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **overrides)
    with pytest.raises(ConversionError) as caught:
        kimi_linear_rows(config)
    message = str(caught.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_moe_without_shared_experts_does_not_fit():
    config = tiny_config(KDA_ONLY, zero_centered_norms=False, mlp_types=["dense", "kimi_moe"], num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=0)
    with pytest.raises(ConversionError, match=r"no shared experts \(n_shared_experts 0\)"):
        kimi_linear_rows(config)


def _float32_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors (parameters, persistent buffers) a model holds in float32, by kind (the name's last part,
    'gate.weight' for a router's weight): each kind's values flattened and sorted, so layouts that shape or name them
    differently compare."""
    kinds: dict[str, list[torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        if tensor.dtype == torch.float32:
            parts = name.split(".")
            kind = ".".join(parts[-2:]) if parts[-1] == "weight" else parts[-1]
            kinds.setdefault(kind, []).append(tensor.flatten())
    return {kind: torch.cat(values).sort().values for kind, values in kinds.items()}


def test_bfloat16_loading_keeps_float32_what_transformers_keeps_float32(tmp_path):
    """from_pretrained(dtype=torch.bfloat16) of a converted float32 Kimi-Linear checkpoint (KDA, MLA, MoE): ours holds
    in float32 the tensors transformers' KimiLinearForCausalLM holds in float32 (its _keep_in_fp32_modules_strict: the
    routers' weights and correction biases, dt_bias) and A_log, which transformers rounds to bf16 though the released
    checkpoints store it in float32 (ours keeps what the file holds); each with the stored values bit for bit, all else
    bf16. A dt_bias rounded to bf16 changes every token's decay: this fails on it."""
    from safetensors.torch import load_file

    save_kimi_moe(tmp_path / "kimi", **MOE_CASES["grouped"])
    convert_checkpoint(tmp_path / "kimi", tmp_path / "hf", from_format="kimi_linear", to_format="hf")
    theirs = KimiLinearForCausalLM.from_pretrained(tmp_path / "kimi", dtype=torch.bfloat16)
    ours = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    expected = _float32_values(theirs)
    assert {"dt_bias", "gate.weight", "e_score_correction_bias"} <= set(expected) and "A_log" not in expected
    stored = load_file(tmp_path / "kimi" / "model.safetensors")
    expected["A_log"] = torch.cat([t.flatten() for n, t in stored.items() if n.endswith("A_log")]).sort().values
    got = _float32_values(ours)
    assert set(got) == set(expected)
    for kind, values in expected.items():
        assert torch.equal(got[kind], values), kind
    assert {t.dtype for t in ours.state_dict().values()} == {torch.float32, torch.bfloat16}
