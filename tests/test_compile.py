"""torch.compile of the model on the CPU: the forward traces as one graph with a 2-D attention mask (no branch on a
tensor's values), compiled decoding steps against a static cache do not recompile (no guard on a layer's token count,
none per mixer type), and `generate` starts its own compilation where transformers would, CUDA-graph decoding on or
off (graph decoding applies on CUDA only). Dynamo's "eager" backend traces exactly as inductor's does (the graph,
its breaks and its guards) without compiling kernels, so these run in seconds."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_model
from transformers import GenerationConfig, StaticCache
from transformers.generation.configuration_utils import CompileConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextPreTrainedModel

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer

# every mixer but sliding attention, whose static cache layer (transformers' StaticSlidingWindowLayer) keeps a Python
# count, cumulative_length_int, that transformers' own masks read: a guard of transformers', for any model
EVERY_UNWINDOWED_MIXER = ["gated_deltanet", "full_attention", "kimi_delta_attention", "mla_attention"]
MLA = dict(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_can_compile_fullgraph_is_declared_as_qwen3_next_declares_it():
    assert HybridLinearForCausalLM._can_compile_fullgraph is Qwen3NextPreTrainedModel._can_compile_fullgraph is True


@pytest.mark.slow  # dynamo traces the chunked GDN/KDA kernels: 15-30 s on a busy 2-core machine
@pytest.mark.parametrize("padded", [True, False])
def test_the_forward_traces_as_one_graph_with_a_2d_mask(padded):
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"])
    input_ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    if padded:
        mask[0, :3] = 0
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask, use_cache=False).logits
        got = compiled(input_ids, attention_mask=mask, use_cache=False).logits
    # the same float32 operations (an unpadded mask is applied in the graph, where it changes no value); the
    # tolerance covers kernels that pick another reduction order for the traced call
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~20 s of tracing on a busy 2-core machine
def test_compiled_decoding_steps_do_not_recompile():
    model = tiny_model(EVERY_UNWINDOWED_MIXER, **MLA)
    model.set_cuda_graph_decoding(False)
    input_ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=16)
    eager_cache = StaticCache(config=model.config, max_cache_len=16)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        token = model(input_ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        model(input_ids, cache=eager_cache, use_cache=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step in range(4):  # the first step compiles; a guard failing at a later step raises
                position_ids = torch.full((2, 1), 6 + step)
                got = compiled(token, cache=cache, use_cache=True, position_ids=position_ids).logits
                expected = model(token, cache=eager_cache, use_cache=True, position_ids=position_ids).logits
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
                token = got[:, -1:].argmax(-1)
    linear = [layer for layer in cache.layers if isinstance(layer, LinearStateLayer)]
    assert [layer.seen_tokens for layer in linear] == [10, 10]  # the compiled steps' tokens counted too


def test_compiled_generate_with_a_padded_mask_does_not_recompile():
    """generate's compiled decoding steps, compiled as transformers' common test compiles them (fullgraph, no dynamic
    shapes), with a left-padded 2-D mask that generate grows by a column a step: the steps take masks shaped by the
    cache's slots (create_masks_for_generate), so no step after the first recompiles, and the tokens are those of
    the uncompiled generate."""
    model = tiny_model(["gated_deltanet", "full_attention"])
    input_ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    compile_config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # transformers' switch for compiling off CUDA
    settings = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                    cache_implementation="static", compile_config=compile_config)
    with torch.no_grad():
        with torch.compiler.set_stance("force_eager"):
            expected = model.generate(input_ids, **settings)
        with torch._dynamo.config.patch(error_on_recompile=True):  # a guard failing at a later step raises
            got = model.generate(input_ids, **settings)
    assert hasattr(model, "_compiled_call")  # generate compiled its steps
    assert torch.equal(got, expected)


def test_generate_compiles_where_transformers_would_with_graph_decoding_on_or_off():
    model = tiny_model(["gated_deltanet", "full_attention"])
    cache = StaticCache(config=model.config, max_cache_len=16)
    for compile_config, expected in ((None, False), (CompileConfig(), True)):
        generation_config = GenerationConfig(compile_config=compile_config)
        if compile_config is not None:
            compile_config._compile_all_devices = True  # transformers' switch for compiling off CUDA
        decisions = []
        for enabled in (True, False):
            model.set_cuda_graph_decoding(enabled)
            decisions.append(model._valid_auto_compile_criteria({"cache": cache}, generation_config))
        assert decisions == [expected, expected]
