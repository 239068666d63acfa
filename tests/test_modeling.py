"""The model family against independent references: transformers' own Qwen3-Next and Kimi-Linear code, and the
same model run on separate sequences (packing, padding)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, KimiLinearConfig, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

import hybrid_linear_models
from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM, HybridLinearModel
from hybrid_linear_models.mixer_kimi_delta import HybridLinearKimiDeltaAttention
from hybrid_linear_models.sequence_info import SequenceInfo
from model_helpers import ALL_TYPES, randomize, tiny_config, tiny_model

# Packing and padding tests run in float64 (the kernels then compute in float64 too): the packed and separate runs
# take different kernel paths (chunked vs token by token), so in float32 they differ by rounding amplified by
# cancellation in the gradient sums (~1e-5 relative); in float64 any real leak between documents stands out.
EXACT = dict(atol=1e-10, rtol=1e-9)

# float32 end to end: the chunked delta rule and transformers' code differ only by rounding (measured ~3e-6 on logits
# of magnitude ~3); 1e-4 leaves room for the reduction order of a few layers, and is far below any mapping error.
LOGITS_TOL = 1e-4

QWEN_TYPES = {"gated_deltanet": "linear_attention", "full_attention": "full_attention"}


def _qwen_pair(layer_types, gdn_heads, seed=0):
    """transformers' Qwen3NextForCausalLM (dense MLPs) and ours, with identical weights under identical names."""
    key_heads, value_heads = gdn_heads
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6)
    qwen_config = Qwen3NextConfig(
        **common, num_hidden_layers=len(layer_types), layer_types=[QWEN_TYPES[t] for t in layer_types],
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=16,
        linear_value_head_dim=8, mlp_only_layers=list(range(len(layer_types))), num_experts=2, num_experts_per_tok=1,
    )
    qwen_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    reference = randomize(Qwen3NextForCausalLM(qwen_config), seed).eval()
    ours_config = HybridLinearConfig(
        **common, layer_types=layer_types, gdn_num_key_heads=key_heads, gdn_num_value_heads=value_heads,
        gdn_key_head_dim=16, gdn_value_head_dim=8, rope_parameters=dict(qwen_config.rope_parameters),
        attention_output_gate=True, attention_qk_norm=True, zero_centered_norms=True,
    )
    ours = HybridLinearForCausalLM(ours_config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)  # the name map is the identity
    return reference, ours


@pytest.mark.parametrize(
    "layer_types, gdn_heads",
    [
        (["gated_deltanet", "gated_deltanet", "gated_deltanet", "full_attention"], (2, 4)),
        (["full_attention", "gated_deltanet"], (2, 2)),
        (["gated_deltanet", "full_attention", "gated_deltanet"], (1, 4)),
    ],
)
def test_logits_match_transformers_qwen3_next(layer_types, gdn_heads):
    reference, ours = _qwen_pair(layer_types, gdn_heads)
    input_ids = torch.randint(0, 128, (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = reference(input_ids).logits, ours(input_ids).logits
    assert (expected - got).abs().max() <= LOGITS_TOL


def test_kda_layer_matches_transformers_kimi_linear():
    kimi_config = KimiLinearConfig(
        hidden_size=64, num_hidden_layers=1, rms_norm_eps=1e-5,
        linear_attn_config=dict(num_heads=4, head_dim=16, short_conv_kernel_size=4, kda_layers=[1], full_attn_layers=[]),
    )
    torch.manual_seed(0)
    reference = randomize(KimiLinearDeltaAttention(kimi_config, 0)).eval()
    config = HybridLinearConfig(hidden_size=64, layer_types=["kimi_delta_attention"], kda_num_heads=4, kda_head_dim=16,
                                kda_gate_activation="sigmoid", rms_norm_eps=1e-5)
    ours = HybridLinearKimiDeltaAttention(config, 0)
    state = reference.state_dict()
    fused_conv = state.pop("conv1d.weight")  # transformers 5 fuses the three convolutions
    mapped = {name.removeprefix("forget_gate."): value for name, value in state.items()}
    mapped["A_log"] = mapped["A_log"].reshape(-1)
    mapped.update(zip(["q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"], fused_conv.chunk(3)))
    ours.load_state_dict(mapped, strict=True)
    x = torch.randn(2, 100, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = reference(x), ours(x, SequenceInfo(2, 100))
    assert (expected - got).abs().max() <= 1e-5  # one layer, outputs ~1


@pytest.mark.parametrize("layer_type", ALL_TYPES)
def test_packed_rows_equal_separate_documents(layer_type):
    """position_ids restarting at 0 inside a row (DataCollatorWithFlattening) keep the documents apart."""
    model = tiny_model([layer_type, "gated_deltanet" if layer_type != "gated_deltanet" else "full_attention"]).double()
    lengths = [5, 17, 1, 9]
    generator = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 128, (1, n), generator=generator) for n in lengths]
    packed = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)

    packed_out = model(packed, position_ids=position_ids).logits
    packed_out.square().sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    separate = [model(doc).logits for doc in docs]
    sum(out.square().sum() for out in separate).backward()

    torch.testing.assert_close(packed_out, torch.cat(separate, dim=1), **EXACT)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, **EXACT, msg=name)


def test_flattening_kwargs_equal_separate_documents():
    """cu_seq_lens_q (return_flash_attn_kwargs=True) without position_ids keeps documents apart in every mixer."""
    model = tiny_model().double()
    lengths = [7, 12, 3]
    generator = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 128, (1, n), generator=generator) for n in lengths]
    cu = torch.tensor([0, 7, 19, 22], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs, 1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12).logits
        separate = torch.cat([model(doc).logits for doc in docs], dim=1)
    torch.testing.assert_close(packed, separate, **EXACT)


def test_packed_rows_over_a_batch_of_several_rows():
    model = tiny_model().double()
    generator = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 128, (2, 12), generator=generator)
    position_ids = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    with torch.no_grad():
        packed = model(rows, position_ids=position_ids).logits
        expected = [model(rows[:1, :5]).logits, model(rows[:1, 5:]).logits, model(rows[1:]).logits]
    torch.testing.assert_close(packed[:1, :5], expected[0], **EXACT)
    torch.testing.assert_close(packed[:1, 5:], expected[1], **EXACT)
    torch.testing.assert_close(packed[1:], expected[2], **EXACT)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_left_padding_equals_rows_alone(attn_implementation):
    model = tiny_model().double()
    model.set_attn_implementation(attn_implementation)
    generator = torch.Generator().manual_seed(6)
    lengths = [11, 6, 9]
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    rows = []
    for i, n in enumerate(lengths):
        rows.append(torch.randint(1, 128, (1, n), generator=generator))
        input_ids[i, width - n :] = rows[-1]
        attention_mask[i, width - n :] = 1
    with torch.no_grad():
        batched = model(input_ids, attention_mask=attention_mask).logits
        for i, row in enumerate(rows):
            alone = model(row).logits
            torch.testing.assert_close(batched[i, width - lengths[i] :], alone[0], **EXACT)


def test_eager_and_sdpa_agree():
    model = tiny_model()
    input_ids = torch.randint(0, 128, (2, 15), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(input_ids).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(input_ids).logits
    torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=1e-5)


def test_save_and_reload_gives_the_same_logits(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.mixer_types == ALL_TYPES and config.auto_map["AutoModelForCausalLM"].endswith("HybridLinearForCausalLM")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, HybridLinearForCausalLM)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    input_ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reloaded(input_ids).logits, atol=0, rtol=0)


def test_loss_logits_to_keep_inputs_embeds_and_hidden_states():
    model = tiny_model()
    input_ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(9))
    labels = input_ids.clone()
    labels[0, :3] = -100
    out = model(input_ids, labels=labels, output_hidden_states=True)
    logits = out.logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    last = model(input_ids, logits_to_keep=1).logits
    torch.testing.assert_close(last, logits[:, -1:], atol=1e-6, rtol=1e-6)
    embeds = model.model.embed_tokens(input_ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, logits, atol=1e-6, rtol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model().train()
    input_ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(10))
    model(input_ids, labels=input_ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids, labels=input_ids).loss.backward()
    for name, param in model.named_parameters():
        assert (param.grad - plain[name]).abs().max() <= 1e-5 * plain[name].abs().max(), name


def test_bfloat16_forward_and_backward_are_finite():
    model = tiny_model().to(torch.bfloat16).train()
    input_ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(11))
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_default_config_is_a_small_qwen3_next_like_model():
    config = HybridLinearConfig()
    assert config.mixer_types.count("gated_deltanet") == 3 * config.mixer_types.count("full_attention")
    assert config.num_hidden_layers == len(config.layer_types)
    assert config.attention_output_gate and config.zero_centered_norms
    assert config.rope_parameters["partial_rotary_factor"] == 0.25


def test_fresh_init_is_finite_in_bfloat16():
    config = tiny_config()
    model = HybridLinearForCausalLM(config).to(torch.bfloat16)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
    gdn = model.model.layers[0].linear_attn
    assert torch.all(gdn.A_log.float().exp() >= 0.009) and torch.all(gdn.A_log.float().exp() <= 16.1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(layer_types=["full_attention", "mamba"]), "unknown entries \\['mamba'\\]"),
        (dict(layer_types=["full_attention"], num_hidden_layers=2), "num_hidden_layers=2 but layer_types has 1"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "multiple of num_key_value_heads=3"),
        (dict(gdn_num_key_heads=3, gdn_num_value_heads=4), "gdn_num_value_heads=4 must be a multiple"),
        (dict(layer_types=["sliding_attention"], sliding_window=None), "sliding_window must be a positive integer"),
        (dict(kda_gate_activation="tanh"), "kda_gate_activation must be one of"),
        (dict(head_dim=0), "head_dim must be a positive integer"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}),
         "partial_rotary_factor"),
    ],
)
def test_bad_config_raises_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(torch.rand(2, 5)), "input_ids must be a 2-D tensor of integer token ids"),
        (lambda m: m(torch.zeros(2, 3, 5, dtype=torch.long)), "input_ids must be a 2-D tensor"),
        (lambda m: m(torch.full((1, 4), 500)), "input_ids must lie in \\[0, 128\\)"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long)), "labels must"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(3, 5)), "attention_mask must"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), position_ids=torch.arange(4)[None]), "position_ids must"),
        (lambda m: m(inputs_embeds=torch.rand(2, 5, 7)), "inputs_embeds must be"),
        (lambda m: m(), "exactly one of input_ids"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        call(model)


def test_auto_classes_are_registered():
    settings = {k: v for k, v in tiny_config().to_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("hybrid_linear", **settings)
    assert isinstance(config, HybridLinearConfig)
    assert type(AutoModelForCausalLM.from_config(config)) is HybridLinearForCausalLM
    assert hybrid_linear_models.HybridLinearModel is HybridLinearModel


def test_first_forward_logs_the_torch_kernel_path_once(caplog):
    from hybrid_linear_models import fla_backend

    fla_backend._announced.clear()
    model = tiny_model(["gated_deltanet", "kimi_delta_attention"])
    with caplog.at_level(logging.INFO, logger="hybrid_linear_models.fla_backend"):
        model(torch.randint(0, 128, (1, 30)))
        model(torch.randint(0, 128, (1, 30)))
    messages = [r.getMessage() for r in caplog.records if r.name == "hybrid_linear_models.fla_backend"]
    assert len(messages) == 1 and "pure-PyTorch" in messages[0]


def test_device_map_auto_loads(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    placed = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto")
    input_ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        torch.testing.assert_close(placed(input_ids).logits.cpu(), model(input_ids).logits, atol=1e-6, rtol=1e-6)
