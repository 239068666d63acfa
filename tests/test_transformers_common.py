"""transformers' own common model tests (`ModelTesterMixin`, `GenerationTesterMixin`, the causal-LM tester base,
vendored in tests/transformers_common/) on this family, written the way transformers tests Qwen3-Next
(tests/models/qwen3_next/test_modeling_qwen3_next.py): one tester per tiny configuration, one test class each.

- GDN + attention: a Gated DeltaNet layer and a gated full-attention layer (Qwen3-Next's own pattern);
- KDA + attention: a Kimi Delta Attention layer and a full-attention layer (Kimi Linear's pattern);
- every layer type: GDN, sliding-window attention, KDA, multi-head latent attention and full attention, with sparse
  MoE and Kimi MoE MLPs beside a dense one.

Explicit skips are those of transformers' Qwen3-Next test (the quantized cache, data parallel); the rest skip by
transformers' own decorators (GPU, flash attention, kernels, Hub checkpoints). The overrides, each argued where it
stands: attention outputs counted on the attention layers (as Qwen3-Next's), the linear layers' state shapes from
the config (as Qwen3-Next's), the cache shapes of each layer's mixer, this family's cache-layer class in the
generation helpers' exact-class checks, and this family's names in transformers' model name tables.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import unittest
import unittest.mock
from pathlib import Path

import pytest
import torch
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)
from transformers.testing_utils import require_torch, torch_device

from hybrid_linear_models import (
    HybridLinearConfig,
    HybridLinearForCausalLM,
    HybridLinearModel,
)
from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer
from hybrid_linear_models.mixer_registry import MIXERS


def _empty_tiny_model_summary() -> None:
    """The pipeline mixin reads, at import, a summary of the tiny checkpoints transformers keeps on the Hub (for its
    own models). This family has none there and the tests run offline, so it reads an empty summary (made here):
    its pipeline tests skip, finding no tiny checkpoint for this model."""
    if "TRANSFORMERS_TINY_MODEL_PATH" in os.environ:
        return
    folder = Path(tempfile.mkdtemp(prefix="tiny_model_summary_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "reports").mkdir()
    (folder / "reports" / "tiny_model_summary.json").write_text(json.dumps({}))
    os.environ["TRANSFORMERS_TINY_MODEL_PATH"] = str(folder)


_empty_tiny_model_summary()
from transformers_common.causal_lm_tester import CausalLMModelTest, CausalLMModelTester
from transformers_common.generation import test_utils as generation_test_utils


class _HybridLinearTester(CausalLMModelTester):
    """transformers' causal-LM tester defaults (hidden 32, 2 heads of 16, vocab 99, batch 13, 7 tokens) with this
    family's mixers sized down; `mixer_types` and `mlp_types` name the layers (layer_types follows from them)."""

    base_model_class = HybridLinearModel
    config_class = HybridLinearConfig
    causal_lm_class = HybridLinearForCausalLM
    mixer_types: tuple[str, ...] = ()
    mlp_types: tuple[str, ...] | None = None

    def __init__(self, parent):
        super().__init__(parent=parent)
        # as Qwen3-Next's tester: no dropout (the TP backward tests compare train-mode losses)
        self.attention_probs_dropout_prob = 0.0
        self.hidden_act = "silu"
        self.num_hidden_layers = len(self.mixer_types)
        self.mixer_types = list(self.mixer_types)
        self.mlp_types = None if self.mlp_types is None else list(self.mlp_types)
        self.layer_types = None  # derived from mixer_types by the config
        self.head_dim = 16
        # GDN and KDA layers sized alike (conv channels 96, state [4, 8, 8]): see _linear_state_shapes
        self.gdn_num_key_heads = 4
        self.gdn_num_value_heads = 4
        self.gdn_key_head_dim = 8
        self.gdn_value_head_dim = 8
        self.gdn_conv_kernel_size = 2
        self.kda_num_heads = 4
        self.kda_head_dim = 8
        self.kda_conv_kernel_size = 2
        # longer than every sequence these tests run (prompts of 7, 32 pads, a few new tokens): transformers' helpers
        # expect each attention layer's weights and cache over the whole sequence, as its sliding-window testers set
        # it; the window itself is tested by tests/test_sliding_window_memory.py and tests/test_modeling.py
        self.sliding_window = 64
        self.kv_lora_rank = 8
        self.qk_nope_head_dim = 8
        self.qk_rope_head_dim = 4
        self.v_head_dim = 8
        self.mla_use_nope = False
        self.num_experts = 4
        self.n_shared_experts = 1
        self.shared_expert_intermediate_size = 16


class _HybridLinearModelTest(CausalLMModelTest):
    """The common tests, with the overrides transformers' Qwen3-Next test makes (attention outputs counted on the
    attention layers only, the linear layers' state shapes)."""

    def _attention_layer_count(self, config) -> int:
        return sum(MIXERS[mixer].state == "kv" for mixer in config.mixer_types)

    def setUp(self):
        super().setUp()
        # The mixins tell a base model from a head by transformers' own name tables (a base model has no loss to
        # train on; a causal LM is given labels), which list the models inside transformers. This family is
        # registered with the Auto classes instead, so it is named in those tables for the duration of each test.
        model_type = HybridLinearConfig.model_type
        for table, name in ((MODEL_MAPPING_NAMES, HybridLinearModel.__name__),
                            (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, HybridLinearForCausalLM.__name__)):
            patcher = unittest.mock.patch.dict(table, {model_type: name})
            patcher.start()
            self.addCleanup(patcher.stop)

    # transformers' generation helpers below tell a linear-attention cache layer by its exact class
    # (`type(layer) is LinearAttentionLayer`); this family's is `LinearStateLayer`, a subclass of it that keeps the
    # layout its kernels update in place. They run unchanged, with that class in the place of transformers' own.
    def _check_past_key_values_for_generate(self, batch_size, past_key_values, seq_length, config):
        # the helper asks `_get_attention_shape` once per layer, in layer order, with that layer's settings (which
        # do not name its mixer): the layer index is counted here
        self._shape_layers = iter(range(len(past_key_values.layers)))
        with unittest.mock.patch.object(generation_test_utils, "LinearAttentionLayer", LinearStateLayer):
            super()._check_past_key_values_for_generate(batch_size, past_key_values, seq_length, config)

    def _check_caches_are_equal(self, cache1, cache2):
        with unittest.mock.patch.object(generation_test_utils, "LinearAttentionLayer", LinearStateLayer):
            super()._check_caches_are_equal(cache1, cache2)

    def _get_attention_shape(self, batch_size: int, seq_length: int | None, config):
        # transformers' helper takes a config holding kv_lora_rank and qk_rope_head_dim for one of latent attention;
        # this family's config holds every registered mixer's fields, so the layer's mixer decides. An MLA layer
        # caches [latent | shared rotary key slice] as its keys and an empty value (mixer_mla.py: the absorbed
        # decoding step reads the latent as keys and values from that one tensor), where transformers' MLA models
        # cache the latent as keys and the rotary slice as values; other attention layers cache the usual
        # [B, kv heads, T, head_dim] keys and values.
        layer_idx = next(self._shape_layers)
        if config.mixer_types[layer_idx] == "mla_attention":
            return ((batch_size, 1, seq_length, config.kv_lora_rank + config.qk_rope_head_dim),
                    (batch_size, 1, seq_length, 0))
        shape = (batch_size, config.num_key_value_heads, seq_length, config.head_dim)
        return shape, shape

    def _linear_state_shapes(self, config) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv channels, conv kernel) and the recurrent state's (heads, key dim, value dim) of the model's GDN/KDA
        layers. The mixin passes a layer's settings without its index, so the testers size GDN and KDA alike and one
        shape serves every linear layer (asserted here)."""
        shapes = set()
        if "gated_deltanet" in config.mixer_types:
            keys, values = config.gdn_num_key_heads * config.gdn_key_head_dim, config.gdn_num_value_heads * config.gdn_value_head_dim
            shapes.add(((2 * keys + values, config.gdn_conv_kernel_size),
                        (config.gdn_num_value_heads, config.gdn_key_head_dim, config.gdn_value_head_dim)))
        if "kimi_delta_attention" in config.mixer_types:
            width = config.kda_num_heads * config.kda_head_dim
            shapes.add(((3 * width, config.kda_conv_kernel_size),
                        (config.kda_num_heads, config.kda_head_dim, config.kda_head_dim)))
        self.assertEqual(len(shapes), 1, "the tester sizes GDN and KDA layers alike")
        return shapes.pop()

    def _get_conv_state_shape(self, batch_size: int, config):
        (channels, kernel), _ = self._linear_state_shapes(config)
        return (batch_size, channels, kernel)

    def _get_recurrent_state_shape(self, batch_size: int, config):
        _, (heads, key_dim, value_dim) = self._linear_state_shapes(config)
        return (batch_size, heads, key_dim, value_dim)

    @unittest.skip("The hybrid cache of linear-attention layers is not compatible with a quantized cache (as Qwen3-Next).")
    def test_generate_with_quant_cache(self):
        pass

    @unittest.skip("The cache of linear-attention layers cannot be instantiated from dp/ddp data (as Qwen3-Next).")
    def test_multi_gpu_data_parallel_forward(self):
        pass

    def test_attention_outputs(self):
        """As Qwen3-Next's: only the softmax-attention layers return attention weights."""
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        config._attn_implementation = "eager"
        seq_len = self.model_tester.seq_length
        expected = self._attention_layer_count(config)
        for model_class in self.all_model_classes:
            inputs = {**inputs_dict, "output_attentions": True, "output_hidden_states": False}
            model = model_class._from_config(config, attn_implementation="eager").to(torch_device).eval()
            with torch.no_grad():
                outputs = model(**self._prepare_for_class(inputs, model_class))
            self.assertEqual(len(outputs.attentions), expected)
            self.assertListEqual(list(outputs.attentions[0].shape[-3:]),
                                 [config.num_attention_heads, seq_len, seq_len])
            out_len = len(outputs)

            inputs["output_hidden_states"] = True
            with torch.no_grad():
                outputs = model(**self._prepare_for_class(inputs, model_class))
            self.assertEqual(out_len + 1, len(outputs))
            self.assertEqual(len(outputs.attentions), expected)


# Tests of the whole model's compile and training paths cost 40-160 s each on a 2-core CPU; the GDN configuration
# runs them, the other two configurations skip them (they exercise no mixer-specific code beyond what the GDN class
# and this package's own compile and training tests cover)
_COSTLY = ("test_training_overfit", "test_generate_compile_model_forward_fullgraph",
           "test_static_cache_no_recompile_with_smaller_length", "test_generate_with_static_cache",
           "test_torch_compile_for_training")


def _without_costly_tests(cls):
    for name in _COSTLY:
        if hasattr(cls, name):
            setattr(cls, name, unittest.skip("costly on a 2-core CPU: run in the GDN configuration")(
                getattr(cls, name)))
    return cls


class GatedDeltaNetAttentionTester(_HybridLinearTester):
    # Qwen3-Next's pattern, sparse MoE in every layer as in its tester
    mixer_types = ("gated_deltanet", "full_attention")
    mlp_types = ("sparse_moe", "sparse_moe")


@require_torch
class GatedDeltaNetAttentionTest(_HybridLinearModelTest, unittest.TestCase):
    model_tester_class = GatedDeltaNetAttentionTester


class KimiDeltaAttentionTester(_HybridLinearTester):
    # Kimi Linear's pattern: a dense first layer, then Kimi MoE
    mixer_types = ("kimi_delta_attention", "full_attention")
    mlp_types = ("dense", "kimi_moe")


# ~3 min of CPU per configuration (2 cores): the GDN configuration runs in every test run, these two are slow
@pytest.mark.slow
@require_torch
@_without_costly_tests
class KimiDeltaAttentionTest(_HybridLinearModelTest, unittest.TestCase):
    model_tester_class = KimiDeltaAttentionTester


class EveryLayerTypeTester(_HybridLinearTester):
    mixer_types = ("gated_deltanet", "sliding_attention", "kimi_delta_attention", "mla_attention", "full_attention")
    mlp_types = ("sparse_moe", "dense", "kimi_moe", "sparse_moe", "kimi_moe")


@pytest.mark.slow
@require_torch
@_without_costly_tests
class EveryLayerTypeTest(_HybridLinearModelTest, unittest.TestCase):
    model_tester_class = EveryLayerTypeTester

    @unittest.skip("Five layers by design: one of each mixer (GDN, sliding, KDA, MLA, full attention); transformers' "
                   "cap of two layers keeps its own testers fast and cannot hold every layer type of this family.")
    def test_num_layers_is_small(self):
        pass
