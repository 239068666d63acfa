"""GPU checks of multi-head latent attention (skipped without CUDA; the lead runs them): sdpa against eager on CUDA
(the expanded prefill and the absorbed one-token steps), CUDA-graph decoding against eager decoding with MLA layers
in the graph, flash attention where installed, and the fla kernels of neighbouring KDA layers still in use.

Tolerances: attention itself is float32 on both sides (torch's default keeps TF32 off for matmuls), so sdpa and
eager differ by summation order only (~1e-6 of the largest logit; bound 1e-4). Graph against eager decoding uses the
margin of test_gpu_model.py's graph tests (1e-3 of the largest logit: the KDA layers' fla kernels multiply in TF32
and tile by shape). fla against the torch path is calibrated as in test_gpu_model.py (TF32_MARGIN times the change
that rounding the weights to TF32 makes)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from numerics import max_rel_err
from test_gpu_model import TF32_MARGIN, _tf32_rounded, _without_fla, assert_same_generation, needs_fla
from test_mla import mla_model

from hybrid_linear_models import fla_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BF16_ULP = 2.0**-8
# KDA at fla's minimum head dims; MLA dims of 16 and more (flash attention wants multiples of 8)
GPU_MLA = dict(kda_head_dim=16, gdn_key_head_dim=16, gdn_value_head_dim=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
               v_head_dim=16, kv_lora_rank=32)


def _model():
    return mla_model(**GPU_MLA).cuda()


def _generate(model, input_ids, attention_mask, **kwargs):
    settings = dict(attention_mask=attention_mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                    pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        return model.generate(input_ids, **{**settings, **kwargs})


def _left_padded(batch: int, length: int):
    input_ids = torch.randint(1, 128, (batch, length), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0
    return input_ids, attention_mask


def test_sdpa_equals_eager_on_cuda():
    model = _model()
    input_ids, attention_mask = _left_padded(2, 30)
    results = {}
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            prefill = model(input_ids, attention_mask=attention_mask).logits
        decoded = _generate(model, input_ids, attention_mask, cache_implementation="dynamic")
        results[implementation] = (prefill, decoded)
    (eager_prefill, eager), (sdpa_prefill, sdpa) = results["eager"], results["sdpa"]
    real = attention_mask.bool()  # pad rows' outputs are never read
    assert max_rel_err(sdpa_prefill[real], eager_prefill[real]) <= 1e-4
    assert torch.equal(sdpa.sequences, eager.sequences)
    assert max_rel_err(torch.stack(sdpa.logits, 1), torch.stack(eager.logits, 1)) <= 1e-4


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_cuda_graph_decoding_with_mla_layers_matches_eager_decoding(implementation):
    model = _model()
    model.set_attn_implementation(implementation)
    input_ids, attention_mask = _left_padded(3, 20)
    graphed = _generate(model, input_ids, attention_mask, cache_implementation="static")
    assert model._graph_decoder.last_graph is not None  # the steps were captured, MLA layers included
    model.set_cuda_graph_decoding(False)
    eager = _generate(model, input_ids, attention_mask, cache_implementation="static")
    assert_same_generation(graphed, eager, graphed.logits, eager.logits)


@needs_fla
def test_graph_decoded_logits_equal_one_uncached_forward(monkeypatch):
    """The replayed steps (absorbed latent attention, fla's one-token KDA/GDN kernels) give the logits of one
    uncached forward over the generated tokens on the torch path, within the calibrated TF32 margin."""
    model = _model()
    input_ids = torch.randint(1, 128, (2, 9), device="cuda")
    graphed = _generate(model, input_ids, None, cache_implementation="static")
    _without_fla(monkeypatch)
    new = slice(input_ids.shape[1] - 1, -1)
    with torch.no_grad():
        full = model(graphed.sequences).logits[:, new]
        rounding = max_rel_err(_tf32_rounded(model)(graphed.sequences).logits[:, new], full)
    assert max_rel_err(torch.stack(graphed.logits, dim=1), full) <= TF32_MARGIN * rounding


@needs_fla
def test_kda_layers_beside_mla_layers_still_run_fla(monkeypatch):
    """MLA layers change nothing for their KDA/GDN neighbours: those still take fla's kernels (chunked for the
    prompt, fused recurrent for one-token steps), and the model's logits match the torch path's."""
    taken = []
    original = fla_backend.fla_kernel

    def recording(name, tensor, *others):
        kernel = original(name, tensor, *others)
        taken.append((name, kernel is not None))
        return kernel

    monkeypatch.setattr(fla_backend, "fla_kernel", recording)
    model = _model()
    input_ids = torch.randint(1, 128, (2, 40), device="cuda")
    with torch.no_grad():
        fla_logits = model(input_ids).logits
    _generate(model, input_ids, None, max_new_tokens=2, min_new_tokens=2, cache_implementation="dynamic")
    kda = {name for name, found in taken if "kda" in name}
    assert kda and all(found for name, found in taken if "kda" in name), taken
    assert any("fused_recurrent" in name for name in kda) and any("chunk" in name for name in kda), kda
    _without_fla(monkeypatch)
    with torch.no_grad():
        torch_logits = model(input_ids).logits
        rounding = max_rel_err(_tf32_rounded(model)(input_ids).logits, torch_logits)
    assert max_rel_err(fla_logits, torch_logits) <= TF32_MARGIN * rounding


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
def test_flash_attention_prefill_equals_sdpa_in_bfloat16():
    """flash_attention_2 (the value padded to the key width: v_head_dim < qk width here) against sdpa, bfloat16:
    two kernels rounding differently, within a few bf16 ulps of the largest logit (8 ulps allowed)."""
    model = mla_model(**{**GPU_MLA, "v_head_dim": 8}).cuda().to(torch.bfloat16)
    input_ids = torch.randint(1, 128, (2, 33), device="cuda")
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        sdpa = model(input_ids).logits
        model.set_attn_implementation("flash_attention_2")
        flash = model(input_ids).logits
    assert max_rel_err(flash, sdpa) <= 8 * BF16_ULP


@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2"])
def test_static_cache_far_longer_than_the_prompt_expands_only_the_filled_slots(implementation):
    """generate with a static cache of 1024 slots for a 20-token prompt: the prompt's kv_b_proj sees its 20 slots (not
    1024), and the tokens and logits are those of a dynamic cache (the same keys, the same kernels: sdpa in float32,
    bound 1e-4 of the largest logit as above; flash in bfloat16, 8 ulps as above). sdpa's one-token steps are absorbed
    (and captured), flash's are expanded over the filled slots only."""
    if implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs flash-attn")
    model = mla_model(**{**GPU_MLA, "v_head_dim": 8}).cuda()
    if implementation == "flash_attention_2":
        model = model.to(torch.bfloat16)
    model.set_attn_implementation(implementation)
    input_ids, attention_mask = _left_padded(2, 20)
    rows = []
    hook = model.model.layers[1].self_attn.kv_b_proj.register_forward_hook(
        lambda module, args, output: rows.append(args[0].shape[-2]))
    static = _generate(model, input_ids, attention_mask, cache_implementation="static", max_cache_len=1024)
    hook.remove()
    assert rows[0] == 20 and max(rows) <= 20 + 12, rows  # never the 1024 slots
    dynamic = _generate(model, input_ids, attention_mask, cache_implementation="dynamic")
    assert torch.equal(static.sequences, dynamic.sequences)
    bound = 8 * BF16_ULP if implementation == "flash_attention_2" else 1e-4
    assert max_rel_err(torch.stack(static.logits, 1).float(), torch.stack(dynamic.logits, 1).float()) <= bound
