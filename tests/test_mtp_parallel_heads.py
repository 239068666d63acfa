"""Fast-LLM's parallel MTP heads (mtp_parallel_heads.py, mtp_parallel_drafting.py): the heads' math against their
definition, the MTP loss, and `generate(use_mtp=k)` for one row and for a left-padded batch.

The reference of head d is Fast-LLM's definition taken literally: the model with its last decoder layer replaced by
head d's block and its final norm by head d's norm is a plain model of this family, whose logits at position t are
head d's prediction of token t + d + 1. Built as a separate model from the same tensors, its forward runs the block
on the trunk through the model's own code path, so a head fed the last layer's output instead of its input, the
final norm instead of its own, or a target shifted by one position too few differs by 1e-2 and more. Float64.

Drafting is checked three ways: greedy output is plain greedy decoding's whatever the heads say (random heads);
heads that always agree have every draft accepted, heads that never agree none, and heads that agree on the first
draft only have exactly one accepted a round; and every round's draft logits equal the heads run afresh over the
accepted tokens (an uncached forward), which the heads' own caches (GDN/KDA states included) must reproduce.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import HostReadsRefused, replay_rounds_eagerly, tiny_model
from test_mtp import _record_rounds, _zero_blocks, check_drafts
from test_mtp_batched import _rounds, assert_rows_end_as_alone, track_rows
from test_speculative_batched import NEW, _alone, _batch

from hybrid_linear_models import (
    HybridLinearConfig,
    HybridLinearForCausalLM,
    speculative_decoding,
)
from hybrid_linear_models.configuration_hybrid_linear import MTP_TYPES
from hybrid_linear_models.mtp_heads import MTP_HEADS
from hybrid_linear_models.mtp_parallel_drafting import (
    ParallelMtpBatchDrafter,
    ParallelMtpCandidateGenerator,
)
from hybrid_linear_models.speculative_decoding import speculative_generate

# transformers' loss takes the logits in float32 (see test_mtp.LOSS_TOL)
LOSS_TOL = 2e-6
# draft logits are float32, as generate takes the model's: rounding ~1e-6 on logits of order 10
DRAFT_TOL = 1e-5
LAST_LAYERS = {  # the last layer, which the heads copy: recurrent (GDN, KDA) and attention (full, sliding)
    "gdn": ["full_attention", "kimi_delta_attention", "gated_deltanet"],
    "kda": ["gated_deltanet", "full_attention", "kimi_delta_attention"],
    "attention": ["gated_deltanet", "kimi_delta_attention", "full_attention"],
    "sliding": ["gated_deltanet", "full_attention", "sliding_attention"],
}


def _model(last="gdn", heads=2, seed=0, **overrides) -> HybridLinearForCausalLM:
    return tiny_model(LAST_LAYERS[last], seed=seed, num_mtp_layers=heads, mtp_type="fast_llm", **overrides).double()


def _ids(shape, seed=0):
    return torch.randint(2, 128, shape, generator=torch.Generator().manual_seed(seed))


def _head_as_model(model: HybridLinearForCausalLM, depth: int) -> HybridLinearForCausalLM:
    """The model with its last layer replaced by head `depth`'s block (1-based) and its final norm by the head's."""
    config = HybridLinearConfig.from_dict({**model.config.to_dict(), "num_mtp_layers": 0, "mtp_mlp_type": None})
    plain = HybridLinearForCausalLM(config).double().eval()
    last = model.config.num_hidden_layers - 1
    weights = {name: tensor for name, tensor in model.state_dict().items() if not name.startswith("mtp.")}
    for name, tensor in model.mtp.layers[depth - 1].state_dict().items():
        weights[f"model.layers.{last}.{name}"] = tensor
    weights["model.norm.weight"] = model.mtp.norms[depth - 1].weight
    plain.load_state_dict(weights)
    return plain


def _trunk(model: HybridLinearForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's input over `ids`, by an uncached forward."""
    return model.model(ids, output_hidden_states=True).hidden_states[model.config.num_hidden_layers - 1]


# ------------------------------------------------------------------------------------------- config and math


def test_every_mtp_type_has_its_modules():
    assert tuple(MTP_HEADS) == MTP_TYPES


@pytest.mark.parametrize("last", sorted(LAST_LAYERS))
def test_each_head_is_the_model_with_its_block_and_norm_in_place_of_the_last(last):
    model = _model(last, heads=3)
    ids = _ids((2, 11))
    with torch.no_grad():
        outputs = model.mtp(_trunk(model, ids), torch.arange(11).unsqueeze(0))
        for depth, g in enumerate(outputs, start=1):
            expected = _head_as_model(model, depth)(ids).logits
            assert (model.lm_head(g) - expected).abs().max() <= 1e-10, depth


def test_a_one_layer_model_whose_layer_has_its_own_settings_converts(tmp_path):
    """The heads copy layer 0 with its overrides: the converter's layout (hf_layout) builds them so too."""
    from hybrid_linear_models.conversion import convert_checkpoint

    model = tiny_model(["full_attention"], num_mtp_layers=2, mtp_type="fast_llm",
                       per_layer_config={0: {"num_key_value_heads": 1}})
    model.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "again", from_format="hf", to_format="hf")
    again = HybridLinearForCausalLM.from_pretrained(tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_the_heads_copy_the_last_layer_with_its_own_settings():
    """A last layer with per-layer settings of its own (one KV head) gives its heads the same."""
    model = _model("attention", per_layer_config={2: {"num_key_value_heads": 1}})
    assert model.mtp.layers[1].self_attn.k_proj.weight.shape[0] == 16  # one KV head of 16
    assert model.mtp.config.mixer_types == ["full_attention"] * 2
    ids = _ids((1, 7))
    with torch.no_grad():
        g = model.mtp(_trunk(model, ids), torch.arange(7).unsqueeze(0))[1]
        assert (model.lm_head(g) - _head_as_model(model, 2)(ids).logits).abs().max() <= 1e-10


def test_mtp_loss_is_the_mean_of_each_heads_cross_entropy_at_its_distance():
    model = _model(heads=3)
    ids = _ids((2, 12), seed=1)
    with torch.no_grad():
        losses = []
        for depth in (1, 2, 3):  # head d predicts token t + d + 1
            logits = _head_as_model(model, depth)(ids).logits[:, : 12 - depth - 1]
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, 128).float(),
                                                            ids[:, depth + 1:].reshape(-1)))
        out = model(input_ids=ids, labels=ids, mtp_loss_weight=0.5)
        plain = model(input_ids=ids, labels=ids)
    expected = torch.stack(losses).mean()
    assert (out.mtp_loss - expected).abs() <= LOSS_TOL, (out.mtp_loss, expected)
    assert (out.loss - (plain.loss + 0.5 * out.mtp_loss)).abs() <= LOSS_TOL
    assert out.hidden_states is None  # (the trunk was selected for the loss, not returned)


def test_the_loss_returns_the_hidden_states_the_caller_asked_for():
    model = _model()
    ids = _ids((1, 8))
    with torch.no_grad():
        every = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0, output_hidden_states=True)
        last = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0, output_hidden_states=-1)
        plain = model(input_ids=ids, output_hidden_states=True)
        nothing = [model(input_ids=ids, labels=ids, mtp_loss_weight=1.0, output_hidden_states=asked).hidden_states
                   for asked in (0, [], False)]  # (falsy, as transformers reads them: none)
        model.config.output_hidden_states = True  # (the config's flag, where the call says nothing)
        flagged = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0)
    assert len(every.hidden_states) == 4 and all(torch.equal(a, b) for a, b in zip(every.hidden_states,
                                                                                    plain.hidden_states))
    assert [h is None for h in last.hidden_states] == [True, True, True, False]
    assert nothing == [None, None, None]
    assert len(flagged.hidden_states) == 4 and all(torch.equal(a, b) for a, b in zip(flagged.hidden_states,
                                                                                      plain.hidden_states))
    assert (flagged.mtp_loss - every.mtp_loss).abs() == 0


def test_a_padded_rows_loss_is_its_unpadded_loss():
    model = _model("kda")
    ids = _ids((1, 9), seed=3)
    with torch.no_grad():
        alone = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0).mtp_loss
        padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
        padded = model(input_ids=padded_ids, attention_mask=mask, labels=padded_ids.masked_fill(mask == 0, -100),
                       mtp_loss_weight=1.0).mtp_loss
    assert (padded - alone).abs() <= LOSS_TOL, (padded, alone)


@pytest.mark.parametrize("heads", [1, 3])
def test_sequences_too_short_for_a_target_add_no_mtp_loss(heads):
    """Depth d's targets are tokens t + d + 1: at T = d + 1 there is none, and that depth is left out (its mean over
    no targets would be NaN); at T = 2 no depth has one, and the MTP loss is 0."""
    model = _model(heads=heads)
    for length in range(2, heads + 3):
        ids = _ids((2, length), seed=length)
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0)
            expected = []
            for depth in range(1, min(heads, length - 2) + 1):
                logits = _head_as_model(model, depth)(ids).logits[:, : length - depth - 1]
                expected.append(torch.nn.functional.cross_entropy(logits.reshape(-1, 128).float(),
                                                                  ids[:, depth + 1:].reshape(-1)))
        assert torch.isfinite(out.loss) and torch.isfinite(out.mtp_loss), length
        want = torch.stack(expected).mean() if expected else torch.zeros(())
        assert (out.mtp_loss - want).abs() <= LOSS_TOL, (length, out.mtp_loss, want)


def test_a_checkpoint_with_the_other_kinds_heads_is_refused_before_any_weight(tmp_path):
    """A folder saved with Qwen3-Next's head, loaded as Fast-LLM's heads (or the other way): the other kind's tensors
    would fill this head's block of the same name by name. One line; num_mtp_layers=0 loads it without heads, and
    an override of mtp_type resolves the heads' MLP for that kind (the saved one was the other kind's)."""
    qwen = tiny_model(["gated_deltanet", "full_attention"], mlp_types=["dense", "sparse_moe"], num_experts=4,
                      num_experts_per_tok=2, num_mtp_layers=1)
    qwen.save_pretrained(tmp_path / "qwen")
    _model().save_pretrained(tmp_path / "fast_llm")
    for folder, kind in (("qwen", "fast_llm"), ("fast_llm", "qwen3_next")):
        with pytest.raises(ValueError, match=r"^the checkpoint's MTP tensors \(mtp\..*\) are not those of this "
                                             rf"model's heads \(mtp_type '{kind}'") as caught:
            HybridLinearForCausalLM.from_pretrained(tmp_path / folder, mtp_type=kind, num_mtp_layers=1)
        assert "\n" not in str(caught.value)
    assert HybridLinearForCausalLM.from_pretrained(tmp_path / "qwen", num_mtp_layers=0).config.num_mtp_layers == 0
    config = HybridLinearConfig.from_pretrained(tmp_path / "qwen", mtp_type="fast_llm", num_mtp_layers=2)
    assert (config.mtp_type, config.mtp_mlp_type) == ("fast_llm", "sparse_moe")


@pytest.mark.parametrize("overrides, fragment", [
    ({"mtp_type": "medusa"}, "mtp_type must be one of ('qwen3_next', 'fast_llm'), got 'medusa'"),
    ({"mtp_type": "fast_llm", "mlp_types": ["dense", "dense", "sparse_moe"], "mtp_mlp_type": "dense"},
     ("mtp_mlp_type is 'dense' but mtp_type='fast_llm' heads are copies of the last decoder layer, whose MLP is "
      "'sparse_moe'")),
])
def test_bad_mtp_settings_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ValueError, match="^Invalid HybridLinearConfig: ") as caught:
        tiny_model(LAST_LAYERS["gdn"], num_mtp_layers=1, **overrides)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_the_heads_mlp_defaults_to_the_last_layers():
    config = tiny_model(LAST_LAYERS["gdn"], num_mtp_layers=1, mtp_type="fast_llm",
                        mlp_types=["dense", "dense", "sparse_moe"], num_experts=4, num_experts_per_tok=2).config
    assert config.mtp_mlp_type == "sparse_moe"


# ------------------------------------------------------------------------------------------------ drafting


def _constant_model(signs: tuple[float, ...]) -> HybridLinearForCausalLM:
    """A model whose every next token is 5 (the embeddings share a direction the LM head's row 5 reads, every other
    row zero), with heads whose norms scale by signs[d]: a head of sign 1 drafts 5 (right), of sign -1 a token of
    zero logit (never 5)."""
    model = _model(heads=len(signs))
    _zero_blocks(model)  # (the trunk is then the embedding, and each head's g is rms(e(x_t)), as the model's own h)
    with torch.no_grad():
        base = torch.randn(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        model.model.embed_tokens.weight.mul_(0.1).add_(base)
        model.lm_head.weight.zero_()
        model.lm_head.weight[5] = base
        for norm, sign in zip(model.mtp.norms, signs):
            norm.weight.fill_(sign - 1.0)  # (zero-centred: a scale of sign)
    return model


@pytest.mark.parametrize("last", [*sorted(LAST_LAYERS), "one layer"])
@pytest.mark.parametrize("use_mtp", [1, True])
def test_greedy_with_random_heads_is_plain_greedy(last, use_mtp):
    """(One layer: the trunk is the embeddings, hidden state 0, which transformers reads as a falsy selection unless
    it is given in a list.)"""
    model = _model(last, heads=3) if last != "one layer" else tiny_model(
        ["gated_deltanet"], num_mtp_layers=3, mtp_type="fast_llm").double()
    ids = _ids((1, 7), seed=1)
    plain = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=use_mtp), plain)


@pytest.mark.parametrize("signs, accepted", [((1.0, 1.0, 1.0), 3), ((-1.0, -1.0), 0), ((1.0, -1.0), 1)])
def test_heads_that_agree_have_their_drafts_accepted(monkeypatch, signs, accepted):
    model = _constant_model(signs)
    rounds = _record_rounds(monkeypatch, ParallelMtpCandidateGenerator)
    ids = _ids((1, 5), seed=2)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain[0, 5:], torch.full((12,), 5))
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=True), plain)
    full = [r for r in rounds if r[0] == len(signs)]
    assert full and all(got == accepted for _, got in full), rounds


@pytest.mark.parametrize("last", ["gdn", "kda", "sliding"])
def test_every_rounds_drafts_are_the_heads_run_afresh_over_the_accepted_tokens(monkeypatch, last):
    """The heads' own caches after rounds of full, partial and no acceptance: each round's draft logits equal the
    heads run from scratch over the accepted sequence (the trunk of a fresh forward), every draft of the round."""
    model = _model(last, heads=3)

    def every_draft(input_ids):
        outputs = model.mtp(_trunk(model, input_ids[:, :-1]), torch.arange(input_ids.shape[1] - 1).unsqueeze(0))
        return [model.lm_head(g[:, -1]).float() for g in outputs]

    checked = check_drafts(monkeypatch, ParallelMtpCandidateGenerator, every_draft)
    ids = _ids((1, 5), seed=2)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=3), plain)
    assert len(checked) >= 3 * 3 and max(checked) <= DRAFT_TOL, checked


def test_a_model_with_fp8_layers_drafts_in_the_embeddings_dtype():
    """An FP8 checkpoint's model (its heads' and LM head's linear layers FP8, dequantized on the CPU): the heads read
    the trunk in the embeddings' dtype, not the FP8 LM head's storage dtype; greedy output is plain greedy's."""
    fields = tiny_model(["full_attention", "gated_deltanet"], num_mtp_layers=2, mtp_type="fast_llm").config.to_dict()
    fields["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                     "activation_scheme": "dynamic", "modules_to_not_convert": []}
    model = HybridLinearForCausalLM(HybridLinearConfig.from_dict(fields)).eval()
    assert model.lm_head.weight.dtype == torch.float8_e4m3fn
    ids = _ids((1, 6))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False)
        for rows in (ids, ids.repeat(2, 1)):  # (one row: transformers' loop; two: the batched one)
            out = model.generate(rows, max_new_tokens=6, do_sample=False, use_mtp=2)
            assert all(torch.equal(row, plain[0]) for row in out)


def test_drafting_with_hidden_states_asked_for_is_refused_before_any_forward():
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    refusal = r"^use_mtp takes the hidden states .* \(output_hidden_states=True\)"
    with pytest.raises(ValueError, match=refusal) as caught:
        model.generate(_ids((1, 5)), max_new_tokens=4, do_sample=False, use_mtp=2, output_hidden_states=True,
                       return_dict_in_generate=True)
    assert "\n" not in str(caught.value) and not calls


def test_more_drafts_than_heads_are_refused_before_any_forward():
    model = _model(heads=2)
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError) as caught:
        model.generate(_ids((1, 5)), max_new_tokens=4, do_sample=False, use_mtp=3)
    assert str(caught.value) == ("use_mtp=3 asks for more drafts than this model's 2 MTP layer(s) give (Fast-LLM's "
                                 "heads: one draft each, config.num_mtp_layers); pass use_mtp from 1 to 2, or True.")
    assert not calls


# ------------------------------------------------------------------------------------------ batched drafting


@pytest.mark.parametrize("last", sorted(LAST_LAYERS))
@pytest.mark.parametrize("use_mtp", [1, 3])
def test_each_row_of_a_batch_is_its_plain_greedy_decoding(last, use_mtp):
    model = _model(last, heads=3)
    ids, mask = _batch()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             use_mtp=use_mtp)
    assert torch.equal(out[:, ids.shape[1]:], _alone(model, ids, mask))


@pytest.mark.parametrize("signs, kept", [((1.0, 1.0, 1.0), 4), ((-1.0, -1.0, -1.0), 1), ((1.0, -1.0, 1.0), 2)])
def test_batched_heads_that_agree_have_their_drafts_accepted_in_every_row(monkeypatch, signs, kept):
    model = _constant_model(signs)
    seen = _rounds(monkeypatch, ParallelMtpBatchDrafter)
    ids, mask = _batch()
    with torch.no_grad():
        out = speculative_generate(model, ids, ParallelMtpBatchDrafter(model), num_tokens=4, max_new_tokens=NEW,
                                   attention_mask=mask)
    assert torch.equal(out[:, ids.shape[1]:], _alone(model, ids, mask))
    assert seen and all(round_ == [kept] * 3 for round_ in seen[:-1]), seen


@pytest.mark.parametrize("last", ["gdn", "kda", "attention"])
def test_every_batched_draft_is_the_heads_run_afresh_over_the_rows_accepted_tokens(monkeypatch, last):
    """The heads' shared VerifyCache: after rounds of full, partial and no acceptance, rows of different lengths,
    each row's heads' outputs equal the heads over that row's accepted sequence alone, from scratch."""
    model = _model(last, heads=3)
    ids, mask = _batch()
    rows = [row[real].tolist() for row, real in zip(ids, mask.bool())]  # each row's accepted tokens so far
    errors = []

    def check(drafter):
        got = model.lm_head(drafter.g).float()  # [B, D, V]
        for b, tokens in enumerate(rows):
            sequence = torch.tensor([tokens[:-1]])  # (the last token gained is the model's; the heads drafted from
            # the position before it)
            outputs = model.mtp(_trunk(model, sequence), torch.arange(sequence.shape[1]).unsqueeze(0))
            for d, g in enumerate(outputs):
                errors.append((got[b, d] - model.lm_head(g[0, -1]).float()).abs().max().item())

    track_rows(monkeypatch, ParallelMtpBatchDrafter, rows, check)
    with torch.no_grad():
        out = speculative_generate(model, ids, ParallelMtpBatchDrafter(model), num_tokens=4, max_new_tokens=NEW,
                                   attention_mask=mask)
    assert torch.equal(out[:, ids.shape[1]:], _alone(model, ids, mask))
    assert len(errors) > 3 * 3 * 2 and max(errors) <= DRAFT_TOL, errors


def _started(model, ids, mask, num_tokens, slots=40):
    """A verify cache and the heads' drafter after the prompts, and the first round's tokens [B, num_tokens]."""
    cache = speculative_decoding.VerifyCache(model, ids.shape[0], slots, ids.device)
    drafter = ParallelMtpBatchDrafter(model)
    first, hidden = speculative_decoding.prefill(model, cache, ids, mask, with_hidden=True)
    drafter.start(ids, mask, hidden, first, cache.slots)
    return cache, drafter, torch.cat([first[:, None], drafter.draft(None, num_tokens - 1)], dim=1)


@pytest.mark.parametrize("last", ["gdn", "attention"])
def test_a_drafting_round_reads_nothing_on_the_host(last):
    """The round, the heads' entries and restore, and the next drafts read no device value on the host (what a CUDA
    graph captures)."""
    model = _model(last, heads=3)
    ids, mask = _batch()
    with torch.no_grad():
        cache, drafter, step = _started(model, ids, mask, 4)
        with HostReadsRefused():
            greedy, _kept, drafts = speculative_decoding.drafting_round(model, cache, step,
                                                                        torch.ones(3, dtype=torch.bool), drafter)
    assert drafts.shape == (3, 3) and greedy.shape == (3, 4)


@pytest.mark.parametrize("signs", [(1.0, -1.0, 1.0), (1.0, 1.0, 1.0)])
@pytest.mark.parametrize("ahead", [0, 1])
def test_captured_rounds_and_rounds_run_ahead_keep_every_row_exact(monkeypatch, signs, ahead):
    """`graphs=True` (the capture stood in by an eager replay of the captured function), with and without a round
    launched ahead of the host's read (forced here on the CPU): each row's tokens are its plain greedy decoding,
    cut at its end-of-sequence token and padded after it, and every round after the first is a replay."""
    monkeypatch.setattr(speculative_decoding, "rounds_ahead", lambda on_device, device: ahead * int(on_device))
    model = _constant_model(signs)
    with torch.no_grad():  # (a model whose token is not always 5: its last block back, so rows differ)
        model.model.layers[2].linear_attn.out_proj.weight.normal_(0, 0.5)
    replays = replay_rounds_eagerly(monkeypatch)
    assert_rows_end_as_alone(model, ParallelMtpBatchDrafter, graphs=True)
    assert len(replays) > 2

