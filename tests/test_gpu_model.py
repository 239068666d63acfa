"""GPU checks of the model family (skipped without CUDA): the fla path against the pure-PyTorch path, and
CUDA-graph decoding against eager decoding.

Tolerances: fla computes its dot products in TF32 (inputs rounded to a 10-bit mantissa, 2^-11 relative). A single op
then agrees with float32 to ~1e-3 (`TF32_TOL` = 2e-3), but a model amplifies such rounding: in the tiny random test
model, rounding the weights alone to TF32 moves the logits by ~2e-2 of their largest magnitude (measured on CPU). So
whole-model comparisons are calibrated: the fla path must stay within `TF32_MARGIN` times the change that rounding
the weights to TF32 makes on the torch path. bfloat16 elementwise kernels (norms, SwiGLU) differ from torch's by the
rounding of their output: one bf16 ulp, 2^-8.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import StaticCache

from hybrid_linear_models import block_ops, fla_backend, ops
from model_helpers import tiny_model
from numerics import max_rel_err

TF32_TOL = 2e-3
TF32_MARGIN = 3.0
BF16_ULP = 2.0**-8
# fla's kernels need head dims of at least 16
GPU_DIMS = dict(gdn_value_head_dim=16, gdn_key_head_dim=16, kda_head_dim=16, head_dim=16)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or fla_backend.fla_kernels() is None, reason="needs fla")


def _without_fla(monkeypatch):
    monkeypatch.setattr(fla_backend, "fla_kernels", lambda: None)


def _tf32_rounded(model):
    """A copy of the model with every parameter rounded to TF32 precision (10-bit mantissa, to nearest)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for param in rounded.parameters():
            bits = param.data.view(torch.int32)
            param.data = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return rounded


# A heterogeneous model at fla's minimum head dims: two GDN blocks of different head counts, a 1-KV-head
# sliding block, a 2-KV-head full block, a KDA block, and per-layer MLP widths, activations, epsilons and rotary.
HETEROGENEOUS_LAYERS = ["gated_deltanet", "sliding_attention", "gated_deltanet", "full_attention",
                        "kimi_delta_attention"]
HETEROGENEOUS = {
    0: {"gdn_num_key_heads": 1, "gdn_num_value_heads": 2, "gdn_value_head_dim": 32, "intermediate_size": 48},
    1: {"num_key_value_heads": 1, "sliding_window": 3, "rope_parameters": {"rope_theta": 500.0},
        "attention_output_gate": False, "rms_norm_eps": 1e-5},
    3: {"num_key_value_heads": 2, "num_attention_heads": 2, "attention_qk_norm": False, "hidden_act": "gelu"},
    4: {"kda_num_heads": 1, "kda_conv_kernel_size": 3, "kda_gate_activation": "silu", "mlp_bias": True},
}
MODELS = {
    "uniform": lambda: tiny_model(**GPU_DIMS),
    "per_layer": lambda: tiny_model(HETEROGENEOUS_LAYERS, per_layer_config=HETEROGENEOUS, **GPU_DIMS),
}
each_model = pytest.mark.parametrize("kind", list(MODELS))


@needs_fla
@each_model
def test_fla_path_matches_torch_path(monkeypatch, kind):
    """Same model on the GPU through fla's kernels and through ours (float32)."""
    model = MODELS[kind]().cuda()
    input_ids = torch.randint(0, 128, (2, 300), device="cuda")
    with torch.no_grad():
        fla_logits = model(input_ids).logits
        _without_fla(monkeypatch)
        torch_logits = model(input_ids).logits
        rounding = max_rel_err(_tf32_rounded(model)(input_ids).logits, torch_logits)
    assert max_rel_err(fla_logits, torch_logits) <= TF32_MARGIN * rounding


def _training_step(model, input_ids, labels):
    model.zero_grad()
    out = model(input_ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_fla
@each_model
def test_fla_training_step_matches_torch_path(monkeypatch, kind):
    """A training step through fla (fused norms, SwiGLU, conv, delta rules, and the loss without logits) against
    the torch path: the loss and every parameter's gradient (with per-layer settings too: each layer's kernels get
    its own head counts and dims)."""
    model = MODELS[kind]().cuda().train()
    input_ids = torch.randint(0, 128, (2, 300), device="cuda")
    labels = input_ids.clone()
    labels[:, :5] = -100
    fla_out, fla_grads = _training_step(model, input_ids, labels)
    assert fla_out.logits is None  # the fused loss never materialises the logits
    _without_fla(monkeypatch)
    torch_out, torch_grads = _training_step(model, input_ids, labels)
    rounded = _tf32_rounded(model).train()
    rounded_out, rounded_grads = _training_step(rounded, input_ids, labels)
    loss_rounding = abs(rounded_out.loss.item() - torch_out.loss.item())
    loss = torch_out.loss.item()
    assert abs(fla_out.loss.item() - loss) <= TF32_MARGIN * loss_rounding + 1e-6 * loss
    errors = {n: max_rel_err(fla_grads[n], torch_grads[n]) for n in torch_grads}
    rounding = max(max_rel_err(rounded_grads[n], torch_grads[n]) for n in torch_grads)
    assert max(errors.values()) <= TF32_MARGIN * rounding, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


@needs_fla
@each_model
def test_fla_cached_decoding_matches_full_forward(monkeypatch, kind):
    """Tokens decoded one by one through fla (conv and recurrent states carried in the cache) give the logits of
    one full forward over the same tokens on the torch path."""
    model = MODELS[kind]().cuda()
    input_ids = torch.randint(1, 128, (2, 40), device="cuda")
    out = model.generate(input_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, cache_implementation="dynamic")
    _without_fla(monkeypatch)
    new = slice(input_ids.shape[1] - 1, -1)
    with torch.no_grad():
        full = model(out.sequences).logits[:, new]
        rounding = max_rel_err(_tf32_rounded(model)(out.sequences).logits[:, new], full)
    assert max_rel_err(torch.stack(out.logits, dim=1), full) <= TF32_MARGIN * rounding


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_ops_match_torch(monkeypatch, dtype):
    """fla's RMSNorm (also with the residual add), gated RMSNorm, SwiGLU and convolution (with states, packed; one
    decoding step updating its window in place) against the torch formulas."""
    torch.manual_seed(0)
    x = torch.randn(2, 50, 4, 64, device="cuda", dtype=dtype)
    gate = torch.randn_like(x)
    w = torch.rand(64, device="cuda") + 0.5
    xc = torch.randn(1, 90, 96, device="cuda", dtype=dtype)
    wc = torch.randn(96, 4, device="cuda", dtype=dtype) * 0.5
    cu = torch.tensor([0, 1, 40, 90], device="cuda", dtype=torch.int32)
    state = torch.randn(3, 96, 3, device="cuda", dtype=dtype)

    def conv_step():  # three rows, one token each; the window is updated in place (its first column is never read)
        window = F.pad(state, (1, 0))
        out = ops.causal_conv1d_step(xc[:, :3].transpose(0, 1), wc, window)
        return torch.cat([out.flatten(), window[..., 1:].flatten()])

    cases = {
        "rms_norm": lambda: block_ops.rms_norm(x, w, 1e-6),
        "rms_norm_residual": lambda: torch.cat([t.flatten() for t in block_ops.rms_norm(x, w, 1e-6, residual=gate)]),
        "gated_silu": lambda: ops.gated_rms_norm(x, gate, w, activation="silu"),
        "gated_sigmoid": lambda: ops.gated_rms_norm(x, gate, w, activation="sigmoid"),
        "swiglu": lambda: block_ops.silu_and_mul(x, gate),
        "conv": lambda: torch.cat([t.flatten() for t in ops.causal_conv1d(
            xc, wc, initial_state=state, output_final_state=True, cu_seqlens=cu)]),
        "conv_step": conv_step,
    }
    fused = {name: fn() for name, fn in cases.items()}
    _without_fla(monkeypatch)
    tol = TF32_TOL if dtype == torch.float32 else 2 * BF16_ULP
    for name, fn in cases.items():
        assert max_rel_err(fused[name], fn()) <= tol, name


@needs_fla
def test_fused_loss_matches_transformers_loss():
    """The chunked linear + cross-entropy equals transformers' causal-LM loss on materialised logits, with ignored
    labels, with `num_items_in_batch` (gradient accumulation), and under bf16 autocast."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    hidden = torch.randn(2, 70, 64, device="cuda")
    weight = torch.randn(300, 64, device="cuda") * 0.2
    labels = torch.randint(0, 300, (2, 70), device="cuda")
    labels[0, :9] = -100
    for items in (None, torch.tensor(100, device="cuda")):
        h1, w1, h2, w2 = (t.clone().requires_grad_() for t in (hidden, weight, hidden, weight))
        fused = block_ops.fused_causal_lm_loss(h1, w1, labels, num_items_in_batch=items)
        reference = ForCausalLMLoss(F.linear(h2, w2), labels, 300, num_items_in_batch=items)
        (fused + reference).backward()
        assert max_rel_err(fused.detach(), reference.detach()) <= TF32_TOL
        assert max_rel_err(h1.grad, h2.grad) <= TF32_TOL and max_rel_err(w1.grad, w2.grad) <= TF32_TOL
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = block_ops.fused_causal_lm_loss(hidden, weight, labels)
        reference = ForCausalLMLoss(F.linear(hidden, weight), labels, 300)
    assert fused.dtype == torch.float32 and abs(fused.item() - reference.item()) <= 4 * BF16_ULP * reference.item()



def assert_same_generation(graphed, eager, graphed_steps, eager_steps) -> None:
    """Graph-replayed and eager decoding give the same tokens, and per-step scores/logits within 1e-3 of the largest
    (TF32 matmuls may differ between the two paths' shapes)."""
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed_steps, eager_steps):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()


@pytest.mark.parametrize("cache", ["static", None], ids=["static", "generate_default"])
def test_cuda_graph_decoding_matches_eager_decoding(cache):
    """Asked for with cache_implementation="static", or taken by generate where nothing names a cache: the replayed
    steps give the tokens and scores of eager decoding."""
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"],
                       **GPU_DIMS).cuda()
    input_ids = torch.randint(1, 128, (3, 40), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :7] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  pad_token_id=0, cache_implementation=cache, output_scores=True, return_dict_in_generate=True)
    graphed = model.generate(input_ids, **kwargs)
    assert model._graph_decoder.last_graph is not None  # the graph path ran
    assert isinstance(graphed.past_key_values, StaticCache)
    model.set_cuda_graph_decoding(False)
    eager = model.generate(input_ids, **{**kwargs, "cache_implementation": cache or "dynamic"})
    assert_same_generation(graphed, eager, graphed.scores, eager.scores)


PREFILL_MODELS = {  # (MoE in float32 through batched_mm: the graph-safe experts implementation for that dtype)
    "linear_and_attention": lambda: tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention",
                                                "gated_deltanet"], **GPU_DIMS),
    "latent_and_moe": lambda: tiny_model(["mla_attention", "gated_deltanet", "kimi_delta_attention", "full_attention"],
                                         mlp_types=["sparse_moe", "dense", "sparse_moe", "dense"], num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, kv_lora_rank=16,
                                         qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, **GPU_DIMS),
}


@pytest.mark.parametrize("padded", [True, False], ids=["left_padded_row", "unpadded"])
@pytest.mark.parametrize("layout", sorted(PREFILL_MODELS))
def test_cuda_graph_prefill_matches_the_plain_prefill(layout, padded):
    """The captured prefill (cuda_graph_prefill.py) on a GPU: three generations of one prompt (40 tokens; a row
    left-padded, whose keys the attention mask then holds, or none: sdpa's causal flash kernel), each into a new
    static cache (generate rounds its 59 tokens up to 256 slots: static_cache_slots): the bucket's first prompt runs
    the plain forward, the second captures it (padded to its 64-token bucket inside the graph), the third replays it. Each gives the tokens and scores of generation with the graphs
    off."""
    model = PREFILL_MODELS[layout]().cuda()
    model.set_cuda_graph_decoding(True, prompts=True)
    if layout == "latent_and_moe":
        model.set_experts_implementation("batched_mm")
    input_ids = torch.randint(1, 128, (3, 40), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :7] = 0 if padded else 1
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  pad_token_id=0, cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    runs = [model.generate(input_ids, **kwargs) for _ in range(3)]
    assert list(model._graph_prefill._graphs) == [(3, 64, 256, input_ids.device, padded)]  # captured
    model.set_cuda_graph_decoding(False)
    eager = model.generate(input_ids, **kwargs)
    for run in runs:
        assert_same_generation(run, eager, run.scores, eager.scores)


def test_cuda_graph_decoding_follows_weight_updates():
    """Kept derived weights (norms' 1 + w, KDA's conv kernels) are read by the captured graph: after an in-place
    update of the parameters, the next generation with the same cache captures again and matches eager decoding."""
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"],
                       **GPU_DIMS).cuda()
    input_ids = torch.randint(1, 128, (2, 24), device="cuda")
    cache = StaticCache(config=model.config, max_cache_len=64)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, cache=cache)
    model.generate(input_ids, **kwargs)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layernorm" in name or "conv1d" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    cache.reset()
    graphed = model.generate(input_ids, **kwargs)
    model.set_cuda_graph_decoding(False)
    cache.reset()
    eager = model.generate(input_ids, **kwargs)
    assert_same_generation(graphed, eager, graphed.scores, eager.scores)


def test_bf16_training_step_on_gpu_is_finite():
    model = tiny_model(**GPU_DIMS).cuda().to(torch.bfloat16).train()
    input_ids = torch.randint(0, 128, (2, 256), device="cuda")
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("prompt_length", [2, 9])  # shorter and longer than the window of 3
def test_cuda_graph_decoding_with_sliding_layers_matches_eager_decoding(prompt_length):
    """A real CUDA graph over sliding-window layers of two windows (the CPU tests stand the graph in): a left-padded
    batch decoded for 12 steps (the windows roll over several times) gives the tokens and logits of the same static
    cache decoded eagerly (the forward's path: transformers' masks and cache update), within the margin of
    test_cuda_graph_decoding_matches_eager_decoding (TF32 matmuls may differ between the two paths' shapes)."""
    layer_types = ["gated_deltanet", "sliding_attention", "full_attention", "sliding_attention", "kimi_delta_attention"]
    model = tiny_model(layer_types, per_layer_config={1: {"sliding_window": 3}, 3: {"sliding_window": 5}},
                       **GPU_DIMS).cuda()
    input_ids = torch.randint(1, 128, (2, prompt_length), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :1] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                  pad_token_id=0, output_logits=True, return_dict_in_generate=True, cache_implementation="static")
    with torch.no_grad():
        graphed = model.generate(input_ids, **kwargs)
        assert model._graph_decoder.last_graph is not None  # the steps were captured
        model.set_cuda_graph_decoding(False)
        eager = model.generate(input_ids, **kwargs)
    assert_same_generation(graphed, eager, graphed.logits, eager.logits)


def test_per_layer_model_decodes_with_cuda_graphs_as_without_cache(monkeypatch):
    """On a real GPU, the heterogeneous model decodes with a static cache replayed from a CUDA
    graph as without the graph (same tokens, each step's logits within the graph tests' margin), and the replayed
    steps' logits equal those of one uncached forward over the generated tokens on the torch path, within the
    calibrated TF32 margin of test_fla_cached_decoding_matches_full_forward (fla's one-token kernels multiply in TF32;
    a near tie could flip a greedy pick, so logits are compared on the same tokens)."""
    model = MODELS["per_layer"]().cuda()
    input_ids = torch.randint(1, 128, (2, 9), device="cuda")
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, cache_implementation="static")
    with torch.no_grad():
        graphed = model.generate(input_ids, **kwargs)
        assert model._graph_decoder.last_graph is not None  # the steps were captured
        model.set_cuda_graph_decoding(False)
        eager = model.generate(input_ids, **kwargs)
        _without_fla(monkeypatch)
        new = slice(input_ids.shape[1] - 1, -1)
        full = model(graphed.sequences).logits[:, new]
        rounding = max_rel_err(_tf32_rounded(model)(graphed.sequences).logits[:, new], full)
    assert_same_generation(graphed, eager, graphed.logits, eager.logits)
    assert max_rel_err(torch.stack(graphed.logits, dim=1), full) <= TF32_MARGIN * rounding
