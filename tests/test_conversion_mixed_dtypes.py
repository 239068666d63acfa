"""Checkpoints that store their tensors in different dtypes convert without losing a value.

Tensors that one output tensor is made of (the experts stacked into Qwen3-Next's and Kimi-Linear's gate_up_proj,
fla's projections and convolutions joined into in_proj_qkvz, in_proj_ba and conv1d, our k_proj and v_proj joined
into Fast-LLM's key_value) are joined in the widest of their dtypes; each written tensor takes --dtype, or else that
widest dtype, in one cast that refuses to make a finite value infinite, naming the tensor.

The reference is independent of the dtype rules: the same stored values, every tensor widened to float64 (exact),
converted by the same pure data movement. A conversion of the mixed source must give exactly those values, and a
cast to --dtype float16 exactly the float64 reference's values rounded once to float16 (or a refusal naming a tensor
when one holds a value beyond float16's range).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conversion_helpers import FAST_LLM_FIXTURES
from fuzz_strategies import FUZZ_SETTINGS, per_tensor_dtypes
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_convert_fla import GDN_CASES, fla_config, fla_tensors, write_fla_checkpoint
from test_convert_kimi_linear import MOE_CASES, save_kimi_moe
from test_convert_qwen3_next import save_qwen3_next

from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.formats import get_format
from hybrid_linear_models.conversion.pipeline import plan_conversion, stream_tensors

FIXTURE = FAST_LLM_FIXTURES / "hybrid_attn_gdn_kda"
QWEN3_NEXT_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16)
BEYOND_FLOAT16 = 1e6  # float16's largest value is 65504


def build_sources(root: Path) -> dict[str, Path]:
    """One small checkpoint per readable format, float32 throughout, each in its own folder."""
    sources = {"fast_llm": Path(shutil.copytree(FIXTURE / "fast_llm", root / "fast_llm")),
               "apriel2": Path(shutil.copytree(FIXTURE / "apriel2_text", root / "apriel2"))}
    sources["hf"] = convert_checkpoint(FIXTURE / "fast_llm", root / "hf", from_format="fast_llm",
                                       to_format="hf").destination
    config = fla_config("gated_deltanet", **json.loads(json.dumps(GDN_CASES["gdn_attn_gva_expand"])))
    sources["fla"] = write_fla_checkpoint(root / "fla", config, fla_tensors(config))
    save_qwen3_next(root / "qwen3_next", **QWEN3_NEXT_MOE)
    sources["qwen3_next"] = root / "qwen3_next"
    save_kimi_moe(root / "kimi_linear", **MOE_CASES["grouped"])
    sources["kimi_linear"] = root / "kimi_linear"
    return sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return build_sources(tmp_path_factory.mktemp("mixed_dtypes"))


def stored(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every safetensors file of `folder`: {file name: {tensor name: tensor}}."""
    return {path.name: load_file(path) for path in sorted(folder.glob("*.safetensors"))}


def restore(folder: Path, files: dict[str, dict[str, torch.Tensor]], original: Path) -> None:
    """Writes `files` into `folder` (a copy of `original`), each with its original safetensors metadata."""
    for name, tensors in files.items():
        with safe_open(original / name, "pt") as handle:
            metadata = handle.metadata()
        save_file({key: tensor.contiguous() for key, tensor in tensors.items()}, folder / name, metadata=metadata)


def converted(folder: Path, from_format: str, to_format: str, dtype: torch.dtype | None = None
              ) -> dict[str, torch.Tensor]:
    """What a conversion writes, in memory: every target tensor as streamed into the output files, each in the
    dtype the plan writes into the files' headers."""
    source = get_format(from_format, "read").read(folder)
    plan = plan_conversion(source, get_format(to_format, "write").target_rows(source.config), dtype)
    written = dict(stream_tensors(plan))
    for key, info in plan.targets:
        assert written[key].dtype == info.dtype, (key, written[key].dtype, info.dtype)
    return written


def assert_same_values(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert got.keys() == reference.keys()
    for key, tensor in got.items():
        assert torch.equal(tensor.double(), reference[key].double()), key


def edited_copy(original: Path, folder: Path, edit) -> Path:
    """A copy of `original` whose tensors `edit(tensors)` changed (tensors by name, over all its files)."""
    folder = Path(shutil.copytree(original, folder))
    files = stored(folder)
    merged = {key: tensor for tensors in files.values() for key, tensor in tensors.items()}
    edit(merged)
    restore(folder, {name: {key: merged[key] for key in tensors} for name, tensors in files.items()}, original)
    return folder


# ------------------------------------------------------------------------------ experts of different dtypes

EXPERTS = {  # format: (expert e's gate projection in layer 1, the stacked tensor it goes to in ours)
    "qwen3_next": ("model.layers.1.mlp.experts.{e}.gate_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"),
    "kimi_linear": ("model.layers.1.block_sparse_moe.experts.{e}.w1.weight",
                    "model.layers.1.mlp.experts.gate_up_proj"),
}


def experts_in(first: torch.dtype, value: float):
    """Every tensor of expert 0 (layer 1) in `first`; expert 1's gate, float32, holds `value` at [0, 0]."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            if ".experts.0." in key and key.startswith("model.layers.1."):
                tensors[key] = tensors[key].to(first)
        gate = next(key for key in tensors if key.startswith("model.layers.1.") and ".experts.1." in key
                    and key.endswith(("gate_proj.weight", "w1.weight")))
        tensors[gate] = tensors[gate].float()
        tensors[gate][0, 0] = value
    return edit


@pytest.mark.parametrize("fmt", sorted(EXPERTS))
def test_experts_of_mixed_dtypes_keep_every_value(tmp_path, sources, fmt):
    expert_key, stacked_key = EXPERTS[fmt]
    folder = edited_copy(sources[fmt], tmp_path / "src", experts_in(torch.bfloat16, 1.0000001))
    assert load_file(folder / "model.safetensors")[expert_key.format(e=0)].dtype == torch.bfloat16
    for dtype in ("float32", None):  # asked for, or the widest stored
        out = convert_checkpoint(folder, tmp_path / f"hf_{dtype}", from_format=fmt, to_format="hf",
                                 dtype=dtype).destination
        stacked = load_file(out / "model.safetensors")[stacked_key]
        assert stacked.dtype == torch.float32
        assert stacked[1, 0, 0].item() == torch.tensor(1.0000001).item() != 1.0
        rows = load_file(folder / "model.safetensors")[expert_key.format(e=0)].shape[0]
        assert torch.equal(stacked[0, :rows], load_file(folder / "model.safetensors")[expert_key.format(e=0)].float())


@pytest.mark.parametrize("fmt", sorted(EXPERTS))
def test_a_value_beyond_the_narrower_expert_dtype_is_kept_or_refused_by_name(tmp_path, sources, fmt):
    stacked_key = EXPERTS[fmt][1]
    folder = edited_copy(sources[fmt], tmp_path / "src", experts_in(torch.float16, BEYOND_FLOAT16))
    out = convert_checkpoint(folder, tmp_path / "hf", from_format=fmt, to_format="hf").destination
    assert load_file(out / "model.safetensors")[stacked_key][1, 0, 0].item() == BEYOND_FLOAT16
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(folder, tmp_path / "hf16", from_format=fmt, to_format="hf", dtype="float16")
    message = str(caught.value)
    assert "\n" not in message and stacked_key in message and "1e+06" in message, message
    assert "float16's largest value 65504" in message, message
    assert not (tmp_path / "hf16").exists()


# ------------------------------------------------------------------------------ joined projections


@pytest.mark.parametrize("name", ["q_proj", "b_proj", "q_conv1d"])
def test_fla_projection_joined_from_mixed_dtypes_converts_exactly(tmp_path, sources, name):
    """Layer 0's `name` in bfloat16 beside float32 parts: joined exactly, and back to fla with every value."""
    key = f"model.layers.0.attn.{name}.weight"
    folder = edited_copy(sources["fla"], tmp_path / "src", lambda t: t.update({key: t[key].bfloat16()}))
    out = convert_checkpoint(folder, tmp_path / "hf", from_format="fla", to_format="hf").destination
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.float32}
    back = convert_checkpoint(out, tmp_path / "back", from_format="hf", to_format="fla").destination
    assert_same_values(load_file(back / "model.safetensors"), load_file(folder / "model.safetensors"))


def test_halves_joined_for_fast_llm_from_mixed_dtypes_convert_exactly(tmp_path, sources):
    """Our k_proj in bfloat16 and v_proj in float32 make Fast-LLM's key_value exactly, in float32."""
    key = "model.layers.0.self_attn.k_proj.weight"
    folder = edited_copy(sources["hf"], tmp_path / "src", lambda t: t.update({key: t[key].bfloat16()}))
    stored_tensors = load_file(folder / "model.safetensors")
    out = convert_checkpoint(folder, tmp_path / "fast_llm", from_format="hf", to_format="fast_llm").destination
    key_value = load_file(out / "model_0.safetensors")["decoder.0.mixer.key_value.weight/weights"]
    assert key_value.dtype == torch.float32
    assert torch.equal(key_value, torch.cat([stored_tensors[key].float(),
                                             stored_tensors["model.layers.0.self_attn.v_proj.weight"]]))


# ------------------------------------------------------------------------------ property: any mix of dtypes

TARGETS = {"fast_llm": ("hf",), "hf": ("hf", "fast_llm"), "fla": ("hf", "fla"), "apriel2": ("hf",),
           "qwen3_next": ("hf", "qwen3_next"), "kimi_linear": ("hf", "kimi_linear")}


class Workspace:
    """A format's folder for the mixed source, one for its float64 twin, and the original tensors."""

    def __init__(self, fmt: str, original: Path, root: Path):
        self.fmt, self.original, self.files = fmt, original, stored(original)
        self.mixed = Path(shutil.copytree(original, root / f"{fmt}_mixed"))
        self.wide = Path(shutil.copytree(original, root / f"{fmt}_64"))

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"Workspace({self.fmt})"


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory, sources) -> dict[str, Workspace]:
    root = tmp_path_factory.mktemp("mixed_work")
    return {fmt: Workspace(fmt, path, root) for fmt, path in sources.items()}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(TARGETS))
@settings(FUZZ_SETTINGS, max_examples=4)
@given(data=st.data())
def test_any_mix_of_stored_dtypes_converts_to_the_exact_values(workspaces, fmt, data):
    work = workspaces[fmt]
    mixed, wide, files = work.mixed, work.wide, work.files
    names = sorted(key for tensors in files.values() for key in tensors)
    dtypes = dict(zip(names, data.draw(per_tensor_dtypes(len(names)))))
    beyond = data.draw(st.booleans())  # a value beyond float16's range in every tensor wide enough to hold one
    mixed_files = {}
    for name, tensors in files.items():
        mixed_files[name] = {}
        for key, tensor in tensors.items():
            tensor = tensor.to(dtypes[key], copy=True)  # the originals stay as stored
            if beyond and dtypes[key] != torch.float16 and tensor.numel():
                tensor.view(-1)[0] = BEYOND_FLOAT16
            mixed_files[name][key] = tensor
    restore(mixed, mixed_files, work.original)
    restore(wide, {name: {key: t.double() for key, t in tensors.items()} for name, tensors in mixed_files.items()},
            work.original)
    for target in TARGETS[fmt]:
        reference = converted(wide, fmt, target)
        assert_same_values(converted(mixed, fmt, target), reference)  # nothing narrowed, nothing lost
        try:
            as_float16 = converted(mixed, fmt, target, torch.float16)
        except ConversionError as error:
            assert beyond and "\n" not in str(error) and "beyond float16's largest value" in str(error), error
            continue
        assert_same_values(as_float16, {key: t.half() for key, t in reference.items()})
