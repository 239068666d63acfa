"""Qwen3-Next's MTP head through the qwen3_next converter: `mtp.*` becomes our model's head (mtp_head.py), computes
what transformers' own Qwen3-Next classes compute for it, and goes back byte for byte; a head that is not the one the
config declares is refused by name.

The reference head is built from transformers' classes (Qwen3NextRMSNorm for the two pre-fc norms, a one-layer
Qwen3NextModel of full attention for the block, its rotary embedding and final norm), fed the hidden states of
transformers' own Qwen3NextForCausalLM: the math vLLM's Qwen3NextMultiTokenPredictor runs. Tolerance 1e-4 on logits of
order 1 in float32, as tests/test_convert_qwen3_next.py (the same math through different kernels: ~1e-6 measured).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from model_helpers import tiny_model
from test_convert_qwen3_next import (
    DENSE_CASES,
    LOGITS_TOLERANCE,
    assert_same_predictions,
    save_qwen3_next,
    tensors_of,
)
from transformers import Qwen3NextForCausalLM, Qwen3NextModel
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.qwen3_next.config import (
    qwen3_next_to_hybrid_config,
)
from hybrid_linear_models.conversion.safetensors_io import (
    SafetensorsFile,
    TensorInfo,
    plan_files,
    write_files,
)

MTP_FIELDS = {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}  # as the released config.json
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
       "mlp_only_layers": [1]}


def mtp_head_tensors(folder: Path, fields: dict, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tensors of a whole MTP head for the Qwen3-Next folder's config plus `fields`, named as the hub names
    them (a sparse layer's experts one by one)."""
    config, _ = qwen3_next_to_hybrid_config({**json.loads((folder / "config.json").read_text()), **fields}, "c")
    with torch.device("meta"):
        layout = HybridLinearForCausalLM(config).state_dict()
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, meta in layout.items():
        if not name.startswith("mtp."):
            continue
        value = torch.randn(meta.shape, generator=generator) * (0.1 if "norm" in name else 0.2)
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2I, H): per expert gate_proj, up_proj
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = value[e, :half].clone()
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = value[e, half:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                tensors[name.replace("down_proj", f"{e}.down_proj.weight")] = value[e].clone()
        else:
            tensors[name] = value
    return tensors


def add_to_folder(folder: Path, tensors: dict[str, torch.Tensor], fields: dict) -> None:
    """`tensors` in a shard of their own (the hub keeps mtp.* in the index), `fields` in config.json."""
    shard = "model-mtp.safetensors"
    infos = [(k, TensorInfo(tuple(t.shape), t.dtype)) for k, t in tensors.items()]
    plans = plan_files(infos, 10**9, lambda i, n: shard)
    write_files(folder, plans, tensors.items(), {"format": "pt"})
    (folder / "model.safetensors").rename(folder / "model-main.safetensors")
    main = SafetensorsFile(folder / "model-main.safetensors")
    weight_map = {**dict.fromkeys(main.keys(), "model-main.safetensors"), **dict.fromkeys(tensors, shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def qwen3_next_source(folder: Path, fields: dict = MTP_FIELDS, **overrides) -> tuple[Qwen3NextForCausalLM, dict]:
    theirs = save_qwen3_next(folder, **overrides)
    tensors = mtp_head_tensors(folder, fields)
    add_to_folder(folder, tensors, fields)
    return theirs, tensors


def reference_mtp_logits(theirs: Qwen3NextForCausalLM, head: dict[str, torch.Tensor], ids: torch.Tensor
                         ) -> torch.Tensor:
    """Depth-1 MTP logits at positions 0..T-2 from transformers' classes (see the module docstring)."""
    config = theirs.config
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        norms[name] = Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(head[f"mtp.{name}.weight"])
    block_config = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"],
                                   "mlp_only_layers": []})
    block = Qwen3NextModel(block_config).eval()
    weights = {f"layers.0.{k.removeprefix('mtp.layers.0.')}": v for k, v in head.items()
               if k.startswith("mtp.layers.0.")}
    missing, unexpected = block.load_state_dict({**weights, "norm.weight": head["mtp.norm.weight"]}, strict=False)
    assert set(missing) == {"embed_tokens.weight"} and not unexpected, (missing, unexpected)  # (inputs_embeds given)
    hidden = theirs(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
    embeddings = theirs.model.embed_tokens(ids)
    fused = torch.cat([norms["pre_fc_norm_embedding"](embeddings[:, 1:]), norms["pre_fc_norm_hidden"](hidden[:, :-1])],
                      dim=-1) @ head["mtp.fc.weight"].T
    positions = torch.arange(1, ids.shape[1]).unsqueeze(0)
    g = block(inputs_embeds=fused, position_ids=positions, use_cache=False).last_hidden_state
    return theirs.lm_head(g)


def our_mtp_logits(ours: HybridLinearForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    hidden = ours.model(ids).last_hidden_state
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    return ours.lm_head(ours.mtp.depths(hidden, ours.model.embed_tokens(ids), positions)[0])


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_the_head_converts_with_transformers_math_and_back_bit_for_bit(tmp_path, case):
    overrides = DENSE_CASES["ratio_4"] if case == "dense" else MOE
    theirs, head = qwen3_next_source(tmp_path / "source", **overrides)
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    assert not (tmp_path / "hf" / "extra_tensors.safetensors").exists()  # (the head is the model's own)
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    ours.eval()
    assert ours.config.num_mtp_layers == 1
    assert ours.config.mtp_mlp_type == ("sparse_moe" if case == "moe" else "dense")
    assert_same_predictions(theirs, ours, 96)
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if case == "dense":  # (the reference's one-layer model takes a dense block; the MoE block is the same class)
            expected = reference_mtp_logits(theirs, head, ids)
            got = our_mtp_logits(ours, ids)
            assert (expected - got).abs().max() <= LOGITS_TOLERANCE and expected.abs().max() > 0.1
        assert torch.isfinite(our_mtp_logits(ours, ids)).all()
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="qwen3_next")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "source")  # the head included, byte for byte
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {name: written[name] for name in MTP_FIELDS} == MTP_FIELDS
    again, info = Qwen3NextForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"]
    assert_same_predictions(theirs, again.eval(), 96)


def test_a_carried_head_loads_into_a_model_built_with_mtp_layers(tmp_path):
    """A head stored beside a config that declares no MTP layers converts carried (extra_tensors.safetensors);
    from_pretrained(num_mtp_layers=1) then loads that head, not a fresh one, and its logits are the reference's."""
    theirs = save_qwen3_next(tmp_path / "source", **DENSE_CASES["ratio_4"])
    head = mtp_head_tensors(tmp_path / "source", MTP_FIELDS)
    add_to_folder(tmp_path / "source", head, {"mtp_use_dedicated_embeddings": False})  # (no layer count)
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    assert (tmp_path / "hf" / "extra_tensors.safetensors").is_file()
    assert getattr(HybridLinearForCausalLM.from_pretrained(tmp_path / "hf"), "mtp", None) is None  # (not built)
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", num_mtp_layers=1, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = reference_mtp_logits(theirs, head, ids), our_mtp_logits(ours.eval(), ids)
    assert (expected - got).abs().max() <= LOGITS_TOLERANCE and expected.abs().max() > 0.1


def test_a_carried_sparse_head_is_not_loaded_and_says_so(tmp_path, caplog):
    """A carried head whose experts are stored one by one (the hub's layout) is not the model's (stacked experts):
    the model's head is fresh, with one warning line naming the file and the fix."""
    save_qwen3_next(tmp_path / "source", **{**DENSE_CASES["ratio_4"], **MOE})
    add_to_folder(tmp_path / "source", mtp_head_tensors(tmp_path / "source", MTP_FIELDS),
                  {"mtp_use_dedicated_embeddings": False})
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    with caplog.at_level(logging.WARNING, logger="hybrid_linear_models.mtp_head"):
        HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", num_mtp_layers=1)
    [line] = [r.getMessage() for r in caplog.records if r.name == "hybrid_linear_models.mtp_head"]
    assert "extra_tensors.safetensors carries an MTP head" in line and "mtp_num_hidden_layers" in line


def test_the_other_name_of_the_layer_count_reads_the_same(tmp_path):
    qwen3_next_source(tmp_path / "source", fields={"num_nextn_predict_layers": 1}, **DENSE_CASES["ratio_4"])
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    assert HybridLinearForCausalLM.from_pretrained(tmp_path / "hf").config.num_mtp_layers == 1


def test_a_config_with_mtp_layers_but_no_stored_head_converts_without_it(tmp_path, caplog):
    """(transformers' save_pretrained of Qwen3NextForCausalLM writes such a folder) converted, with one notice."""
    save_qwen3_next(tmp_path / "source", **DENSE_CASES["ratio_4"])
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    (tmp_path / "source" / "config.json").write_text(json.dumps({**config, **MTP_FIELDS}))
    with caplog.at_level(logging.WARNING, logger="hybrid_linear_models.conversion"):
        convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    assert HybridLinearForCausalLM.from_pretrained(tmp_path / "hf").config.num_mtp_layers == 0
    [notice] = [record.getMessage() for record in caplog.records if "MTP layer" in record.getMessage()]
    assert "declares 1 MTP layer(s) but no mtp.* tensor is stored" in notice and "\n" not in notice


@pytest.mark.parametrize("change, fragment", [
    ("drop_norm", r"not that head \(missing mtp\.norm\.weight\)"),
    ("extra", r"not that head \(unexpected mtp\.layers\.1\.input_layernorm\.weight\)"),
    ("dedicated", r"mtp_use_dedicated_embeddings is true"),
    ("disagree", r"mtp_num_hidden_layers \(1\) and num_nextn_predict_layers \(2\) disagree"),
    ("unknown", r"field\(s\) \['mtp_loss_scale'\] are not Qwen3-Next MTP settings"),
    ("too_many", r"mtp_num_hidden_layers"),
])
def test_a_head_other_than_the_declared_one_is_refused_by_name(tmp_path, change, fragment):
    save_qwen3_next(tmp_path / "source", **DENSE_CASES["ratio_4"])
    tensors, fields = mtp_head_tensors(tmp_path / "source", MTP_FIELDS), dict(MTP_FIELDS)
    if change == "drop_norm":
        del tensors["mtp.norm.weight"]
    elif change == "extra":
        tensors["mtp.layers.1.input_layernorm.weight"] = torch.zeros(32)
    elif change == "dedicated":
        fields["mtp_use_dedicated_embeddings"] = True
    elif change == "disagree":
        fields["num_nextn_predict_layers"] = 2
    elif change == "unknown":
        fields["mtp_loss_scale"] = 0.3
    elif change == "too_many":
        fields["mtp_num_hidden_layers"] = 10**6
    add_to_folder(tmp_path / "source", tensors, fields)
    with pytest.raises(ConversionError, match=fragment) as caught:
        convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("to_format", ["fast_llm", "apriel2", "fla"])
def test_a_model_with_the_head_is_refused_by_formats_without_one(tmp_path, to_format):
    """A model those formats fit but for its MTP head: refused by name, nothing written (never dropped)."""
    tiny_model(["gated_deltanet", "full_attention"], num_mtp_layers=1, zero_centered_norms=False,
               attention_output_gate=False, attention_qk_norm=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
               ).save_pretrained(tmp_path / "hf")
    refusal = (r"has 1 multi-token-prediction layer\(s\) of mtp_type 'qwen3_next' \(mtp\..*cannot hold"  # (no MTP head)
               r"|1 MTP layer\(s\) of mtp_type 'qwen3_next' \(Fast-LLM's MTP heads are copies")  # (another kind)
    with pytest.raises(ConversionError, match=refusal) as caught:
        convert_checkpoint(tmp_path / "hf", tmp_path / to_format, from_format="hf", to_format=to_format)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / to_format).exists()
