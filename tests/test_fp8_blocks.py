"""Block-scaled FP8 checkpoints in Qwen3-Next's released layout: dequantization against a float64 reference built
here by indexing (not by the code's broadcast), a tiny FP8 Qwen3-Next folder converting with --dequantize-fp8 to the
same tensors (bit for bit) and logits as a bf16 folder dequantized in the test, and every bad input refused with one
line and no output.

Exactness: an e4m3 value (4 significant bits) times a float32 scale (24 bits) is exact in float64, so the reference
rounds once, float64 -> target dtype, and the code must agree bit for bit. Logits: both models run the same bf16
weights in float32, so they differ by summation order only; LOGITS_TOLERANCE (1e-4) is the qwen3_next suite's.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_convert_qwen3_next import assert_same_predictions, save_qwen3_next, tensors_of
from test_convert_qwen3_next_mtp import MTP_FIELDS, mtp_head_tensors
from transformers import Qwen3NextForCausalLM

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.fp8_blocks import dequantize_block_fp8
from hybrid_linear_models.kernels_fp8 import quantize_block_fp8
from hybrid_linear_models.conversion.safetensors_io import SafetensorsFile
from hybrid_linear_cli.convert import main as cli_main

FP8 = torch.float8_e4m3fn
# kept in bf16 in the released build: embeddings, lm_head, norms, router, shared expert gate, GDN's small tensors
KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate", "A_log", "dt_bias", "conv1d",
        "in_proj_ba")
TINY_MOE = dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                decoder_sparse_step=1, intermediate_size=40)


def reference_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float64 real weight: each element times the scale of the block its (row, column) falls in."""
    rows = torch.arange(weight.shape[-2]) // block[0]
    cols = torch.arange(weight.shape[-1]) // block[1]
    return weight.to(torch.float64) * scale.to(torch.float64)[..., rows[:, None], cols[None, :]]


BLOCKS = [(16, 16), (12, 20), (128, 128)]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", [(40, 32), (33, 50), (128, 256), (3, 17, 29)])
def test_dequantize_matches_float64_reference(block, shape):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=generator) * 100).to(FP8)
    grid = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    scale = torch.rand(grid, generator=generator) * 1e-2 + 1e-4
    expected = reference_dequantize(weight, scale, block)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        got = dequantize_block_fp8(weight, scale, block, dtype)
        assert got.dtype == dtype and got.shape == weight.shape
        assert torch.equal(got, expected.to(dtype))  # one rounding of the exact product


def tensors_of_file(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    file = SafetensorsFile(path)
    return {key: (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for key, t in ((key, file.read(key)) for key in file.keys())}


def write_fp8_folders(tmp_path: Path, block: tuple[int, int], power_of_two: bool = False) -> Qwen3NextForCausalLM:
    """tmp_path/fp8: a Qwen3-Next folder in the released FP8 layout; tmp_path/reference: the same model with the FP8
    weights dequantized here (float64, rounded once to bf16) and everything else the same bf16 tensors."""
    theirs = save_qwen3_next(tmp_path / "saved", **TINY_MOE)
    fp8, reference = {}, {}
    stored = SafetensorsFile(tmp_path / "saved" / "model.safetensors")
    mtp = mtp_head_tensors(tmp_path / "saved", MTP_FIELDS)  # the hub's MTP head: FP8 too, the model's own
    not_converted = []  # as the released config lists them: every module kept in bf16, by its full name
    for name, tensor in [*((name, stored.read(name)) for name in stored.keys()), *mtp.items()]:
        if tensor.dim() == 2 and not any(part in name for part in KEPT):
            weight, scale = quantize_block_fp8(tensor, block, power_of_two)
            fp8[name], fp8[name + "_scale_inv"] = weight, scale
            reference[name] = reference_dequantize(weight, scale, block).to(torch.bfloat16)
        else:
            fp8[name] = reference[name] = tensor.to(torch.bfloat16)
            not_converted.append(name.removesuffix(".weight"))
    assert any(key.endswith("experts.0.down_proj.weight_scale_inv") for key in fp8)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    for folder, tensors in (("fp8", fp8), ("reference", reference)):
        (tmp_path / folder).mkdir()
        save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
        fields = {**config, **MTP_FIELDS}
        if folder == "fp8":
            fields["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                             "activation_scheme": "dynamic",
                                             "modules_to_not_convert": not_converted}
        (tmp_path / folder / "config.json").write_text(json.dumps(fields))
    return theirs


@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_folder_converts_dequantized(tmp_path, block):
    write_fp8_folders(tmp_path, block)
    convert_checkpoint(tmp_path / "fp8", tmp_path / "hf", from_format="qwen3_next", to_format="hf",
                       dequantize_fp8=True)
    convert_checkpoint(tmp_path / "reference", tmp_path / "reference-hf", from_format="qwen3_next", to_format="hf")
    converted = tensors_of(tmp_path / "hf")
    assert converted == tensors_of(tmp_path / "reference-hf")
    assert not any(key.endswith("_scale_inv") for key in converted)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(converted)
    assert {dtype for dtype, _, _ in converted.values()} == {torch.bfloat16}
    theirs = Qwen3NextForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()
    ours = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert_same_predictions(theirs, ours, theirs.config.vocab_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_folder_dequantizes_to_the_asked_dtype_in_one_rounding(tmp_path, dtype):
    """--dequantize-fp8 with --dtype: each FP8 weight is its float64 real weight rounded to the dtype (float16 through
    float32, whose rounding of the exact product is the one float64 -> float32 gives), not through bfloat16."""
    write_fp8_folders(tmp_path, (12, 20))
    convert_checkpoint(tmp_path / "fp8", tmp_path / "hf", from_format="qwen3_next", to_format="qwen3_next",
                       dequantize_fp8=True, dtype=dtype)
    source, converted = SafetensorsFile(tmp_path / "fp8" / "model.safetensors"), {}
    for path in (tmp_path / "hf").glob("*.safetensors"):
        file = SafetensorsFile(path)
        names = file.keys()  # (a file's tensor names)
        converted.update((key, file.read(key)) for key in names)
    stored = source.keys()
    fp8 = [key for key in stored if source.info(key).dtype == torch.float8_e4m3fn]
    assert fp8 and all(key in converted for key in fp8)
    for key in fp8:
        exact = reference_dequantize(source.read(key), source.read(key + "_scale_inv"), (12, 20))
        assert converted[key].dtype == dtype and torch.equal(converted[key], exact.to(torch.float32).to(dtype)), key
    assert any(not torch.equal(converted[key], converted[key].to(torch.bfloat16).to(dtype)) for key in fp8)


def edit_folder(folder: Path, change_tensors=None, change_config=None) -> None:
    from safetensors.torch import load_file

    if change_tensors is not None:
        tensors = load_file(folder / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if change_config is not None:
        config = json.loads((folder / "config.json").read_text())
        change_config(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))


WEIGHT = "model.layers.0.mlp.experts.1.up_proj.weight"
BAD_INPUTS = {
    "missing scale": (dict(change_tensors=lambda t: t.pop(WEIGHT + "_scale_inv")),
                      [WEIGHT + "_scale_inv", "no scale", "[1, 2]"]),
    "wrong scale shape": (dict(change_tensors=lambda t: t.update({WEIGHT + "_scale_inv": torch.ones(2, 2)})),
                          [WEIGHT + "_scale_inv", "[2, 2]", "[1, 2]"]),
    "stray scale beside a bf16 weight": (
        dict(change_tensors=lambda t: t.update({"model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 2)})),
        ["model.layers.0.mlp.gate.weight_scale_inv", "stray"]),
    "stray scale without a weight": (
        dict(change_tensors=lambda t: t.update({"model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1, 1)})),
        ["model.layers.0.mlp.extra.weight_scale_inv", "not stored"]),
    "zero scale": (dict(change_tensors=lambda t: t[WEIGHT + "_scale_inv"].zero_()),
                   [WEIGHT + "_scale_inv", "finite and positive"]),
    "weight in another FP8 format": (
        dict(change_tensors=lambda t: t.update({WEIGHT: t[WEIGHT].float().to(torch.float8_e5m2)})),
        [WEIGHT, "float8_e5m2", "float8_e4m3fn"]),
    "scale in an integer dtype": (
        dict(change_tensors=lambda t: t.update({WEIGHT + "_scale_inv": torch.ones(1, 2, dtype=torch.int32)})),
        [WEIGHT + "_scale_inv", "int32", "[1, 2]"]),
    "another quant_method": (dict(change_config=lambda q: q.update(quant_method="bitsandbytes")),
                             ["quant_method", "bitsandbytes"]),
    "another fmt": (dict(change_config=lambda q: q.update(fmt="e5m2")), ["fmt", "e5m2"]),
    "one-number block": (dict(change_config=lambda q: q.update(weight_block_size=[16])), ["weight_block_size"]),
    "static activations": (dict(change_config=lambda q: q.update(activation_scheme="static")),
                           ["activation_scheme", "static"]),
    "an FP8 weight whose module the config keeps": (
        dict(change_config=lambda q: q["modules_to_not_convert"].append("o_proj")),
        ["'model.layers.3.self_attn.o_proj.weight' is FP8", "modules_to_not_convert"]),
    "a bf16 weight whose module the config quantizes": (
        dict(change_config=lambda q: q["modules_to_not_convert"].remove("model.layers.0.linear_attn.in_proj_ba")),
        ["'model.layers.0.linear_attn.in_proj_ba.weight' is bfloat16", "modules_to_not_convert"]),
}


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    write_fp8_folders(root, (16, 16))
    return root / "fp8"


# refused where the FP8 weights are kept (the model would build FP8 layers elsewhere); dequantized, each FP8 weight
# with its scale becomes its bf16 weight whatever the module
KEPT_ONLY = {"an FP8 weight whose module the config keeps", "a bf16 weight whose module the config quantizes"}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_fp8_input_is_one_line_and_no_output(tmp_path, fp8_folder, case):
    changes, fragments = BAD_INPUTS[case]
    shutil.copytree(fp8_folder, tmp_path / "src")
    edit_folder(tmp_path / "src", **changes)
    with pytest.raises(ConversionError) as raised:
        convert_checkpoint(tmp_path / "src", tmp_path / "out", from_format="qwen3_next", to_format="hf",
                           dequantize_fp8=case not in KEPT_ONLY)
    message = str(raised.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message
    assert not (tmp_path / "out").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]
    if case in KEPT_ONLY:
        convert_checkpoint(tmp_path / "src", tmp_path / "out", from_format="qwen3_next", to_format="hf",
                           dequantize_fp8=True)
        assert {dtype for dtype, _, _ in tensors_of(tmp_path / "out").values()} == {torch.bfloat16}


def test_fp8_experts_across_blocks_convert_only_dequantized_on_the_command_line(tmp_path, fp8_folder, capsys):
    """I = 12 rows of gate and of up in 16-row blocks: kept FP8 they cannot fuse (a block would span both)."""
    status = cli_main(["--from", "qwen3_next", "--to", "hf", str(fp8_folder), str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1 and "--dequantize-fp8" in err, err
    assert "'model.layers.0.mlp.experts.gate_up_proj'" in err and "12 is not a multiple of 16" in err, err
    assert not (tmp_path / "out").exists()
    assert cli_main(["--from", "qwen3_next", "--to", "hf", str(fp8_folder), str(tmp_path / "out"), "--quiet",
                     "--dequantize-fp8"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_fp8_weights_without_quantization_config_are_refused(tmp_path, fp8_folder):
    """Stored FP8 values without their scales are not the weights: refused by name, never cast as they are."""
    from safetensors.torch import load_file

    shutil.copytree(fp8_folder, tmp_path / "src")
    tensors = {k: v for k, v in load_file(tmp_path / "src" / "model.safetensors").items()
               if not k.endswith("_scale_inv")}
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    for dequantize in (False, True):
        with pytest.raises(ConversionError, match="float8_e4m3fn, which converts only as a block-scaled") as raised:
            convert_checkpoint(tmp_path / "src", tmp_path / "out", from_format="qwen3_next", to_format="hf",
                               dtype="bfloat16", dequantize_fp8=dequantize)
        assert "\n" not in str(raised.value)
        assert not (tmp_path / "out").exists()


def fuse_fp8_experts(folder: Path) -> None:
    """Rewrites folder/model.safetensors with transformers' fused FP8 experts (`experts.gate_up_proj` (E, 2I, H) with
    `experts.gate_up_proj_scale_inv` (E, ceil(2I/bn), ceil(H/bk)), `experts.down_proj` likewise)."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    fused = {}
    for name, tensor in tensors.items():
        prefix, found, rest = name.partition("mlp.experts.")
        if not found:
            fused[name] = tensor
            continue
        expert, part, suffix = rest.split(".", 2)  # "{e}", "gate_proj", "weight" or "weight_scale_inv"
        fused.setdefault((prefix, part, suffix), {})[int(expert)] = tensor
    for key in [key for key in fused if isinstance(key, tuple)]:
        prefix, part, suffix = key
        if part == "up_proj":
            continue
        experts = fused.pop(key)
        stacked = [experts[e] for e in sorted(experts)]
        leaf = "down_proj" if part == "down_proj" else "gate_up_proj"
        if part == "gate_proj":
            ups = fused.pop((prefix, "up_proj", suffix))
            stacked = [torch.cat([gate, ups[e]]) for e, gate in enumerate(stacked)]
        fused[f"{prefix}mlp.experts.{leaf}" + ("_scale_inv" if suffix.endswith("_scale_inv") else "")] = \
            torch.stack(stacked)
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in fused
    (folder / "model.safetensors").unlink()
    save_file(fused, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kept_per_expert", ["model.layers.1.", "model.layers.0.mlp.experts.0.down_proj"],
                         ids=["layer 1 per expert", "one layer's down per expert"])
def test_experts_stored_in_two_layouts_are_refused_by_name(tmp_path, kept_per_expert):
    """A folder whose experts are fused in some tensors and per expert in others (put together from two exports) is
    refused in one line naming one tensor of each layout, with and without --dequantize-fp8, writing nothing."""
    block = (TINY_MOE["moe_intermediate_size"], 20)
    write_fp8_folders(tmp_path, block)
    (tmp_path / "whole").mkdir()
    shutil.copy(tmp_path / "fp8" / "model.safetensors", tmp_path / "whole" / "model.safetensors")
    fuse_fp8_experts(tmp_path / "fp8")
    from safetensors.torch import load_file

    fused = load_file(tmp_path / "fp8" / "model.safetensors")
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    mixed = {**fused, **{k: v for k, v in whole.items() if k.startswith(kept_per_expert) and ".experts." in k}}
    save_file(mixed, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    for dequantize in (False, True):
        with pytest.raises(ConversionError) as raised:
            convert_checkpoint(tmp_path / "fp8", tmp_path / "out", from_format="qwen3_next", to_format="hf",
                               dequantize_fp8=dequantize)
        message = str(raised.value)
        assert "two layouts" in message and re.search(r"experts\.(gate_up|down)_proj", message), message
        assert re.search(r"experts\.0\.(gate|up|down)_proj", message), message
        assert "\n" not in message and not (tmp_path / "out").exists()


def test_fused_fp8_experts_read_as_the_per_expert_layout(tmp_path):
    """Fused FP8 experts convert to the same tensors as the per-expert layout, dequantized and kept FP8. Block rows
    = I, so the gate and up scales stack without a block straddling both."""
    block = (TINY_MOE["moe_intermediate_size"], 20)
    write_fp8_folders(tmp_path, block)
    convert_checkpoint(tmp_path / "fp8", tmp_path / "per-expert", from_format="qwen3_next", to_format="hf")
    fuse_fp8_experts(tmp_path / "fp8")
    convert_checkpoint(tmp_path / "fp8", tmp_path / "hf", from_format="qwen3_next", to_format="hf",
                       dequantize_fp8=True)
    convert_checkpoint(tmp_path / "reference", tmp_path / "reference-hf", from_format="qwen3_next", to_format="hf")
    assert tensors_of(tmp_path / "hf") == tensors_of(tmp_path / "reference-hf")
    convert_checkpoint(tmp_path / "fp8", tmp_path / "kept", from_format="qwen3_next", to_format="hf")
    kept = tensors_of(tmp_path / "kept")
    assert kept == tensors_of(tmp_path / "per-expert")
    assert kept["model.layers.0.mlp.experts.gate_up_proj"][0] == FP8
