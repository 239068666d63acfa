"""A decoding step's GDN input projections on a released FP8 Qwen3-Next layout: in_proj_qkvz is FP8 and in_proj_ba
bf16, so they cannot stack into one GEMM as a bf16 model's do; each runs as one launch that takes its outputs in the
flat order [q | k | v | z] and [b | a] (the FP8 kernel reading its weight rows through an index: no gather, no copies
of z and a, beta's sigmoid in the recurrent kernel). Checked: the index's block alignment, the indexed FP8 kernel
against float64 (a GPU, or triton's interpreter), and a model's decoding step through it against the same model's
unstacked path, exactly (the CPU's reference products are the same gathers of the same products)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from model_helpers import runs_triton_kernels
from test_kernels_fp8 import (
    DEVICE,
    _assert_within,
    _reference_weight,
    _skip_bf16_on_interpreter,
    _weight,
    _x,
)
from transformers import StaticCache

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.kernels_fp8 import block_fp8_linear, fp8_row_index
from hybrid_linear_models.mixer_gated_deltanet import HybridLinearGatedDeltaNet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from flagship_models import ours_config, qwen3_next_fields


def test_a_row_index_is_aligned_where_each_run_of_a_block_comes_from_one_block_row():
    chunks = torch.tensor([3, 0, 2])  # block rows, each taken whole
    assert fp8_row_index((chunks[:, None] * 4 + torch.arange(4)).reshape(-1), 4, torch.device("cpu")).aligned
    assert not fp8_row_index(torch.tensor([0, 1, 2, 4, 3, 5, 6, 7]), 4, torch.device("cpu")).aligned
    assert fp8_row_index(torch.tensor([8, 9, 10, 11, 1, 0]), 4, torch.device("cpu")).aligned  # (a partial last run)
    assert fp8_row_index(torch.tensor([5, 4]), 4, torch.device("cpu")).rows.dtype == torch.int64


@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("aligned", [True, False])
def test_the_kernel_reads_indexed_rows(dtype, rows, aligned):
    """Each output column the product with its indexed weight row (and bias), within the kernels' float64 bound:
    a block-aligned index (whole 32-row blocks, reordered) and one that is not (rows shuffled across blocks)."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import fp8_linear

    block = (32, 16)
    w, scale = _weight(96, 48, block, seed=31)
    order = (torch.tensor([2, 0, 1])[:, None] * 32 + torch.arange(32)).reshape(-1)
    if not aligned:
        order = order[torch.randperm(96, generator=torch.Generator().manual_seed(32))]
    index = fp8_row_index(order[:80], block[0], torch.device(DEVICE))
    assert index.aligned == aligned
    x = _x(rows, 48, dtype, seed=33)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(34)).to(DEVICE, dtype)
    got = fp8_linear(x, w, scale, block, bias, config=(4, 16) if rows == 1 else (16, 16), index=index)
    weight = _reference_weight(w, scale, block, torch.float64)
    _assert_within(got, x, weight[index.rows], bias[index.rows], f"{rows} rows")


def test_the_reference_gathers_the_rows():
    block = (16, 16)
    w, scale = (t.cpu() for t in _weight(48, 32, block, seed=35))
    x = torch.randn(3, 32).to(torch.bfloat16)
    index = fp8_row_index(torch.tensor([47, 3, 16, 0]), block[0], torch.device("cpu"))
    assert torch.equal(block_fp8_linear(x, w, scale, block, rows=index),
                       block_fp8_linear(x, w, scale, block)[:, index.rows])


def _fp8_qwen3_next() -> HybridLinearForCausalLM:
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(ours_config(qwen3_next_fields(layers=4, tiny=True, fp8=True)))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.dtype == torch.float8_e4m3fn:
                tensor.copy_((torch.randn(tensor.shape) * 64).clamp(-448, 448).to(torch.float8_e4m3fn))
            elif name.endswith("scale_inv"):
                tensor.copy_(torch.rand(tensor.shape) / 256 + 1 / 512)
            elif tensor.is_floating_point() and "norm" not in name:
                tensor.copy_(torch.randn(tensor.shape) * 0.05)
    return model.to(torch.bfloat16).eval()


def _prompt_then_steps(model: HybridLinearForCausalLM, ids: torch.Tensor, prompt: int = 8):
    """The last logits of a prompt of ids[:, :prompt] and of one-token steps through the rest, and the static cache."""
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    with torch.no_grad():
        logits = [model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(prompt, ids.shape[1]):
            logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits), cache


def _assert_same_states(got, expected) -> None:
    """Every layer's convolution window, recurrent state, keys and values, bit for bit."""
    for layer, (a, b) in enumerate(zip(got.layers, expected.layers)):
        for name in ("conv_window", "recurrent_state", "keys", "values"):
            if isinstance(getattr(a, name, None), torch.Tensor):
                assert torch.equal(getattr(a, name), getattr(b, name)), (layer, name)


def test_a_decoding_step_takes_the_flat_fp8_projections_and_keeps_its_logits(monkeypatch):
    """Each GDN layer of an FP8 Qwen3-Next (the released layout in miniature) runs its decoding step's projections
    as one indexed FP8 product and one gathered bf16 one; the step's logits and the caches' states equal the
    unstacked path's bit for bit, over several steps."""
    model = _fp8_qwen3_next()
    model.set_cuda_graph_decoding(False)
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    indexed = []
    real = HybridLinearGatedDeltaNet._fp8_projections

    def counted(self, hidden_states):
        out = real(self, hidden_states)
        indexed.append(out is not None)
        return out

    def run(projections):
        monkeypatch.setattr(HybridLinearGatedDeltaNet, "_fp8_projections", projections)
        return _prompt_then_steps(model, ids)

    fused, fused_cache = run(counted)
    gdn_layers = sum(t == "linear_attention" for t in model.config.layer_types)
    assert indexed == [True] * 4 * gdn_layers  # (four decoding steps; the prompt keeps the plain path)
    plain, plain_cache = run(lambda self, hidden_states: None)
    assert torch.equal(fused, plain)
    _assert_same_states(fused_cache, plain_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fp8_decoding_projections(monkeypatch):
    """On a GPU (the indexed FP8 kernel, the bf16 GEMV, beta's sigmoid in fla's recurrent kernel): the captured step
    decodes the uncaptured one's tokens, and each GDN layer's output stays within bf16's noise of the unstacked path's
    (beta's sigmoid rounded to bf16 there, in float32 here: relative differences of 2^-9 carried in the state; a wrong
    row or scale would be of the output's own size). Each layer is compared on the same input: the unstacked run is
    fed the indexed run's layer inputs, since a difference of bf16's noise may turn a MoE router's near-tie the other
    way and change every later layer's input by far more than the projections differ."""
    from model_helpers import greedy

    model = _fp8_qwen3_next().cuda()
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    captured = greedy(model, ids, 8, cache_implementation="static")
    assert model._graph_decoder is not None and not model._graph_decoder._failed, model._graph_decoder._failed
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, ids, 8)  # (a dynamic cache: transformers would compile a static cache's uncaptured step)
    assert torch.equal(captured.sequences, eager.sequences)
    mixers = [m for m in model.modules() if isinstance(m, HybridLinearGatedDeltaNet)]
    inputs, outputs = {m: [] for m in mixers}, {m: [] for m in mixers}

    def run(feed: bool) -> None:
        """Every GDN layer's outputs over a prompt and 7 steps; fed the recorded inputs where `feed`."""
        for m in mixers:
            outputs[m].clear()

        def pre(module, args, kwargs):
            if not feed:
                inputs[module].append(args[0])
                return None
            return (inputs[module][len(outputs[module])], *args[1:]), kwargs

        def post(module, args, kwargs, output):
            outputs[module].append((output[0] if isinstance(output, tuple) else output).float())

        hooks = [h for m in mixers for h in (m.register_forward_pre_hook(pre, with_kwargs=True),
                                             m.register_forward_hook(post, with_kwargs=True))]
        try:
            _prompt_then_steps(model, eager.sequences[:, :-1], prompt=12)
        finally:
            for h in hooks:
                h.remove()

    run(feed=False)
    indexed = {m: list(o) for m, o in outputs.items()}
    monkeypatch.setattr(HybridLinearGatedDeltaNet, "_fp8_projections", lambda self, hidden_states: None)
    run(feed=True)
    for layer, m in enumerate(mixers):
        assert len(indexed[m]) == len(outputs[m]) == 8
        for step, (got, expected) in enumerate(zip(indexed[m], outputs[m])):
            bound = 2 ** -5 * expected.abs().max()
            assert (got - expected).abs().max() <= bound, (layer, step, (got - expected).abs().max().item(), bound)


def test_the_fp8_decoding_step_gathers_and_copies_nothing_in_its_gdn_and_moe_layers():
    """The kernels of a captured decoding step of the FP8 Qwen3-Next in miniature (3 GDN layers and an attention
    layer, each with its MoE), as benchmarks/count_decode_ops.py counts them: no op of the GDN mixer's own (its
    projections are the indexed FP8 product and the bf16 GEMV, no gather, copy or sigmoid), one routing kernel and one
    gated sum a MoE layer (which sums the routes too), the routed and shared experts' SwiGLU inside their down
    projections, and the attention layer on the fused attention step."""
    import count_decode_ops

    step = count_decode_ops.count_step("qwen3-next-fp8", by_site=True)["graph"]
    sites = {(name, where.split(":")[0]) for name, where in step.sites}
    assert not [site for site in sites if site[1] == "mixer_gated_deltanet.py"], sites
    assert step.counts["moe.route_top_k"] == step.counts["moe.add_gated"] == 4
    # the experts' gate+up, and their down projection with SwiGLU and the weight in its read; the shared experts'
    # down projection with SwiGLU in its read too (batch 1), so no SwiGLU kernel
    assert step.counts["fp8.routed_linear"] == 12 and "fla.swiglu" not in step.counts
    assert [site for site in sites if site[1] == "fp8_layers.py"] == []  # (the routes summed in the gated sum)
    # the attention layer's FP8 q/k/v stack, so it takes the fused attention step's three kernels
    assert all(step.counts[f"attention_step.{kernel}"] == 1 for kernel in ("prepare", "attend", "combine"))
    assert "sigmoid" not in {name for name, where in sites if where != "mixer_attention.py"}


def test_fp8_projections_stack_as_plain_ones(monkeypatch):
    """An FP8 Qwen3-Next's attention q/k/v and shared experts' gate/up stack into one FP8 product each (weights and
    scales become views of the stacked tensors: no copy), and its decoding steps' logits and states equal those of
    the same model with every projection separate (the CPU's reference products: the same dequantized weights,
    gathered and stacked)."""
    from hybrid_linear_models.derived_weights import SharedRows, derived_weights
    from hybrid_linear_models.fused_projections import FusedProjections

    model = _fp8_qwen3_next()
    model.set_cuda_graph_decoding(False)
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    stacked, stacked_cache = _prompt_then_steps(model, ids)
    attention = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    weights = attention._qkv.kept_tensors()[0].value
    assert weights is not None and weights.dtype == torch.float8_e4m3fn
    assert attention.k_proj.weight.data_ptr() == weights[attention.q_proj.out_features:].data_ptr()
    scales = attention._qkv.kept_tensors()[2].value
    v_scales = attention.v_proj.weight_scale_inv
    assert v_scales.data_ptr() == scales[-v_scales.shape[0]:].data_ptr()
    shared = [d for d in derived_weights(model) if isinstance(d, SharedRows) and d.value is not None]
    assert sum(d.value.dtype == torch.float8_e4m3fn for d in shared) == 1 + 4  # (q/k/v, and each layer's gate/up)
    monkeypatch.setattr(FusedProjections, "applies", lambda self, x, linears: False)
    separate, separate_cache = _prompt_then_steps(model, ids)
    assert torch.equal(stacked, separate)
    _assert_same_states(stacked_cache, separate_cache)


def test_an_fp8_model_saved_after_decoding_reloads_the_same(tmp_path):
    """After decoding, the FP8 attention and shared-expert projections are views of stacked weights and scales: a
    saved folder still holds each tensor under its own name with its own bytes, FP8 kept, and reloads to the same
    state and logits."""
    model = _fp8_qwen3_next()
    model.set_cuda_graph_decoding(False)
    ids = torch.randint(1, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(5))
    logits, _ = _prompt_then_steps(model, ids)  # (the projections now share storage)
    model.save_pretrained(tmp_path)
    reloaded = HybridLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    reloaded.set_cuda_graph_decoding(False)
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():  # (the decay's A_log and dt_bias load as float32: the same values)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float32):
            assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name].to(tensor.dtype).view(torch.uint8), tensor.view(torch.uint8)), name
    assert any(tensor.dtype == torch.float8_e4m3fn for tensor in loaded.values())
    reloaded.to(torch.bfloat16)  # (the decay's float32 parameters as the saved model held them: bf16)
    assert torch.equal(_prompt_then_steps(reloaded, ids)[0], logits)


def test_fp8_layers_that_would_split_a_block_stay_separate():
    """FP8 layers stack only where every layer's outputs but the last's are whole blocks of the weight's rows (their
    scales then stack by rows too), of one block size."""
    from hybrid_linear_models.configuration_hybrid_linear import HybridLinearConfig
    from hybrid_linear_models.fp8_layers import Fp8Linear
    from hybrid_linear_models.fused_projections import FusedProjections

    settings = HybridLinearConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    x = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    whole, partial = (Fp8Linear(32, out, settings.block_fp8_settings) for out in (32, 24))
    with torch.no_grad():
        assert FusedProjections().applies(x, (whole, partial))
        assert not FusedProjections().applies(x, (partial, whole))
        assert not FusedProjections().applies(x, (whole, torch.nn.Linear(32, 8, dtype=torch.bfloat16)))


def test_the_fp8_moe_layers_sum_their_routes_in_the_gated_sum(monkeypatch):
    """Where the FP8 routed experts give each route's row (`Fp8Experts.route_rows`: a GPU's decoding step, stood in
    here by taking the routed products' reference on the CPU), the MoE block hands them unsummed to the gated sum,
    which sums them first (on a GPU in its kernel: test_moe_inference_ops): the decoding steps' logits equal those of
    the experts summing their own rows, bit for bit on the CPU."""
    from hybrid_linear_models import fp8_layers, moe_inference_ops

    monkeypatch.setattr(fp8_layers, "routed_applies", lambda *args: True)
    model = _fp8_qwen3_next()
    model.set_cuda_graph_decoding(False)
    ids = torch.randint(1, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    shapes = []
    real = moe_inference_ops.add_gated

    def seen(routed, gate, shared):
        shapes.append(routed.dim())
        return real(routed, gate, shared)

    monkeypatch.setattr("hybrid_linear_models.mlp_sparse_moe.add_gated", seen)
    unsummed, _ = _prompt_then_steps(model, ids)
    assert set(shapes) == {3}  # (every MoE layer's rows came unsummed)
    monkeypatch.setattr(fp8_layers.Fp8Experts, "route_rows", lambda self, *args: None)
    summed, _ = _prompt_then_steps(model, ids)
    assert shapes[-1] == 2 and torch.equal(unsummed, summed)


def test_the_fp8_shared_experts_of_a_batch_1_step_compute_swiglu_in_their_down_projection(monkeypatch):
    """At batch 1 each FP8 shared expert (a GatedMLP of Fp8Linear layers) runs its stacked gate/up product, then the
    down projection that computes SwiGLU as it reads its input (`kernels_fp8.block_fp8_swiglu_linear`; on the CPU
    its reference, SwiGLU then the product): once per MoE layer and decoding step, none in the prompt, and the logits
    equal those of SwiGLU apart, bit for bit (the same ops on the CPU)."""
    from hybrid_linear_models import fused_projections
    from hybrid_linear_models.fused_projections import FusedProjections

    calls = []
    real = fused_projections.block_fp8_swiglu_linear

    def counted(gate_up, *args):
        calls.append(tuple(gate_up.shape))
        return real(gate_up, *args)

    monkeypatch.setattr(fused_projections, "block_fp8_swiglu_linear", counted)
    model = _fp8_qwen3_next()
    model.set_cuda_graph_decoding(False)
    ids = torch.randint(1, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(5))
    fused, fused_cache = _prompt_then_steps(model, ids)
    moe_layers = model.config.mlp_types.count("sparse_moe")
    width = model.config.shared_expert_intermediate_size
    assert moe_layers and calls == [(1, 1, 2 * width)] * (3 * moe_layers)  # (three steps after the 8-token prompt)
    monkeypatch.setattr(FusedProjections, "swiglu_down", lambda self, *args: None)
    apart, apart_cache = _prompt_then_steps(model, ids)
    assert torch.equal(fused, apart)
    _assert_same_states(fused_cache, apart_cache)
