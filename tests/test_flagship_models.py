"""benchmarks/flagship_models.py: the flagship builders give the released layouts (checked on the meta device at full
size against the released config fields, and built on the CPU in miniature), the FP8 quantization is exact to e4m3
rounding, the memory printed before allocating is what the built model holds, and ours and transformers' models
built from the same fields give the same logits.

Tolerances:
- e4m3 keeps 3 mantissa bits, so rounding a normal value v to nearest moves it by at most half a unit in its last
  place, 2^-4 * 2^floor(log2 |v|) <= 2^-4 |v|; below e4m3's smallest normal (2^-6) the spacing is the subnormal
  step 2^-9, so at most 2^-10. In real units (times the block's float32 scale s): |W - W_fp8 * s| <= 2^-4 |W| +
  2^-10 s. The division W / s in float32 adds a relative 2^-24 before the rounding (a factor 1 + 2^-20 on the bound
  covers it with room); the dequantization is exact (float64).
- logits, ours vs transformers' in float32 on the CPU: the same math in another summation order, ~1e-6 on logits of
  size ~1 after 8 layers (measured 4e-7 and 9e-7); LOGITS_TOLERANCE 1e-5 leaves room for other CPUs, while a weight
  under a wrong name or a wrong layout moves logits by 1e-2 or more.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from flagship_models import (
    FP8_BLOCK,
    KIMI_LINEAR_48B,
    QWEN3_NEXT_80B,
    build_ours,
    build_theirs,
    check_fits,
    kimi_linear_fields,
    model_bytes,
    ours_on_meta,
    qwen3_next_fields,
    theirs_on_meta,
)

from hybrid_linear_models.fp8_layers import Fp8Experts, Fp8Linear
from hybrid_linear_models.kernels_fp8 import dequantize_block_fp8, quantize_block_fp8

CPU = torch.device("cpu")
LOGITS_TOLERANCE = 1e-5
# the released FP8 build's quantized modules of one layer, by kind (everything else stays bfloat16)
QWEN_FP8_MODULES = {
    "gated_deltanet": {"linear_attn.in_proj_qkvz", "linear_attn.out_proj"},
    "full_attention": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"},
}
QWEN_FP8_MLP = {"mlp.experts", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                "mlp.shared_expert.down_proj"}


def fp8_modules(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear | Fp8Experts)}


def released_qwen_types(count: int) -> list[str]:
    return [{"linear_attention": "gated_deltanet"}.get(t, t) for t in QWEN3_NEXT_80B["layer_types"][:count]]


@pytest.mark.parametrize("fp8", [True, False])
def test_full_qwen3_next_has_the_released_layout(fp8):
    model = ours_on_meta(qwen3_next_fields(fp8=fp8))
    config = model.config
    assert config.mixer_types == released_qwen_types(48)
    assert [i + 1 for i, t in enumerate(config.mixer_types) if t == "full_attention"] == list(range(4, 49, 4))
    assert set(config.mlp_types) == {"sparse_moe"}
    layer = model.model.layers[0]
    assert layer.mlp.experts.num_experts == 512 and config.num_experts_per_tok == 10
    assert layer.mlp.shared_expert.down_proj.in_features == 512 and layer.mlp.shared_expert_gate.out_features == 1
    attention = model.model.layers[3].self_attn
    assert attention.q_proj.out_features == 2 * 16 * 256  # queries and their output gate
    assert attention.k_proj.out_features == 2 * 256
    assert model.lm_head.out_features == 151936
    parameters = sum(p.numel() for p in model.parameters())
    assert 79.5e9 < parameters < 80e9  # "80B": 79.67B without the multi-token-prediction head
    if not fp8:
        assert not fp8_modules(model)
        return
    expected = {f"model.layers.{i}.{name}" for i, t in enumerate(config.mixer_types)
                for name in QWEN_FP8_MODULES[t] | QWEN_FP8_MLP}
    found = fp8_modules(model)
    assert set(found) == expected  # lm_head, routers, shared-expert gates, in_proj_ba: not FP8
    for name, module in found.items():
        weights = ["weight"] if isinstance(module, Fp8Linear) else ["gate_up_proj", "down_proj"]
        for weight in weights:
            w, scale = getattr(module, weight), getattr(module, weight + "_scale_inv")
            assert w.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, name
            grid = (math.ceil(w.shape[-2] / 128), math.ceil(w.shape[-1] / 128))
            assert tuple(scale.shape) == (*w.shape[:-2], *grid), name
    experts = found["model.layers.0.mlp.experts"]
    assert tuple(experts.gate_up_proj_scale_inv.shape) == (512, 8, 16)  # (2 x 512 / 128, 2048 / 128)
    assert tuple(experts.down_proj_scale_inv.shape) == (512, 16, 4)
    kept = {n: p.dtype for n, p in model.named_parameters()
            if p.dtype != torch.float8_e4m3fn and not n.endswith("_scale_inv")}
    # bfloat16, except GDN's decay parameters, which this model holds in float32 (as it runs them)
    assert {n for n, dtype in kept.items() if dtype != torch.bfloat16} == {
        n for n in kept if n.endswith(("A_log", "dt_bias"))}
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
                 "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.conv1d.weight"):
        assert name in kept, name


def test_full_kimi_linear_has_the_released_layout():
    model = ours_on_meta(kimi_linear_fields())
    config = model.config
    mla = KIMI_LINEAR_48B["linear_attn_config"]["full_attn_layers"]
    assert config.mixer_types == ["mla_attention" if i + 1 in mla else "kimi_delta_attention" for i in range(27)]
    assert config.mlp_types == ["dense"] + ["kimi_moe"] * 26  # first_k_dense_replace 1
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 8, 1024)
    assert (config.kda_num_heads, config.kda_head_dim, config.kv_lora_rank) == (32, 128, 512)
    assert model.lm_head.out_features == 163840 and config.hidden_size == 2304
    # the released index's metadata.total_parameters: every parameter plus the routers' e_score_correction_bias
    # (a buffer here and in transformers' class, 256 per MoE layer)
    stored = [t for name, t in model.named_buffers() if "inv_freq" not in name]
    assert sum(p.numel() for p in [*model.parameters(), *stored]) == 49_122_681_728
    assert sum(p.numel() for p in theirs_on_meta(kimi_linear_fields()).parameters()) == sum(
        p.numel() for p in model.parameters())


def test_layer_reduced_models_keep_the_released_pattern():
    assert ours_on_meta(qwen3_next_fields(layers=24)).config.mixer_types == released_qwen_types(24)
    assert theirs_on_meta(qwen3_next_fields(layers=24)).config.num_hidden_layers == 24
    kimi = ours_on_meta(kimi_linear_fields(layers=9)).config.mixer_types
    assert [i + 1 for i, t in enumerate(kimi) if t == "mla_attention"] == [4, 8]
    with pytest.raises(SystemExit, match=r"49 layers asked: the model has 48 layers; ask for 1 to 48"):
        qwen3_next_fields(layers=49)


@pytest.fixture(scope="module")
def tiny_qwen():
    fields = qwen3_next_fields(tiny=True)
    return build_ours(fields, CPU, torch.float32), build_theirs(fields, CPU, torch.float32)


@pytest.fixture(scope="module")
def tiny_qwen_fp8():
    return build_ours(qwen3_next_fields(tiny=True, fp8=True), CPU, torch.float32)


def test_tiny_qwen3_next_fp8_has_the_released_module_set(tiny_qwen_fp8):
    config = tiny_qwen_fp8.config
    assert config.mixer_types == released_qwen_types(8)
    expected = {f"model.layers.{i}.{name}" for i, t in enumerate(config.mixer_types)
                for name in QWEN_FP8_MODULES[t] | QWEN_FP8_MLP}
    found = fp8_modules(tiny_qwen_fp8)
    assert set(found) == expected
    experts = found["model.layers.0.mlp.experts"]
    assert tuple(experts.gate_up_proj_scale_inv.shape) == (16, 4, 4)  # 2 x 32 rows, 64 columns in 16 x 16 blocks


def test_fp8_weights_are_the_bf16_draws_quantized(tiny_qwen, tiny_qwen_fp8):
    """Each FP8 weight, dequantized, is transformers' model's weight of that name within e4m3 rounding (the draws
    are by name: a quantized weight under a wrong name or block layout is off by its whole size)."""
    theirs = dict(tiny_qwen[1].named_parameters())
    for name, module in fp8_modules(tiny_qwen_fp8).items():
        for weight in (["weight"] if isinstance(module, Fp8Linear) else ["gate_up_proj", "down_proj"]):
            full = f"{name}.{weight}"
            real = dequantize_block_fp8(getattr(module, weight), getattr(module, weight + "_scale_inv"), module.block,
                                        torch.float64)
            # transformers' float32 model holds the float32 draws; the FP8 path quantizes them rounded to bfloat16
            drawn = theirs[full].to(torch.bfloat16).double()
            assert_within_e4m3_rounding(drawn, real, getattr(module, weight + "_scale_inv"), module.block)


def assert_within_e4m3_rounding(weight: torch.Tensor, real: torch.Tensor, scale: torch.Tensor,
                                block: tuple[int, int]) -> None:
    rows, cols = weight.shape[-2:]
    full_scale = scale.double().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
    bound = 2.0**-4 * weight.abs() * (1 + 2.0**-20) + 2.0**-10 * full_scale[..., :cols]
    excess = ((weight - real).abs() - bound).max().item()
    assert excess <= 0, f"off by {excess:.3g} beyond e4m3 rounding"


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 70, 50)])
def test_quantize_round_trip_is_exact_to_e4m3_rounding(shape):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator, dtype=torch.float64)
    # blocks of very different sizes (rows of blocks 1e-3 .. 1e2), so a block mixed up with another shows
    magnitude = torch.logspace(-3, 2, shape[-2], dtype=torch.float64)[:, None]
    weight = (weight * magnitude).to(torch.bfloat16).double()
    block = FP8_BLOCK if shape[-1] > 128 else (16, 32)
    fp8, scale = quantize_block_fp8(weight, block)
    grid = (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    assert fp8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == (*shape[:-2], *grid)
    real = dequantize_block_fp8(fp8, scale, block, torch.float64)
    assert_within_e4m3_rounding(weight, real, scale, block)
    # each block's largest magnitude lands on e4m3's largest value, 448
    assert fp8.float().abs().amax() == 448


def test_power_of_two_scales_make_every_real_weight_exact_in_bfloat16():
    """`power_of_two`: each scale is the power of two at or above amax / 448, so an e4m3 value (4 significant bits)
    times it is exact in bfloat16 (8 significant bits), and the values stay within e4m3's rounding of the weight."""
    generator = torch.Generator().manual_seed(2)
    magnitude = torch.logspace(-3, 2, 70, dtype=torch.float64)[:, None]  # (rows of blocks 1e-3 .. 1e2)
    weight = torch.randn(70, 90, generator=generator, dtype=torch.float64) * magnitude
    fp8, scale = quantize_block_fp8(weight, (16, 32), power_of_two=True)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    plain_scale = quantize_block_fp8(weight, (16, 32))[1]
    assert (scale >= plain_scale).all() and (scale < 2 * plain_scale).all()
    real = dequantize_block_fp8(fp8, scale, (16, 32), torch.float64)
    assert torch.equal(real.to(torch.bfloat16).double(), real)
    assert_within_e4m3_rounding(weight, real, scale, (16, 32))


def test_quantize_bound_fails_on_a_wrong_scale():
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fp8, scale = quantize_block_fp8(weight, (16, 16))
    real = dequantize_block_fp8(fp8, scale.roll(1, 0), (16, 16), torch.float64)  # another block's scales
    with pytest.raises(AssertionError, match="beyond e4m3 rounding"):
        assert_within_e4m3_rounding(weight, real, scale, (16, 16))


def allocated_bytes(model) -> int:
    """Bytes of the distinct storages the model's tensors hold (what the device allocated for them)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_memory_estimate_is_what_the_built_models_hold(tiny_qwen, tiny_qwen_fp8):
    fields = qwen3_next_fields(tiny=True)
    assert model_bytes(ours_on_meta(fields, torch.float32)) == allocated_bytes(tiny_qwen[0])
    assert model_bytes(theirs_on_meta(fields, torch.float32)) == allocated_bytes(tiny_qwen[1])
    fp8 = ours_on_meta(qwen3_next_fields(tiny=True, fp8=True), torch.float32)
    assert model_bytes(fp8) == allocated_bytes(tiny_qwen_fp8) < allocated_bytes(tiny_qwen[0])


def test_a_model_larger_than_the_free_memory_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 141 * 2**30))
    needed = model_bytes(ours_on_meta(qwen3_next_fields()))
    with pytest.raises(SystemExit, match=r"^ours needs 148\.4 GiB and cuda has 10\.0 GiB free; ask for fewer of its "
                                         r"layers \(the script's layer option\) or free the device\.$"):
        check_fits(needed, torch.device("cuda"), "ours")


def same_logits(ours, theirs, vocab: int) -> None:
    tokens = torch.randint(1, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = theirs(tokens, use_cache=False).logits
        got = ours(tokens, use_cache=False).logits
    assert expected.abs().max() > 0.1  # the logits are not all ~0 (a model of zero weights would agree)
    torch.testing.assert_close(got, expected, rtol=0, atol=LOGITS_TOLERANCE)


def test_tiny_qwen3_next_ours_and_transformers_give_the_same_logits(tiny_qwen):
    same_logits(*tiny_qwen, vocab=256)


def test_tiny_kimi_linear_ours_and_transformers_give_the_same_logits():
    fields = kimi_linear_fields(tiny=True)
    ours, theirs = build_ours(fields, CPU, torch.float32), build_theirs(fields, CPU, torch.float32)
    assert [i + 1 for i, t in enumerate(ours.config.mixer_types) if t == "mla_attention"] == [4, 8]
    assert ours.config.num_experts == 16 and ours.config.mlp_types[0] == "dense"
    assert model_bytes(ours_on_meta(fields, torch.float32)) == allocated_bytes(ours)
    same_logits(ours, theirs, vocab=256)


def test_the_draws_depend_on_the_seed_and_the_name():
    fields = kimi_linear_fields(tiny=True, layers=1)
    first = dict(build_theirs(fields, CPU, torch.float32, seed=0).named_parameters())
    second = dict(build_theirs(fields, CPU, torch.float32, seed=1).named_parameters())
    assert not torch.equal(first["lm_head.weight"], second["lm_head.weight"])
    assert not torch.equal(first["model.layers.0.input_layernorm.weight"],
                           first["model.layers.0.post_attention_layernorm.weight"])


def test_bytes_per_step_reads_the_used_experts_and_the_caches():
    """The limit's bytes at full size on meta: batch 1 reads top-k of the experts' bytes, every other weight, one
    embedding row and the caches; a batch large enough to pick every expert reads all of them."""
    from bench_flagships import cache_bytes, step_bytes

    model = ours_on_meta(qwen3_next_fields(fp8=True))
    sizes = {name: t.numel() * t.element_size() for name, t in model.named_parameters()}
    experts = sum(size for name, size in sizes.items() if ".mlp.experts." in name)
    embedding = sizes["model.embed_tokens.weight"]
    rest = sum(sizes.values()) - experts - embedding
    row = 2048 * 2  # one bfloat16 row of the embedding
    assert step_bytes(model, 1, 0) == int(rest + experts * 10 / 512 + row + cache_bytes(model.config, 1, 0, 2))
    # GDN: 36 layers of a float32 state 32 x 128 x 128 and a conv window (2 x 16 + 32) x 128 x 4 in bfloat16;
    # attention: 12 layers of keys and values, 2 KV heads of 256, per token
    gdn = 36 * (4 * 32 * 128 * 128 + 2 * 64 * 128 * 4)
    assert cache_bytes(model.config, 1, 1000, 2) == gdn + 12 * 1000 * 2 * 2 * 256 * 2
    every_expert = step_bytes(model, 100_000, 0) - cache_bytes(model.config, 100_000, 0, 2)
    assert abs(every_expert - (rest + experts + 100_000 * row)) < 1e-6 * experts
