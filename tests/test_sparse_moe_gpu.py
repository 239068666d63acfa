"""The sparse MoE MLP on a GPU (marked gpu, skipped without CUDA): every experts implementation against the eager
loop, and CUDA-graph decoding of a MoE model (expert choice varying per token and step) against eager decoding."""

from __future__ import annotations

import pytest
import torch

from hybrid_linear_models.mlp_sparse_moe import EXPERTS_IMPLEMENTATIONS
from model_helpers import tiny_model
from numerics import max_rel_err
from test_gpu_model import GPU_DIMS, assert_same_generation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MOE = dict(mlp_types=["sparse_moe", "sparse_moe", "dense", "sparse_moe"], num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=32)
LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_implementations_agree_on_cuda(dtype):
    model = tiny_model(LAYERS, **GPU_DIMS, **MOE).to("cuda", dtype)
    block = model.model.layers[0].mlp
    x = torch.randn(3, 50, model.config.hidden_size, device="cuda", dtype=dtype)
    outputs = {}
    for implementation in EXPERTS_IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = block(x).float()
    # the same routing (one router), GEMMs summed in other orders: float32 ~1e-6 (TF32 off by default), bf16 a few
    # ulps of 2^-8 on outputs rounded once per GEMM
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for implementation, out in outputs.items():
        assert max_rel_err(out, outputs["eager"]) <= tol, implementation


@pytest.mark.parametrize("dtype, implementation", [
    (torch.float32, "eager"), (torch.float32, "grouped_mm"),  # float32: the captured step runs batched_mm
    (torch.bfloat16, "grouped_mm_gather"), (torch.bfloat16, "grouped_mm"),  # bf16: torch's device-only grouped GEMM
])
def test_cuda_graph_decoding_of_a_moe_model_matches_eager_decoding(dtype, implementation):
    """Capture refuses any host synchronisation, so a captured step proves the MoE path has none (the eager loop, and
    torch's grouped GEMM outside bfloat16, which reads its offsets on the host, are swapped for a graph-safe
    implementation inside the step: graph_safe_experts_implementation); the replays route each new token afresh."""
    model = tiny_model(LAYERS, **GPU_DIMS, **MOE).to("cuda", dtype)
    model.set_experts_implementation(implementation)
    input_ids = torch.randint(1, 128, (3, 40), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :7] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  pad_token_id=0, cache_implementation="static", output_scores=True, output_logits=True,
                  return_dict_in_generate=True)
    graphed = model.generate(input_ids, **kwargs)
    assert model._graph_decoder.last_graph is not None  # the graph path ran
    assert model.config._experts_implementation == implementation  # restored after the capture
    model.set_cuda_graph_decoding(False)
    if dtype == torch.float32:
        eager = model.generate(input_ids, **kwargs)
        assert_same_generation(graphed, eager, graphed.scores, eager.scores)
        return
    # bf16: transformers compiles the uncaptured static-cache step, so its roundings (and the near-tie tokens of
    # this tiny random model) differ from the replay's; instead, on the graph's own tokens, the replayed logits are
    # at most twice as far from the float32 model's as one uncached bf16 forward's: both are bf16 rounding
    # histories of the same math
    reference = tiny_model(LAYERS, **GPU_DIMS, **MOE).cuda()
    new = slice(input_ids.shape[1] - 1, -1)
    with torch.no_grad():
        exact = reference(graphed.sequences, attention_mask=_extended(attention_mask, 20)).logits[:, new].float()
        uncached = model(graphed.sequences, attention_mask=_extended(attention_mask, 20)).logits[:, new].float()
    replayed = torch.stack([step.float() for step in graphed.logits], dim=1)  # raw logits (scores mask eos)
    replay_error = (replayed - exact).abs().max()
    assert replay_error <= 2 * (uncached - exact).abs().max(), replay_error


def _extended(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The prompt's padding mask extended over `new_tokens` generated tokens."""
    return torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], new_tokens)], dim=1)
