"""The readers bound a config's sizes by the stored weights only where a stored tensor has that size: valid tiny
checkpoints that transformers' own classes build and load convert, whatever their unused sizes say.

Each case is a tiny model built by transformers (Qwen3NextForCausalLM, KimiLinearForCausalLM) and saved by its
save_pretrained, with a size no stored tensor has set above the number of weight elements: transformers' default
max_position_embeddings (rotary angles are computed, no tensor holds positions), or a size of a mixer or MLP that no
layer runs. Each converts to our format and back, every weight unchanged; a size a tensor does have stays bounded
(the hardening tests of each reader refuse a hidden_size of 10^12 by name).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import randomize
from test_convert_kimi_linear import MLA, MOE, as_hub_layout, tiny_kimi_config
from test_convert_qwen3_next import tensors_of
from transformers import KimiLinearForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from hybrid_linear_models.conversion import convert_checkpoint

# a Qwen3-Next of about 1700 weights: one GDN and one attention layer of width 8
TINY_QWEN3_NEXT = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=1,
                       linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0,
                       layer_types=["linear_attention", "full_attention"])
HUGE = 10**6  # more than the weights of every model here
QWEN3_NEXT_CASES = {
    "default_positions": {},  # max_position_embeddings left at transformers' 32768
    "no_attention_layer": dict(layer_types=["linear_attention"] * 2, num_attention_heads=HUGE,
                               num_key_value_heads=HUGE, head_dim=HUGE),
    "no_gdn_layer": dict(layer_types=["full_attention"] * 2, linear_num_key_heads=HUGE,
                         linear_num_value_heads=HUGE, linear_key_head_dim=HUGE, linear_value_head_dim=HUGE,
                         linear_conv_kernel_dim=HUGE),
    "no_dense_mlp": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4,
                         shared_expert_intermediate_size=4, intermediate_size=HUGE),
}
KIMI_CASES = {
    "no_dense_mlp": dict(layers=2, **{**MOE, "first_k_dense_replace": 0}, intermediate_size=HUGE),
    "no_kda_layer": dict(layers=2, full_attn_layers=(1, 2), **MLA, kda_heads=HUGE, kda_head_dim=HUGE),
}


def saved(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) < HUGE
    return folder


def assert_converts_both_ways(folder: Path, fmt: str, tmp_path: Path) -> None:
    ours = convert_checkpoint(folder, tmp_path / "hf", from_format=fmt, to_format="hf").destination
    back = convert_checkpoint(ours, tmp_path / "back", from_format="hf", to_format=fmt).destination
    assert tensors_of(back) == tensors_of(folder)


@pytest.mark.parametrize("case", sorted(QWEN3_NEXT_CASES))
def test_qwen3_next_sizes_that_size_no_tensor_are_not_bounded(tmp_path, case):
    config = Qwen3NextConfig(**{**TINY_QWEN3_NEXT, **QWEN3_NEXT_CASES[case]})
    torch.manual_seed(0)
    folder = saved(randomize(Qwen3NextForCausalLM(config), 0), tmp_path / "qwen3_next")
    assert_converts_both_ways(folder, "qwen3_next", tmp_path)


@pytest.mark.parametrize("case", sorted(KIMI_CASES))
def test_kimi_linear_sizes_that_size_no_tensor_are_not_bounded(tmp_path, case):
    torch.manual_seed(0)
    folder = saved(randomize(KimiLinearForCausalLM(tiny_kimi_config(**KIMI_CASES[case])), 0), tmp_path / "kimi")
    as_hub_layout(folder)  # the layout the writer writes, for the comparison
    assert_converts_both_ways(folder, "kimi_linear", tmp_path)
