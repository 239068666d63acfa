"""Hostile model inputs: each either runs exactly as its canonical form (token ids of any integer dtype as int64), or is
refused before any work with one ValueError/TypeError line that names the input and the fix: packed-sequence
boundaries that do not describe the row, inputs_embeds of another dtype than the model's, the legacy tuple cache, a
cache of other rows, a forward past a static cache's slots, a static cache larger than the model's positions or the
memory; the load-balancing loss of all-padding batches; integer tensors in a float checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from model_helpers import ALL_TYPES, tiny_model
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, StaticCache
from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

from hybrid_linear_models import HybridLinearForCausalLM, HybridLinearModel
from hybrid_linear_models.moe_load_balancing import load_balancing_loss


def _one_line_error(kind: type[Exception], pattern: str, call) -> str:
    with pytest.raises(kind, match=pattern) as caught:
        call()
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.fixture(scope="module")
def model():
    return tiny_model()  # every mixer: GDN, attention, KDA, sliding attention


IDS = torch.tensor([[5, 17, 3, 99, 127, 0, 64]])


# ------------------------------------------------------------------------------------------------ token ids, labels


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                                   torch.uint64])
def test_token_ids_of_every_integer_dtype_give_the_int64_result(model, dtype):
    ids = IDS  # (ids up to 127: every integer dtype holds them)
    with torch.no_grad():
        expected = model(ids, labels=ids)
        got = model(ids.to(dtype), labels=ids.to(dtype))
    assert torch.equal(got.logits, expected.logits)  # the same embedding rows: bit for bit
    assert torch.equal(got.loss, expected.loss)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint16, torch.uint64])
def test_token_ids_out_of_the_vocabulary_are_refused_in_every_integer_dtype(model, dtype):
    bad = torch.tensor([[1, 2, 200]]).to(dtype) if dtype != torch.int8 else torch.tensor([[1, -3, 2]], dtype=dtype)
    _one_line_error(ValueError, r"input_ids must lie in \[0, 128\)", lambda: model(bad))


def test_labels_are_checked_like_token_ids(model):
    ids = IDS
    _one_line_error(ValueError, r"labels must be integer", lambda: model(ids, labels=ids.float()))
    _one_line_error(ValueError, r"labels must be integer", lambda: model(ids, labels=ids.bool()))
    _one_line_error(ValueError, r"labels must lie in \[0, 128\) .*-100", lambda: model(ids, labels=ids + 100))
    _one_line_error(TypeError, r"labels must be a torch.Tensor", lambda: model(ids, labels=ids.tolist()))
    ignored = ids.clone()
    ignored[0, :3] = -100
    with torch.no_grad():
        assert torch.isfinite(model(ids, labels=ignored.to(torch.int16)).loss)


def test_inputs_that_are_not_tensors_are_refused(model):
    _one_line_error(TypeError, r"input_ids must be a torch.Tensor.*torch.as_tensor", lambda: model(IDS.tolist()))
    _one_line_error(TypeError, r"attention_mask must be a torch.Tensor",
                    lambda: model(IDS, attention_mask=[[1] * 7]))
    _one_line_error(TypeError, r"position_ids must be a torch.Tensor", lambda: model(IDS, position_ids=[list(range(7))]))


def test_mask_values_other_than_zero_and_one_are_refused(model):
    # (a mask of document ids, 1 1 2 2 2, would otherwise be read as "no padding")
    mask = torch.tensor([[1, 1, 2, 2, 2, 3, 3]])
    _one_line_error(ValueError, r"holds 0 \(padding\) and 1 \(token\), got 2.*position_ids",
                    lambda: model(IDS, attention_mask=mask))


# ------------------------------------------------------------------------------------------------ packed sequences


@pytest.mark.parametrize("boundaries", [[0, 3, 9], [0, 3, 5], [1, 3, 7], [0, 5, 3, 7], [0, 3, 3, 7], [0, 7, 7], [7],
                                        [0, -2, 7]])
def test_cu_seq_lens_that_do_not_describe_the_row_are_refused(model, boundaries):
    cu = torch.tensor(boundaries, dtype=torch.int32)
    _one_line_error(ValueError, r"cu_seq_lens_q must", lambda: model(IDS, cu_seq_lens_q=cu))


@pytest.mark.parametrize("cu", [torch.tensor([[0, 3, 7]]), torch.tensor([0.0, 3.0, 7.0]), torch.tensor([0, 3, 7]).bool()])
def test_cu_seq_lens_of_another_shape_or_dtype_are_refused(model, cu):
    _one_line_error(ValueError, r"cu_seq_lens_q must be a 1-D integer tensor", lambda: model(IDS, cu_seq_lens_q=cu))


def test_cu_seq_lens_k_is_checked_too(model):
    q = torch.tensor([0, 3, 7], dtype=torch.int32)
    _one_line_error(ValueError, r"cu_seq_lens_k must",
                    lambda: model(IDS, cu_seq_lens_q=q, cu_seq_lens_k=torch.tensor([0, 3, 8], dtype=torch.int32)))


def test_valid_cu_seq_lens_of_any_integer_dtype_pack_as_position_ids(model):
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        expected = model(IDS, position_ids=positions).logits
        for dtype in (torch.int32, torch.int64, torch.int16):
            got = model(IDS, cu_seq_lens_q=torch.tensor([0, 3, 7], dtype=dtype)).logits
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ inputs_embeds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.float16])
def test_inputs_embeds_of_another_dtype_than_the_model_are_refused_with_the_cast(model, dtype):
    embeds = model.model.embed_tokens(IDS).detach().to(dtype)
    _one_line_error(ValueError, rf"inputs_embeds is {dtype} but the model computes in torch.float32.*"
                                r"inputs_embeds.to\(torch.float32\)", lambda: model(inputs_embeds=embeds))


def test_inputs_embeds_of_the_model_dtype_and_under_autocast_run(model):
    embeds = model.model.embed_tokens(IDS).detach()
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(IDS).logits, rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.isfinite(model(inputs_embeds=embeds.bfloat16()).logits).all()


# ------------------------------------------------------------------------------------------------ caches


@pytest.mark.parametrize("cache", [((torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)),) * 4, [], {"a": 1}],
                         ids=["legacy tuple", "list", "dict"])
def test_a_cache_that_is_not_a_transformers_cache_is_refused(model, cache):
    _one_line_error(TypeError, r"past_key_values \(cache\) must be a transformers Cache.*DynamicCache\(config=model.config\)",
                    lambda: model(IDS, cache=cache, use_cache=True))


def test_a_cache_of_other_rows_is_refused(model):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS.expand(2, -1), cache=cache, use_cache=True)
    _one_line_error(ValueError, r"the cache holds 2 rows but the inputs have 3",
                    lambda: model(IDS[:, :1].expand(3, -1), cache=cache, use_cache=True))


@pytest.mark.parametrize("layer_types", [ALL_TYPES, ["full_attention"], ["full_attention", "sliding_attention"]],
                         ids=["every mixer", "attention", "full and sliding"])
def test_a_forward_past_the_static_cache_slots_is_refused_before_any_write(layer_types):
    model = tiny_model(layer_types)
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(IDS[:, :6], cache=cache, use_cache=True)
        _one_line_error(ValueError, r"static cache holds 8 tokens per row, 6 of them written, and this forward adds 3"
                                    r".*max_cache_len \(at least 9 tokens\)",
                        lambda: model(IDS[:, :3], cache=cache, use_cache=True))
        # the refused forward wrote nothing: the two tokens that fit continue the prompt exactly
        last = model(IDS[:, 6:8], cache=cache, use_cache=True).logits
        expected = model(IDS[:, :8]).logits[:, 6:]
    torch.testing.assert_close(last, expected, rtol=1e-5, atol=1e-5)  # (cached vs uncached float32 summation order)


def test_static_generation_past_the_positions_is_refused_up_front_naming_both():
    model = tiny_model(max_position_embeddings=256)
    message = _one_line_error(
        ValueError, r"1000000006 key slots per row .* model's 256 positions \(max_position_embeddings\)",
        lambda: model.generate(IDS, cache_implementation="static", max_new_tokens=10**9))
    assert "at most 257 tokens in all" in message  # (the last token is never fed back: 256 positions)
    # a refused call leaves generate's cache sizing as it was: the next static generation is sized for itself
    out = model.generate(IDS, cache_implementation="static", max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 10)


def test_a_static_cache_larger_than_the_memory_is_refused_up_front_naming_both(monkeypatch):
    from hybrid_linear_models import cache_checks

    model = tiny_model(max_position_embeddings=10**7)
    # the full-attention layer caches 2 x 2 heads x 16 values per token, float32: 256 bytes per slot and row; the
    # sliding layer its window (6 slots) whatever the length
    monkeypatch.setattr(cache_checks, "available_memory", lambda device: 2 * 256 * (500 + 6))  # two rows
    message = _one_line_error(ValueError, r"\(2 rows x 1000008 slots\) need 488.29 MiB on cpu, more than the 0.25 MiB "
                                          r"available there: at most 500 slots per row fit",
                              lambda: model.generate(IDS.expand(2, -1), cache_implementation="static",
                                                     max_new_tokens=10**6 + 2))
    assert "smaller batch" in message
    cache = StaticCache(config=model.config, max_cache_len=10**6)  # a user's own: refused at its first forward
    _one_line_error(ValueError, r"\(1 rows x 1000000 slots\) need 244.14 MiB on cpu",
                    lambda: model(IDS, cache=cache, use_cache=True))
    out = model.generate(IDS.expand(2, -1), cache_implementation="static", max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 10)


# ------------------------------------------------------------------------------------------------ load-balancing loss


def _router_logits(seed: int, tokens: int, experts: int, layers: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, experts, generator=generator) for _ in range(layers))


def test_aux_loss_of_an_all_padding_row_is_that_of_the_other_rows_and_transformers():
    batch, seq_len, experts, k = 3, 5, 8, 2
    logits = _router_logits(0, batch * seq_len, experts, 2)
    mask = torch.ones(batch, seq_len)
    mask[1] = 0  # a row of padding only
    mask[2, :2] = 0
    got = load_balancing_loss(logits, [k, k], mask)
    torch.testing.assert_close(got, load_balancing_loss_func(logits, experts, k, mask), rtol=1e-6, atol=0)
    kept = [0, 2]  # the batch without its padding row: the same loss (the row contributes nothing)
    without = tuple(layer.view(batch, seq_len, experts)[kept].reshape(-1, experts) for layer in logits)
    torch.testing.assert_close(got, load_balancing_loss(without, [k, k], mask[kept]), rtol=1e-6, atol=0)


def test_aux_loss_of_an_all_padding_batch_is_zero_not_nan():
    logits = _router_logits(1, 10, 8, 2)
    got = load_balancing_loss(logits, [2, 2], torch.zeros(2, 5))
    assert torch.isnan(load_balancing_loss_func(logits, 8, 2, torch.zeros(2, 5)))  # transformers' 0 / 0
    assert got.item() == 0.0


def test_an_all_padding_moe_batch_gives_a_finite_loss():
    model = tiny_model(["gated_deltanet", "full_attention"], mlp_types=["sparse_moe", "sparse_moe"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    out = model(IDS, attention_mask=torch.zeros_like(IDS), labels=IDS, output_router_logits=True)
    assert out.aux_loss.item() == 0.0
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ------------------------------------------------------------------------------------------------ checkpoints


def _saved_with(tmp_path, replace) -> str:
    model = tiny_model()
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    name = next(name for name in tensors if name.endswith("mlp.up_proj.weight"))
    tensors[name] = replace(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("cls", [HybridLinearForCausalLM, HybridLinearModel])
def test_from_pretrained_refuses_an_integer_tensor_for_a_float_weight_naming_it(tmp_path, dtype, cls):
    name = _saved_with(tmp_path, lambda t: (t * 100).to(dtype))
    _one_line_error(ValueError, rf"checkpoint tensor '{name}' \(model.safetensors\) is {dtype} but the parameter .*"
                                r"torch.float32", lambda: cls.from_pretrained(tmp_path))


def test_from_pretrained_refuses_an_integer_tensor_of_a_given_state_dict(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"].to(torch.int16)
    _one_line_error(ValueError, r"checkpoint tensor 'lm_head.weight' \(state_dict\) is torch.int16",
                    lambda: HybridLinearForCausalLM.from_pretrained(None, config=model.config, state_dict=state))


def test_from_pretrained_still_casts_floating_tensors_to_the_parameters_dtype(tmp_path):
    name = _saved_with(tmp_path, lambda t: t.to(torch.float16))
    loaded = HybridLinearForCausalLM.from_pretrained(tmp_path)
    weight = loaded.get_parameter(name)
    assert weight.dtype == torch.float32
    assert torch.equal(weight, load_file(os.path.join(tmp_path, "model.safetensors"))[name].float())

