"""Fast-LLM checkpoints with multi-token-prediction heads (tests/fixtures/fast_llm_mtp: written by Fast-LLM itself,
with the logits of every head from Fast-LLM's own forward): `--from fast_llm` and `--from fast_llm_distributed` give
a model whose next-token logits and MTP heads' logits are Fast-LLM's, `--to fast_llm` writes the same tensors back
bit for bit, and the converted model drafts for `generate(use_mtp=...)`.

The fixtures cover the kinds of last block (GDN and KDA, whose heads carry recurrent states, and attention), a head
block with a mixture-of-experts MLP, and both output-weight settings (untied; tied to the embeddings, where no head's
output weight is stored).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conversion_helpers import FIXTURE_LOGITS_TOLERANCE as TOLERANCE
from conversion_helpers import load_tensors
from model_helpers import tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hybrid_linear_models  # noqa: F401  (registers the Auto classes)
from hybrid_linear_models.conversion import convert_checkpoint
from hybrid_linear_models.conversion.errors import ConversionError

FIXTURES = Path(__file__).parent / "fixtures" / "fast_llm_mtp"
# Fast-LLM's prediction_heads (the next-token one too)
FIXTURE_HEADS = {"gdn_last_mtp3": 3, "attn_last_mtp2": 2, "kda_moe_last_mtp2": 2}
READERS = {"fast_llm": "fast_llm", "distributed": "fast_llm_distributed"}  # fixture folder -> --from


def _reference(fixture: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / fixture / "reference_logits.safetensors")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exported")
    return {name: convert_checkpoint(FIXTURES / name / "fast_llm", root / name, from_format="fast_llm",
                                     to_format="hf").destination for name in FIXTURE_HEADS}


def _every_heads_logits(folder: Path, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The next-token logits, then each MTP head's (head d at position t predicting token t + d + 1)."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)
        trunk = out.hidden_states[model.config.num_hidden_layers - 1]  # the last decoder layer's input
        heads = model.mtp(trunk, torch.arange(input_ids.shape[1]).unsqueeze(0))
        return [out.logits.float()] + [model.lm_head(g).float() for g in heads]


@pytest.mark.parametrize("fixture", sorted(FIXTURE_HEADS))
@pytest.mark.parametrize("folder", sorted(READERS))
def test_every_heads_logits_are_fast_llms(tmp_path, fixture, folder):
    converted = convert_checkpoint(FIXTURES / fixture / folder, tmp_path / "hf", from_format=READERS[folder],
                                   to_format="hf").destination
    ref = _reference(fixture)
    logits = _every_heads_logits(converted, ref["input_ids"])
    expected = [ref["logits"]] + [ref[f"mtp_logits.{d}"] for d in range(2, FIXTURE_HEADS[fixture] + 1)]
    assert len(logits) == len(expected)
    for distance, (got, want) in enumerate(zip(logits, expected), start=1):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= TOLERANCE, distance


def test_swapped_head_norms_break_the_logits(tmp_path, exported):
    """Negative control: the two heads' norms swapped move their logits far past the tolerance, so the comparison
    above pins which stored norm is which head's."""
    tensors = load_tensors(exported["gdn_last_mtp3"])
    model = AutoModelForCausalLM.from_pretrained(exported["gdn_last_mtp3"]).eval()
    with torch.no_grad():
        model.mtp.norms[0].weight.copy_(tensors["mtp.norms.1.weight"])
        model.mtp.norms[1].weight.copy_(tensors["mtp.norms.0.weight"])
        ref = _reference("gdn_last_mtp3")
        trunk = model(ref["input_ids"], output_hidden_states=True).hidden_states[3]
        g = model.mtp(trunk, torch.arange(24).unsqueeze(0))[0]
    assert (model.lm_head(g) - ref["mtp_logits.2"]).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("fixture", sorted(FIXTURE_HEADS))
def test_the_config_names_the_heads(exported, fixture):
    config = AutoModelForCausalLM.from_pretrained(exported[fixture]).config
    assert (config.num_mtp_layers, config.mtp_type) == (FIXTURE_HEADS[fixture] - 1, "fast_llm")
    assert config.mtp_mlp_type == config.mlp_types[-1]


@pytest.mark.parametrize("fixture", sorted(FIXTURE_HEADS))
def test_writing_fast_llm_gives_fast_llms_tensors_back_bit_for_bit(tmp_path, exported, fixture):
    written = convert_checkpoint(exported[fixture], tmp_path / "fl", from_format="hf",
                                 to_format="fast_llm").destination
    original, again = load_tensors(FIXTURES / fixture / "fast_llm"), load_tensors(written)
    assert sorted(again) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name
    head = yaml.safe_load((written / "metadata.yaml").read_text())["config"]["base_model"]["head"]
    assert head["prediction_heads"] == FIXTURE_HEADS[fixture]


@pytest.mark.parametrize("fixture", sorted(FIXTURE_HEADS))
def test_the_converted_heads_draft_for_generate(exported, fixture):
    model = AutoModelForCausalLM.from_pretrained(exported[fixture]).eval()
    ids = _reference(fixture)["input_ids"][:1, :10]
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=8, do_sample=False)
        drafted = model.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True)
    assert torch.equal(drafted, plain)


@pytest.mark.parametrize("heads, fragment", [
    (0, "config.base_model.head.prediction_heads should be an integer >= 1, got an integer 0"),
    (2, "multi_token_prediction.blocks.1."),  # stored blocks the config does not account for
    (4, "multi_token_prediction.blocks.2."),  # blocks the config requires and the checkpoint lacks
])
def test_a_head_count_that_does_not_match_the_tensors_is_refused(tmp_path, heads, fragment):
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "gdn_last_mtp3" / "fast_llm", source)
    metadata = yaml.safe_load((source / "metadata.yaml").read_text())
    metadata["config"]["base_model"]["head"]["prediction_heads"] = heads
    (source / "metadata.yaml").write_text(yaml.safe_dump(metadata))
    result = subprocess.run([sys.executable, "-m", "hybrid_linear_models.conversion", "--from", "fast_llm", "--to",
                             "hf", str(source), str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode != 0 and fragment in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("coefficients, said", [
    ([1.0, 1.0, 1.0], "pass mtp_loss_weight=2."),  # (Fast-LLM's default: the heads' losses summed)
    ([1.0, 0.5, 0.25], "pass mtp_loss_weight=0.75 (the same total weight; the heads' own weights are not kept)."),
])
def test_the_heads_loss_coefficients_are_named_with_the_weight_that_trains_as_fast_llm(tmp_path, caplog,
                                                                                      coefficients, said):
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "gdn_last_mtp3" / "fast_llm", source)
    metadata = yaml.safe_load((source / "metadata.yaml").read_text())
    metadata["config"]["base_model"]["head"]["prediction_loss_coefficient"] = coefficients
    (source / "metadata.yaml").write_text(yaml.safe_dump(metadata))
    with caplog.at_level("WARNING"):
        convert_checkpoint(source, tmp_path / "hf", from_format="fast_llm", to_format="hf")
    lines = [r.getMessage() for r in caplog.records if "prediction_loss_coefficient" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(said), lines


@pytest.mark.parametrize("coefficients", [[1.0, 1.0], [1.0, -1.0, 1.0], [0.0, 1.0, 1.0], "1,1,1", [1.0, True, 1.0]])
def test_bad_loss_coefficients_are_refused(tmp_path, coefficients):
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "gdn_last_mtp3" / "fast_llm", source)
    metadata = yaml.safe_load((source / "metadata.yaml").read_text())
    metadata["config"]["base_model"]["head"]["prediction_loss_coefficient"] = coefficients
    (source / "metadata.yaml").write_text(yaml.safe_dump(metadata))
    with pytest.raises(ConversionError, match=r"prediction_loss_coefficient is .* list of 3 finite weights >= 0"):
        convert_checkpoint(source, tmp_path / "hf", from_format="fast_llm", to_format="hf")
    assert not (tmp_path / "hf").exists()


def test_heads_of_another_kind_are_refused_by_each_writer(tmp_path, exported):
    """A Fast-LLM head into Qwen3-Next's layout (whose MTP layer fuses the next token's embedding) is refused, and
    so is a format without MTP heads, each naming the formats that keep them."""
    result = subprocess.run([sys.executable, "-m", "hybrid_linear_models.conversion", "--from", "hf", "--to",
                             "apriel2", str(exported["gdn_last_mtp3"]), str(tmp_path / "a2")],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0 and "of mtp_type 'fast_llm'" in result.stderr
    assert "convert it to the hf or fast_llm format instead" in result.stderr
    qwen3_next_like = tiny_model(["gated_deltanet", "full_attention"], num_mtp_layers=1, mtp_type="fast_llm",
                                 gdn_value_head_dim=16)  # (this family's defaults are Qwen3-Next's)
    qwen3_next_like.save_pretrained(tmp_path / "hf")
    result = subprocess.run([sys.executable, "-m", "hybrid_linear_models.conversion", "--from", "hf", "--to",
                             "qwen3_next", str(tmp_path / "hf"), str(tmp_path / "q")],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0 and "MTP layer(s) are of mtp_type 'fast_llm'" in result.stderr, result.stderr
    assert "the fast_llm format keeps them" in result.stderr and not (tmp_path / "q").exists()
