"""A prompt's sdpa kernel (prompt_attention_backend): flash attention, which builds no plan per shape, for the unmasked,
gradient-free prompts of fewer than CUDNN_MIN_TOKENS query tokens that it takes; sdpa's own choice for everything
else. On the CPU, its flash kernel standing in for the GPU's (the device type and float32 added to the module's)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_model
from torch.nn.attention import SDPBackend

from hybrid_linear_models import prompt_attention_backend as backend


@pytest.fixture
def planless_on_cpu(monkeypatch) -> list:
    """The CPU's float32 prompts in the planless set; returns the backends of each `sdpa_kernel` entered."""
    monkeypatch.setattr(backend, "PLANLESS_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(backend, "PLANLESS_DTYPES", (torch.float32,))
    entered, sdpa_kernel = [], backend.sdpa_kernel

    def spy(backends):
        entered.append(list(backends))
        return sdpa_kernel(backends)

    monkeypatch.setattr(backend, "sdpa_kernel", spy)
    return entered


# (layer, config overrides, attention layers flash can take): GQA attention; MLA with q, k and v of one width; MLA
# with narrower values (flash wants one width: sdpa chooses)
MODELS = {
    "attention_gqa": (["full_attention", "gated_deltanet", "full_attention"], {}, 2),
    "mla_one_width": (["mla_attention"], {"v_head_dim": 192}, 1),
    "mla_narrower_values": (["mla_attention"], {}, 0),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_short_prompts_run_flash_attention_with_the_same_logits(name, planless_on_cpu, monkeypatch):
    """Below CUDNN_MIN_TOKENS each attention layer flash takes runs inside sdpa_kernel([FLASH_ATTENTION]), and the
    logits are those of sdpa's own choice within float32's rounding of reordered sums (the same attention)."""
    layers, overrides, planless = MODELS[name]
    model = tiny_model(layers, **overrides)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(1, model.config.vocab_size, (2, 19))
    with torch.no_grad():
        logits = model(ids).logits
        assert planless_on_cpu == [[SDPBackend.FLASH_ATTENTION]] * planless
        monkeypatch.setattr(backend, "PLANLESS_DEVICE_TYPES", ())
        reference = model(ids).logits
    assert len(planless_on_cpu) == planless  # (the reference entered nothing)
    torch.testing.assert_close(logits, reference)


def test_sdpa_chooses_for_long_prompts_masks_gradients_and_steps(planless_on_cpu, monkeypatch):
    """No sdpa_kernel from CUDNN_MIN_TOKENS query tokens (batch x length) on, for a padded batch's masked prompt, with
    gradients (training keeps torch's choice), or for a one-token step; one below the limit."""
    model = tiny_model(["full_attention"])
    monkeypatch.setattr(backend, "CUDNN_MIN_TOKENS", 2 * 16)
    ids = torch.randint(1, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        model(ids)  # 32 query tokens: at the limit
        assert planless_on_cpu == []
        model(ids[:, :15])  # 30: below it
        assert len(planless_on_cpu) == 1
        mask = torch.ones_like(ids[:, :8])
        mask[1, :3] = 0  # left padding: a mask goes to sdpa
        model(ids[:, :8], attention_mask=mask)
        out = model(ids[:1, :8], use_cache=True)
        model(ids[:1, 8:9], cache=out.past_key_values, use_cache=True)  # a one-token step
    model(ids[:, :8]).logits.sum().backward()
    assert len(planless_on_cpu) == 2  # only the unpadded 8-token prompt of one row besides


def test_a_prompt_into_an_empty_static_cache_runs_flash_on_its_own_keys(planless_on_cpu):
    """A prompt into an empty static cache attends over the cache's slots under sdpa's causal mask: the slots past the
    prompt are dropped before the choice (`visible_keys`), so the square causal call runs flash attention, with the
    logits of the dynamic cache's prompt."""
    from transformers import StaticCache

    model = tiny_model(["full_attention", "gated_deltanet"])
    ids = torch.randint(1, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        static = model(ids, cache=StaticCache(config=model.config, max_cache_len=40), use_cache=True).logits
        assert planless_on_cpu == [[SDPBackend.FLASH_ATTENTION]]
        dynamic = model(ids, use_cache=True).logits
    torch.testing.assert_close(static, dynamic)


def test_visible_keys_drop_only_what_the_causal_mask_hides():
    """Keys past the last query go for a causal call of several queries and no mask; nothing goes for one query, a
    mask, a module that is not causal, or is_causal=False in the call's settings."""
    query, key = torch.zeros(1, 2, 3, 4), torch.arange(7.0).view(1, 1, 7, 1).expand(1, 2, 7, 4)
    causal, bidirectional = torch.nn.Module(), torch.nn.Module()
    bidirectional.is_causal = False
    assert backend.visible_keys(causal, query, key, key, None, {})[0].shape[2] == 3
    assert torch.equal(backend.visible_keys(causal, query, key, key, None, {})[1], key[:, :, :3])
    for module, q, mask, settings in ((causal, query[:, :, :1], None, {}), (causal, query, torch.ones(1, 1, 3, 7), {}),
                                      (bidirectional, query, None, {}), (causal, query, None, {"is_causal": False})):
        assert backend.visible_keys(module, q, key, key, mask, settings)[0].shape[2] == 7
