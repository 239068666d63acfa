"""FP8 checkpoints kept as FP8: a tiny Qwen3-Next folder in the released FP8 layout converts to this family's folder
with its FP8 weights and scales byte for byte, and back to the same bytes and quantization_config; from_pretrained
builds FP8 layers and experts where the config quantizes, runs and generates on the CPU, and save_pretrained writes the
same bytes; bad FP8 input is refused in one line before any weight loads.

Accuracy: the test scales are powers of two, so each real weight W_fp8 * scale (4 significant bits) is exact in
bfloat16 and float32 alike. The model on FP8 weights (which dequantizes to its float32 activations) and the model
converted with --dequantize-fp8 (bf16 weights, loaded in float32) then hold the same float32 weights, and their
logits differ only by float32 rounding in the experts (the FP8 experts multiply expert by expert, the float model's
through a grouped GEMM, summing in another order): FLOAT32_TOLERANCE, a few float32 ulps of logits of size ~1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_helpers import HostReadsRefused, greedy
from safetensors.torch import load_file, save_file
from test_convert_qwen3_next import tensors_of
from test_fp8_blocks import TINY_MOE, reference_dequantize, write_fp8_folders
from torch import nn
from transformers.quantizers.quantizers_utils import should_convert_module

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.extra_tensors import EXTRA_TENSORS_FILE
from hybrid_linear_models.fp8_layers import Fp8Experts, Fp8Linear
from hybrid_linear_models.kernels_fp8 import quantize_block_fp8
from hybrid_linear_models.mlp_sparse_moe import HybridLinearExperts

FP8 = torch.float8_e4m3fn
BLOCK = (12, 20)  # I = 12 rows fill whole blocks; hidden 32 = 20 + a partial 12-column block, as do most row counts
FLOAT32_TOLERANCE = 1e-5


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """root/fp8 (released layout), root/hf (converted, FP8 kept), root/hf-bf16 (converted with --dequantize-fp8)."""
    root = tmp_path_factory.mktemp("fp8")
    write_fp8_folders(root, BLOCK, power_of_two=True)
    convert_checkpoint(root / "fp8", root / "hf", from_format="qwen3_next", to_format="hf")
    convert_checkpoint(root / "fp8", root / "hf-bf16", from_format="qwen3_next", to_format="hf", dequantize_fp8=True)
    return root


def test_fp8_converts_in_kept_and_back_byte_for_byte(folders, tmp_path):
    source, ours = tensors_of(folders / "fp8"), tensors_of(folders / "hf")
    # under this family's names: each expert's FP8 gate and up stacked whole into gate_up_proj, scales alike
    fused = ours["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused[:2] == (FP8, (3, 24, 32))
    assert ours["model.layers.0.mlp.experts.gate_up_proj_scale_inv"][:2] == (torch.float32, (3, 2, 2))
    for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.3.self_attn.q_proj.weight",
                 "model.layers.0.mlp.shared_expert.down_proj.weight", "model.layers.3.self_attn.o_proj.weight"):
        assert ours[name] == source[name] and source[name][0] == FP8
        assert ours[name + "_scale_inv"] == source[name + "_scale_inv"]
    for name in ("model.layers.0.linear_attn.in_proj_ba.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight", "model.embed_tokens.weight"):
        assert ours[name] == source[name] and source[name][0] == torch.bfloat16
    assert config_of(folders / "hf")["quantization_config"] == config_of(folders / "fp8")["quantization_config"]
    # the MTP head: the model's own (mtp_head.py), FP8 where the source quantizes it, its scales beside
    assert ours["mtp.fc.weight"] == source["mtp.fc.weight"] and source["mtp.fc.weight"][0] == FP8
    assert ours["mtp.fc.weight_scale_inv"] == source["mtp.fc.weight_scale_inv"]
    assert not (folders / "hf" / EXTRA_TENSORS_FILE).exists()

    convert_checkpoint(folders / "hf", tmp_path / "back", from_format="hf", to_format="qwen3_next")
    assert tensors_of(tmp_path / "back") == source  # every tensor: names, dtypes, shapes, bytes
    back, original = config_of(tmp_path / "back"), config_of(folders / "fp8")
    assert back["quantization_config"] == original["quantization_config"]


def test_dtype_casts_only_the_unquantized_tensors(folders, tmp_path):
    convert_checkpoint(folders / "fp8", tmp_path / "hf32", from_format="qwen3_next", to_format="hf", dtype="float32")
    source, ours = tensors_of(folders / "fp8"), tensors_of(tmp_path / "hf32")
    name = "model.layers.0.linear_attn.out_proj.weight"
    assert ours[name] == source[name] and ours[name + "_scale_inv"] == source[name + "_scale_inv"]
    assert ours["model.norm.weight"][0] == torch.float32


def test_fp8_experts_across_blocks_and_formats_without_fp8_are_refused(tmp_path):
    write_fp8_folders(tmp_path, (8, 16))  # I = 12 rows of gate, 12 of up, in 8-row blocks: one block spans both
    with pytest.raises(ConversionError) as raised:
        convert_checkpoint(tmp_path / "fp8", tmp_path / "out", from_format="qwen3_next", to_format="hf")
    message = str(raised.value)
    assert "\n" not in message and "12 is not a multiple of 8" in message and "--dequantize-fp8" in message
    with pytest.raises(ConversionError, match="fast_llm format cannot hold") as raised:
        convert_checkpoint(tmp_path / "fp8", tmp_path / "out", from_format="qwen3_next", to_format="fast_llm")
    assert "\n" not in str(raised.value) and "--dequantize-fp8" in str(raised.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fp8", "reference", "saved"]


def test_fused_fp8_experts_across_blocks_keep_but_do_not_split(tmp_path):
    """transformers' fused layout with I = 12 in 8-row blocks reads as it is (our layout), but the released
    per-expert layout cannot be written from it: the block of scales spanning gate and up rows has no split."""
    block = (8, 16)
    write_fp8_folders(tmp_path, block)
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(path)
    # every sparse block fused, the MTP head's too (a folder holds one layout)
    for prefix in [f"model.layers.{layer}.mlp.experts." for layer in range(4)] + ["mtp.layers.0.mlp.experts."]:
        fused, scales = [], []
        for expert in range(TINY_MOE["num_experts"]):
            parts = [tensors.pop(f"{prefix}{expert}.{part}.weight") for part in ("gate_proj", "up_proj")]
            part_scales = [tensors.pop(f"{prefix}{expert}.{part}.weight_scale_inv")
                           for part in ("gate_proj", "up_proj")]
            real = torch.cat([reference_dequantize(w, s, block) for w, s in zip(parts, part_scales)])
            weight, scale = quantize_block_fp8(real, block)  # the fused weight whole: a block spans gate and up
            fused.append(weight)
            scales.append(scale)
        tensors[prefix + "gate_up_proj"] = torch.stack(fused)
        tensors[prefix + "gate_up_proj_scale_inv"] = torch.stack(scales)
        for suffix in ("", "_scale_inv"):
            tensors[prefix + "down_proj" + suffix] = torch.stack(
                [tensors.pop(f"{prefix}{e}.down_proj.weight{suffix}") for e in range(TINY_MOE["num_experts"])])
    save_file(tensors, path, metadata={"format": "pt"})
    convert_checkpoint(tmp_path / "fp8", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    stored = tensors_of(tmp_path / "hf")["model.layers.0.mlp.experts.gate_up_proj_scale_inv"]
    assert stored[:2] == (torch.float32, (3, 3, 2))  # ceil(24 / 8) blocks of rows: one spans gate and up
    with pytest.raises(ConversionError) as raised:
        convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="qwen3_next")
    message = str(raised.value)
    assert "\n" not in message and "split out of gate_up_proj" in message and "--to qwen3_next" in message, message
    assert not (tmp_path / "back").exists()


def test_from_pretrained_builds_fp8_layers_where_the_config_quantizes(folders):
    model = HybridLinearForCausalLM.from_pretrained(folders / "hf", dtype=torch.float32)
    layer0, layer3 = model.model.layers[0], model.model.layers[3]
    assert isinstance(layer0.linear_attn.in_proj_qkvz, Fp8Linear) and isinstance(layer3.self_attn.q_proj, Fp8Linear)
    assert isinstance(layer0.mlp.shared_expert.up_proj, Fp8Linear) and isinstance(layer0.mlp.experts, Fp8Experts)
    for kept in (layer0.linear_attn.in_proj_ba, layer0.mlp.shared_expert_gate, model.lm_head):  # modules_to_not_convert
        assert type(kept) is nn.Linear and kept.weight.dtype == torch.float32
    experts = layer0.mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.gate_up_proj_scale_inv.dtype == torch.float32
    stored = load_file(folders / "hf" / "model.safetensors")
    assert torch.equal(layer3.self_attn.q_proj.weight.view(torch.uint8),
                       stored["model.layers.3.self_attn.q_proj.weight"].view(torch.uint8))
    model.to(torch.bfloat16)  # a dtype change moves the floating weights, never the FP8 bytes or their scales
    q_proj = layer3.self_attn.q_proj
    assert q_proj.weight.dtype == FP8 and q_proj.weight_scale_inv.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_fp8_model_matches_the_dequantized_model_and_generates(folders):
    fp8 = HybridLinearForCausalLM.from_pretrained(folders / "hf", dtype=torch.float32).eval()
    dense = HybridLinearForCausalLM.from_pretrained(folders / "hf-bf16", dtype=torch.float32).eval()
    assert dense.config.block_fp8 is None and isinstance(dense.model.layers[0].mlp.experts, HybridLinearExperts)
    tokens = torch.randint(1, dense.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = dense(tokens).logits, fp8(tokens).logits
    assert expected.abs().max() > 0.1  # logits of a real size: the comparison means something
    assert (expected - got).abs().max().item() <= FLOAT32_TOLERANCE
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(tokens)}
    assert torch.equal(fp8.generate(tokens, **greedy), dense.generate(tokens, **greedy))


def test_fp8_experts_match_a_float64_loop():
    """Fp8Experts against the float experts' own loop ("eager") on the dequantized weights, in float64 (exact
    weights; the sums differ by float64 rounding only). Expert 2 receives no token."""
    settings = HybridLinearConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [8, 16]})
    block = settings.block_fp8_settings
    generator = torch.Generator().manual_seed(3)
    experts = Fp8Experts(4, 20, 12, nn.functional.silu, block)
    for name in experts._stored:
        param = getattr(experts, name)
        values = torch.rand(param.shape, generator=generator) * 2 - 1
        param.data.copy_(values.add(1.5).div(64) if name.endswith("_scale_inv") else (values * 300).to(FP8))
    config = HybridLinearConfig(num_experts=4, num_experts_per_tok=2, hidden_size=20, moe_intermediate_size=12,
                                hidden_act="silu", mixer_types=["gated_deltanet"], mlp_types=["sparse_moe"])
    config._experts_implementation = "eager"  # transformers' loop over the experts, the float experts' own forward
    reference = HybridLinearExperts(config).double()  # float64 weights: the exact products of FP8 and scale
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            weight, scale = getattr(experts, name), getattr(experts, name + "_scale_inv")
            getattr(reference, name).copy_(reference_dequantize(weight, scale, (8, 16)))
    x = torch.randn(5, 20, generator=generator, dtype=torch.float64)
    top_k = torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [1, 0]])
    weights = torch.rand(5, 2, generator=generator, dtype=torch.float64)
    expected = reference(x, top_k, weights)
    torch.testing.assert_close(experts(x, top_k, weights), expected, rtol=1e-12, atol=1e-12)
    # expert parallelism's sentinel (index 4 = num_experts: a pair another rank's experts serve) adds nothing, and the
    # forward reads no count on the host (what a CUDA graph needs)
    top_k = torch.tensor([[0, 4], [3, 0], [4, 3], [0, 3], [4, 4]])
    expected = reference(x, top_k, weights)
    with _no_host_reads():
        got = experts(x, top_k, weights)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


class _no_host_reads(HostReadsRefused):
    """HostReadsRefused, except inside the CPU reference kernel (kernels_fp8), which takes its offsets on the host:
    the CUDA kernels do not."""

    def __enter__(self):
        import hybrid_linear_models.fp8_layers as layers

        original = self._original = layers.block_fp8_grouped_linear

        def grouped(*args, **kwargs):
            with self.allowed():
                return original(*args, **kwargs)

        layers.block_fp8_grouped_linear = grouped
        return super().__enter__()

    def __exit__(self, *exc):
        import hybrid_linear_models.fp8_layers as layers

        layers.block_fp8_grouped_linear = self._original
        return super().__exit__(*exc)


def test_save_pretrained_writes_the_same_fp8_folder(folders, tmp_path):
    """Every FP8 weight and scale byte for byte; the other tensors with their values (the model keeps GDN's A_log and
    dt_bias in float32 whatever the dtype, so those two come back float32)."""
    model = HybridLinearForCausalLM.from_pretrained(folders / "hf")  # dtype "auto": config.json's bfloat16
    model.save_pretrained(tmp_path / "saved")
    saved, stored = load_file(tmp_path / "saved" / "model.safetensors"), load_file(folders / "hf" / "model.safetensors")
    assert sorted(saved) == sorted(stored)
    quantized = {name for name, tensor in stored.items() if tensor.dtype == FP8}
    assert quantized and all(name + "_scale_inv" in stored for name in quantized)
    for name, tensor in stored.items():
        if name in quantized or name.endswith("_scale_inv"):
            assert saved[name].dtype == tensor.dtype and torch.equal(saved[name].view(torch.uint8),
                                                                      tensor.view(torch.uint8)), name
        else:
            assert saved[name].dtype == (torch.float32 if name.endswith(("A_log", "dt_bias")) else tensor.dtype)
            assert torch.equal(saved[name].to(tensor.dtype), tensor), name
    assert config_of(tmp_path / "saved")["quantization_config"] == config_of(folders / "hf")["quantization_config"]


def _edited(folders: Path, tmp_path: Path, tensors=None, quantization=None) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(folders / "hf", folder)
    if tensors is not None:
        stored = load_file(folder / "model.safetensors")
        tensors(stored)
        save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    if quantization is not None:
        config = config_of(folder)
        quantization(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


WEIGHT = "model.layers.3.self_attn.o_proj.weight"
SCALE = WEIGHT + "_scale_inv"
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"
ROUTER_SCALE = "model.layers.0.mlp.gate.weight_scale_inv"
BAD_LOADS = {
    "missing scale": ({"tensors": lambda t: t.pop(SCALE)}, [SCALE, "no tensor", "[3, 2]"]),
    "scale of the wrong shape": ({"tensors": lambda t: t.update({SCALE: torch.ones(2, 2)})},
                                 [SCALE, "[2, 2]", "[3, 2]"]),
    "fmt e5m2": ({"quantization": lambda c: c["quantization_config"].update(fmt="e5m2")}, ["fmt", "e5m2"]),
    "static activations": ({"quantization": lambda c: c["quantization_config"].update(activation_scheme="static")},
                           ["activation_scheme", "static"]),
    "FP8 weights without quantization_config": ({"quantization": lambda c: c.pop("quantization_config")},
                                                ["float8_e4m3fn", "quantization_config"]),
    "an FP8 module kept in bf16 by the config": (
        {"quantization": lambda c: c["quantization_config"]["modules_to_not_convert"].append("o_proj")},
        ["model.layers.3.self_attn.o_proj", "float8_e4m3fn"]),
    "an e5m2 weight": ({"tensors": lambda t: t.update({WEIGHT: t[WEIGHT].float().to(torch.float8_e5m2)})},
                       [WEIGHT, "float8_e5m2", "float8_e4m3fn"]),
    "a NaN scale": ({"tensors": lambda t: t[SCALE].__setitem__((1, 0), float("nan"))}, [SCALE, "nan", "[1, 0]"]),
    "a zero scale": ({"tensors": lambda t: t[SCALE].__setitem__((2, 1), 0.0)}, [SCALE, "0", "[2, 1]"]),
    "a negative scale": ({"tensors": lambda t: t[SCALE].neg_()}, [SCALE, "finite and positive"]),
    "a float64 scale": ({"tensors": lambda t: t.update({SCALE: t[SCALE].double()})}, [SCALE, "float64", "float32"]),
    "a missing FP8 weight": ({"tensors": lambda t: t.pop(WEIGHT)}, [WEIGHT, "no tensor", "random"]),
    "a missing FP8 expert stack": ({"tensors": lambda t: t.pop(EXPERTS)}, [EXPERTS, "no tensor"]),
    "a scale beside a bf16 router": ({"tensors": lambda t: t.update({ROUTER_SCALE: torch.ones(1, 2)})},
                                     [ROUTER_SCALE, "unquantized", "modules_to_not_convert"]),
}


@pytest.mark.parametrize("case", sorted(BAD_LOADS))
def test_bad_fp8_folder_is_refused_in_one_line(folders, tmp_path, case):
    changes, fragments = BAD_LOADS[case]
    folder = _edited(folders, tmp_path, **changes)
    with pytest.raises(ValueError) as raised:
        HybridLinearForCausalLM.from_pretrained(folder)
    message = str(raised.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_a_tensor_of_a_dtype_without_a_name_here_is_refused_only_where_it_loads(folders, tmp_path):
    """A stored tensor of a dtype this package has no name for (e8m0 scales of another format) that no parameter
    takes is left to transformers (an unexpected key); the same dtype into a parameter is refused by name."""
    extra = {"model.unknown.e8m0": torch.ones(4).to(torch.float8_e8m0fnu)}
    folder = _edited(folders, tmp_path, tensors=lambda t: t.update(extra))
    _, info = HybridLinearForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["unexpected_keys"] == set(extra)
    shutil.rmtree(folder)
    folder = _edited(folders, tmp_path, tensors=lambda t: t.update({SCALE: t[SCALE].to(torch.float8_e8m0fnu)}))
    with pytest.raises(ValueError, match=rf"{SCALE}.* has a dtype this package does not load"):
        HybridLinearForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("requested", [{"quant_method": "fp8", "dequantize": True}, "FineGrainedFP8Config"])
def test_an_fp8_quantization_config_argument_is_refused_in_one_line(folders, requested):
    """from_pretrained(quantization_config=<fp8>) would go to transformers' FP8 quantizer or, with dequantize=True,
    be ignored: refused, naming the converter's --dequantize-fp8."""
    if requested == "FineGrainedFP8Config":
        from transformers import FineGrainedFP8Config

        requested = FineGrainedFP8Config(dequantize=True)
    with pytest.raises(ValueError) as raised:
        HybridLinearForCausalLM.from_pretrained(folders / "hf", quantization_config=requested)
    message = str(raised.value)
    assert "\n" not in message and "--dequantize-fp8" in message and "quantization_config" in message, message


@pytest.mark.parametrize("kept", [lambda data: data[:-1000], lambda data: data[:20], lambda data: b""],
                         ids=["data cut", "header cut", "empty"])
def test_a_truncated_shard_is_refused_by_name(folders, tmp_path, kept):
    folder = _edited(folders, tmp_path)
    shard = folder / "model.safetensors"
    shard.write_bytes(kept(shard.read_bytes()))
    with pytest.raises(ValueError) as raised:
        HybridLinearForCausalLM.from_pretrained(folder)
    message = str(raised.value)
    assert "\n" not in message and str(shard) in message and "truncated or corrupt" in message, message


@pytest.mark.parametrize(("pattern", "name", "kept"), [
    ("model.layers.1", "model.layers.1.mlp.down_proj", True),  # a prefix, ending at a dot
    ("model.layers.1", "model.layers.11.mlp.down_proj", False),
    ("mlp.gate", "model.layers.0.mlp.gate", True),  # a suffix
    ("mlp.gate", "model.layers.0.mlp.gate_proj", False),
    (r"model\.layers\.\d+\.linear_attn\.in_proj_ba", "model.layers.7.linear_attn.in_proj_ba", True),  # a regex
    ("lm_head", "lm_head", True),
    ("lm_head", "model.layers.0.self_attn.q_proj", False),
])
def test_modules_to_not_convert_matches_as_transformers_does(pattern, name, kept):
    config = HybridLinearConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16],
                                                     "modules_to_not_convert": [pattern]})
    assert config.block_fp8_settings.quantizes(name) is not kept
    assert should_convert_module(name, [pattern]) is not kept  # transformers' FineGrainedFP8 rule agrees


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fp8_model_decodes_captured_as_uncaptured(tmp_path):
    """An FP8 MoE model's decoding step (FP8 linear layers and experts, on the Triton kernels: 12 x 16 blocks) is
    captured in a CUDA graph, with no capture failure (a host read in the step would leave it eager, and at full size
    some 30x slower), and decodes the tokens of the uncaptured step."""
    write_fp8_folders(tmp_path, (12, 16))  # 12-row blocks: the experts' 12 gate and 12 up rows join blockwise
    convert_checkpoint(tmp_path / "fp8", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    model = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    captured = greedy(model, ids, 12, cache_implementation="static")
    assert model._graph_decoder is not None and not model._graph_decoder._failed, model._graph_decoder._failed
    model.set_cuda_graph_decoding(False)
    # (a dynamic cache: transformers would torch.compile a static cache's uncaptured step, whose FP8 layers then run
    # the dequantized reference instead of the kernels the captured step runs)
    eager = greedy(model, ids, 12)
    assert torch.equal(captured.sequences, eager.sequences)
