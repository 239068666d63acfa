"""When the package's Triton kernels autotune (kernel_tuning): only inside `autotuning()` (which `warm_up` enters) or
for a key tuned earlier in the process; elsewhere the kernel runs its default configuration as it is, so no first
call times a dozen configurations. The kernels are stood in by recorders (no triton needed), and the FP8 warm-up
prompts are checked against the row-tile bounds they must cross."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import tiny_config

from hybrid_linear_models import HybridLinearForCausalLM, kernel_tuning, warm_up
from hybrid_linear_models.fp8_kernel_contract import TILE_ROW_BOUNDS
from hybrid_linear_models.fp8_layers import fp8_tuning_prompt_lengths


class Recorder:
    """A stand-in for a triton kernel or Autotuner: `obj[grid](*args, **kwargs)` records (name, grid, kwargs)."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, grid, kwargs))


class Config:
    """triton.Config's all_kwargs, the part `launch` uses."""

    def all_kwargs(self) -> dict:
        return {"BLOCK_N": 8, "num_warps": 4}


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(kernel_tuning, "_tuned", set())
    monkeypatch.delenv("HYBRID_LINEAR_AUTOTUNE", raising=False)
    calls: list = []

    def run(key: tuple, x: torch.Tensor) -> str:
        kernel_tuning.launch(Recorder("autotuner", calls), Recorder("kernel", calls), lambda meta: (meta["BLOCK_N"],),
                             key, Config(), (x, 3), {"FLAG": True})
        return calls[-1][0]

    return run, calls


def test_outside_autotuning_the_default_configuration_runs(stand_ins):
    run, calls = stand_ins
    assert run(("k", 1), torch.zeros(2)) == "kernel"
    assert calls[-1] == ("kernel", (8,), {"FLAG": True, "BLOCK_N": 8, "num_warps": 4})  # the grid of its meta


def test_inside_autotuning_a_key_is_tuned_and_stays_tuned(stand_ins):
    run, calls = stand_ins
    with kernel_tuning.autotuning():
        assert kernel_tuning.autotuning_active()
        assert run(("k", 1), torch.zeros(2)) == "autotuner"
        assert calls[-1][2] == {"FLAG": True}  # the autotuner adds its configuration's
    assert not kernel_tuning.autotuning_active()
    assert run(("k", 1), torch.zeros(2)) == "autotuner"  # tuned in this process: its choice serves
    assert run(("k", 2), torch.zeros(2)) == "kernel"  # another shape
    assert run(("k", 1), torch.zeros(2, dtype=torch.float64)) == "kernel"  # another dtype: triton's key differs


def test_the_environment_variable_tunes_every_call(stand_ins, monkeypatch):
    run, _ = stand_ins
    monkeypatch.setenv("HYBRID_LINEAR_AUTOTUNE", "1")
    assert run(("k", 3), torch.zeros(2)) == "autotuner"


def test_warm_up_tunes_and_runs_the_fp8_tile_prompts(monkeypatch):
    """Every generate call of warm_up runs inside autotuning(), and its prompts include the FP8 tile lengths."""
    model = _fp8_moe_model()
    seen = []

    def generate(ids, **kwargs):
        seen.append((ids.shape[-1], kernel_tuning.autotuning_active()))

    monkeypatch.setattr(model, "generate", generate)
    monkeypatch.setattr(warm_up, "compiles_kernels_on", lambda device: True)  # (as on a GPU: the CPU tunes nothing)
    warm_up.warm_up(model, max_length=400, verbose=False)
    assert seen and all(active for _, active in seen)
    assert set(fp8_tuning_prompt_lengths(model)) <= {length for length, _ in seen}
    assert not kernel_tuning.autotuning_active()


def test_fp8_tile_prompts_cross_each_bound():
    """The experts' lengths are the shortest prompts whose routes per expert average past each bound (the grouped
    product's rows per expert, ceil(routes / experts), picks the tile); a prompt of TILE_ROW_BOUNDS[0] tokens serves the
    dense layers' small-row form. A model without FP8 weights has none."""
    experts, top_k = 8, 3
    lengths = fp8_tuning_prompt_lengths(_fp8_moe_model(num_experts=experts, num_experts_per_tok=top_k))
    per_expert = [math.ceil(n * top_k / experts) for n in lengths]
    assert lengths[0] == TILE_ROW_BOUNDS[0]
    for bound in TILE_ROW_BOUNDS:
        first = min(n for n in lengths[1:] if math.ceil(n * top_k / experts) > bound)
        assert math.ceil((first - 1) * top_k / experts) <= bound  # the shortest such prompt
    assert len(per_expert) == 1 + len(TILE_ROW_BOUNDS)
    assert fp8_tuning_prompt_lengths(HybridLinearForCausalLM(tiny_config(["gated_deltanet"]))) == []


def _fp8_moe_model(num_experts: int = 8, num_experts_per_tok: int = 2) -> HybridLinearForCausalLM:
    config = tiny_config(["gated_deltanet", "full_attention"], mlp_types=["sparse_moe", "kimi_moe"],
                         quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]},
                         num_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    return HybridLinearForCausalLM(config).eval()


def test_stand_in_config_matches_triton_where_installed():
    """Where triton is installed, its Config's all_kwargs gives what `launch` passes the kernel."""
    triton = pytest.importorskip("triton")
    config = triton.Config({"BLOCK_N": 8}, num_warps=4, num_stages=2)
    meta = config.all_kwargs()
    assert meta["BLOCK_N"] == 8 and meta["num_warps"] == 4 and meta["num_stages"] == 2
