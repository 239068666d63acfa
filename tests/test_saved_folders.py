"""Folders saved by earlier versions of this package load unchanged: the config gives the same model and the same
logits (float32, recorded when the folder was saved; the tolerance only covers summation-order changes of the
kernels since)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM

SAVED = Path(__file__).parent / "fixtures" / "saved_models"


@pytest.mark.parametrize("folder", sorted(p.name for p in SAVED.iterdir()))
def test_a_folder_saved_by_an_earlier_version_loads_with_its_logits(folder, tmp_path):
    path = SAVED / folder
    model = HybridLinearForCausalLM.from_pretrained(path).eval()
    reference = load_file(path / "reference_logits.safetensors")
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)
    # and saves back to a config that reads as the same config
    model.save_pretrained(tmp_path)
    saved, loaded = HybridLinearConfig.from_pretrained(tmp_path).to_dict(), model.config.to_dict()
    for entry in (saved, loaded):
        entry.pop("_name_or_path")  # where it was loaded from
    assert saved == loaded


def test_transformers_generic_config_reads_an_earlier_folder_once_saved_again(tmp_path):
    """Trainer reads a checkpoint's config.json with the generic PreTrainedConfig when it resumes (and AutoTokenizer
    falls back to it). A folder saved by an earlier version names its mixers in layer_types, which that config's
    check refuses; this package loads it, and saves it in transformers' words, which the generic config reads."""
    from transformers import PreTrainedConfig

    HybridLinearConfig.from_pretrained(SAVED / "tiny_hybrid_v0_1").save_pretrained(tmp_path)
    config = PreTrainedConfig.from_json_file(str(tmp_path / "config.json"))
    assert config.layer_types == ["linear_attention", "linear_attention", "sliding_attention", "full_attention"]
    assert config.mixer_types == ["gated_deltanet", "kimi_delta_attention", "sliding_attention", "full_attention"]
