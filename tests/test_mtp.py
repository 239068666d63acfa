"""Multi-token prediction (mtp_head.py, mtp_drafting.py): the head's math and loss against a reference built from
plain pieces, training the heads alone, and `generate(use_mtp=k)`, whose greedy output is plain greedy decoding's
token for token whether the head's drafts are random, always right or always wrong.

Float64 throughout. The loss reference computes the same math in another order (the block run by a separate
one-layer model's own forward, the norms and the fusion written out here), its logits agreeing to float64 rounding;
the losses are compared within LOSS_TOL, as transformers' loss takes the logits in float32 (see LOSS_TOL). A swapped
concatenation, a norm taken as w instead of 1 + w, or labels shifted by one position too few change the loss by 1e-2
and more.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from model_helpers import (
    WITHOUT_THE_PACKAGE_PRELUDE,
    run_without_the_package,
    tiny_config,
    tiny_model,
)

from hybrid_linear_models import (
    HybridLinearConfig,
    HybridLinearForCausalLM,
    HybridLinearModel,
)
from hybrid_linear_models.mtp_drafting import MtpCandidateGenerator

# transformers' causal-LM loss takes the logits in float32 (eps 1.2e-7): a loss of order 5 from a log-sum-exp over 128
# logits of order 10 rounds to within a few 1e-7 whatever the logits' own precision; a mistake moves it by 1e-2
LOSS_TOL = 2e-6
LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention"]


def _model(layer_types=LAYERS, seed=0, **overrides) -> HybridLinearForCausalLM:
    return tiny_model(layer_types, seed=seed, **{"num_mtp_layers": 1, **overrides}).double()


def _ids(shape, seed=0):
    return torch.randint(2, 128, shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------- config


def test_configs_without_mtp_fields_load_unchanged(tmp_path):
    """A config.json written without the MTP fields loads as the model it was: no head."""
    config = tiny_config(LAYERS)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for name in ("num_mtp_layers", "mtp_mlp_type", "mtp_loss_weight"):
        del written[name]
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded = HybridLinearConfig.from_pretrained(tmp_path)
    assert loaded.num_mtp_layers == 0 and loaded.mtp_mlp_type is None and loaded.mtp_loss_weight == 0.0
    model = HybridLinearForCausalLM(loaded)
    assert not hasattr(model, "mtp") and not any(name.startswith("mtp.") for name in model.state_dict())


def test_mtp_config_fields():
    config = tiny_config(LAYERS, num_mtp_layers=1, mlp_types=["sparse_moe", "dense", "dense"], num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    assert config.mtp_mlp_type == "sparse_moe"  # the first layer's MLP, as vLLM builds Qwen3-Next's MTP layer
    again = HybridLinearConfig.from_dict(config.to_dict())
    assert again.num_mtp_layers == 1 and again.mtp_mlp_type == "sparse_moe"
    with pytest.raises(ValueError, match=r"mtp_mlp_type must be one of .*got 'moe'"):
        tiny_config(LAYERS, num_mtp_layers=1, mtp_mlp_type="moe")
    with pytest.raises(ValueError, match=r"num_mtp_layers must be a positive integer.* or 0"):
        tiny_config(LAYERS, num_mtp_layers=-1)
    with pytest.raises(ValueError, match=r"num_mtp_layers must be at most 100000, got 1000000"):
        tiny_config(LAYERS, num_mtp_layers=10**6)  # (refused before a million layers are built)
    with pytest.raises(ValueError, match=r"mtp_loss_weight must be in \[0.0, inf\)"):
        tiny_config(LAYERS, mtp_loss_weight=-0.5)


def test_from_pretrained_adds_a_fresh_head_to_a_model_saved_without_one(tmp_path):
    tiny_model(LAYERS).save_pretrained(tmp_path)
    model, info = HybridLinearForCausalLM.from_pretrained(tmp_path, num_mtp_layers=1, output_loading_info=True)
    assert model.config.mtp_mlp_type == "dense" and "mtp.fc.weight" in info["missing_keys"]
    assert not any(key.startswith("model.") for key in info["missing_keys"])


def test_the_head_saves_and_loads_under_qwen3_next_names(tmp_path):
    model = _model()
    names = [name for name in model.state_dict() if name.startswith("mtp.")]
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= set(names)
    assert model.mtp.fc.weight.shape == (64, 128)
    model.save_pretrained(tmp_path)
    again, info = HybridLinearForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    for name in names:
        assert torch.equal(again.state_dict()[name].double(), model.state_dict()[name]), name


# ----------------------------------------------------------------------------------------------------- loss


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm written out: x / sqrt(mean(x^2) + eps) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def _reference_mtp_logits(model: HybridLinearForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Depth-1 MTP logits at positions 0..T-2 (predicting tokens 2..T): the fusion written out, the block and final
    norm run by a separate one-layer model's forward at positions 1..T-1."""
    eps, head = model.config.rms_norm_eps, model.mtp
    hidden = model.model(ids).last_hidden_state
    embeddings = model.model.embed_tokens(ids)
    fused = torch.cat([_rms(embeddings[:, 1:], head.pre_fc_norm_embedding.weight, eps),
                       _rms(hidden[:, :-1], head.pre_fc_norm_hidden.weight, eps)], dim=-1) @ head.fc.weight.T
    block_config = tiny_config(["full_attention"])
    block = HybridLinearModel(block_config).double().eval()
    block.layers[0].load_state_dict(head.layers[0].state_dict())
    block.norm.load_state_dict(head.norm.state_dict())
    positions = torch.arange(1, ids.shape[1]).unsqueeze(0)
    g = block(inputs_embeds=fused, position_ids=positions, use_cache=False).last_hidden_state
    return g @ model.lm_head.weight.T


def test_mtp_loss_equals_the_reference():
    model = _model()
    ids = _ids((2, 11))
    with torch.no_grad():
        logits = _reference_mtp_logits(model, ids)
        expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128).float(), ids[:, 2:].reshape(-1))
        out = model(input_ids=ids, labels=ids, mtp_loss_weight=0.3)
        plain = model(input_ids=ids, labels=ids)
    assert (out.mtp_loss - expected).abs() <= LOSS_TOL, (out.mtp_loss, expected)
    assert plain.mtp_loss is None
    assert (out.loss - (plain.loss + 0.3 * out.mtp_loss)).abs() <= LOSS_TOL
    with torch.no_grad():  # the config's weight when the forward gives none
        model.config.mtp_loss_weight = 0.3
        assert (model(input_ids=ids, labels=ids).loss - out.loss).abs() <= LOSS_TOL


def test_mtp_loss_skips_ignored_labels_and_padding():
    """-100 labels are not counted; a left-padded row's loss is its unpadded loss (positions count real tokens)."""
    model = _model()
    ids = _ids((1, 9), seed=3)
    with torch.no_grad():
        alone = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0).mtp_loss
        padded_ids = torch.cat([torch.full((1, 3), 0), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
        labels = padded_ids.masked_fill(mask == 0, -100)
        padded = model(input_ids=padded_ids, attention_mask=mask, labels=labels, mtp_loss_weight=1.0).mtp_loss
        # positions as transformers and common collators build them (a pad's is 1): padding, not packing
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        given = model(input_ids=padded_ids, attention_mask=mask, labels=labels, position_ids=positions,
                      mtp_loss_weight=1.0).mtp_loss
    assert (padded - alone).abs() <= LOSS_TOL, (padded, alone)
    assert (given - padded).abs() <= LOSS_TOL, (given, padded)


def test_two_mtp_layers_chain_with_labels_shifted_by_depth():
    """Depth 2 runs layer 1 on depth 1's output and the embedding two tokens on, predicting the token three on; the
    MTP loss is the mean of the depths' losses. Drafting (one layer, Qwen3-Next's) refuses two layers by name."""
    model = _model(num_mtp_layers=2)
    ids = _ids((2, 10), seed=4)
    with torch.no_grad():
        hidden, embeddings = model.model(ids).last_hidden_state, model.model.embed_tokens(ids)
        positions = torch.arange(10).unsqueeze(0)
        g1 = model.mtp(hidden[:, :-1], embeddings[:, 1:], positions[:, 1:], 0)
        g2 = model.mtp(g1[:, :-1], embeddings[:, 2:], positions[:, 2:], 1)
        losses = [torch.nn.functional.cross_entropy(model.lm_head(g)[:, :-1].reshape(-1, 128).float(),
                                                    ids[:, d + 1:].reshape(-1)) for d, g in ((1, g1), (2, g2))]
        got = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0).mtp_loss
    assert (got - (losses[0] + losses[1]) / 2).abs() <= LOSS_TOL, (got, losses)
    with pytest.raises(ValueError, match=r"one MTP layer applied recursively .* this model has 2"):
        model.generate(ids[:1], max_new_tokens=3, do_sample=False, use_mtp=2)


@pytest.mark.parametrize("kind", [{}, {"mtp_type": "fast_llm", "num_mtp_layers": 2}])  # (Qwen3-Next's; Fast-LLM's)
def test_training_the_heads_alone_reduces_the_mtp_loss(kind):
    model = _model(**kind).train()
    model.config.fuse_linear_cross_entropy = False
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("mtp."))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not name.startswith("mtp.")}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids((2, 12), seed=5)
    losses = []
    for _ in range(8):
        out = model(input_ids=ids, labels=ids, mtp_loss_weight=1.0)
        losses.append(out.mtp_loss.item())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)


def test_bad_mtp_loss_requests_are_refused():
    ids = _ids((1, 6))
    with pytest.raises(ValueError, match=r"this model has no MTP layers \(config.num_mtp_layers is 0\)"):
        tiny_model(LAYERS)(input_ids=ids, labels=ids, mtp_loss_weight=0.5)
    model = _model()
    with pytest.raises(ValueError, match=r"mtp_loss_weight must be a finite number >= 0, got -1"):
        model(input_ids=ids, labels=ids, mtp_loss_weight=-1)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"packed sequences .* unpacked rows"):
        model(input_ids=ids, labels=ids, position_ids=packed, mtp_loss_weight=0.5)


# ------------------------------------------------------------------------------------------------- drafting


def _zero_blocks(model: HybridLinearForCausalLM) -> None:
    """Every block adds nothing (mixer output and MLP down projections zero) and every RMSNorm scales by 1: the
    model's next token depends on the current token alone, f(x) = argmax(lm_head(rms(e(x))))."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                parameter.zero_()
        for module in model.modules():
            if type(module).__name__ == "HybridLinearRMSNorm":
                module.weight.zero_()


def _head_that_agrees(model: HybridLinearForCausalLM, sign: float) -> None:
    """The head's g is sign * rms(e(next token)) up to a positive factor (fc = [sign I | 0], its block adding
    nothing): sign 1 drafts f(next token), the model's own choice; sign -1 drafts argmin, never the model's."""
    _zero_blocks(model)
    with torch.no_grad():
        hidden = model.config.hidden_size
        model.mtp.fc.weight.zero_()
        model.mtp.fc.weight[:, :hidden] = sign * torch.eye(hidden, dtype=model.mtp.fc.weight.dtype)


def _head_that_nearly_agrees(model: HybridLinearForCausalLM) -> None:
    """The agreeing head with its fc perturbed: it accepts some drafts of a round and not the rest (partial
    acceptance)."""
    _head_that_agrees(model, 1.0)
    with torch.no_grad():
        noise = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        model.mtp.fc.weight[:, :64] += 0.05 * noise


def _record_rounds(monkeypatch, generator=MtpCandidateGenerator) -> list[tuple[int, int]]:
    """(drafted, accepted) of every round of the candidate generator `generator` (a class)."""
    rounds, drafted = [], []
    get_candidates, update = generator.get_candidates, generator.update_candidate_strategy

    def counting_get(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        drafted.append(candidates.shape[1] - input_ids.shape[1])
        return candidates, logits

    def counting_update(self, input_ids, scores, num_matches):
        rounds.append((drafted[-1], int(num_matches)))
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(generator, "get_candidates", counting_get)
    monkeypatch.setattr(generator, "update_candidate_strategy", counting_update)
    return rounds


@pytest.mark.parametrize("layer_types, use_mtp", [(LAYERS, True), (LAYERS, 3),
                                                   (["gated_deltanet", "sliding_attention", "full_attention"], 2)])
def test_greedy_with_a_random_head_is_plain_greedy(layer_types, use_mtp):
    model = _model(layer_types)
    ids = _ids((1, 7), seed=1)
    plain = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=use_mtp), plain)


@pytest.mark.parametrize("use_mtp", [1, 4])
def test_a_head_that_always_agrees_has_every_draft_accepted(monkeypatch, use_mtp):
    model = _model()
    _head_that_agrees(model, 1.0)
    rounds = _record_rounds(monkeypatch)
    ids = _ids((1, 5), seed=2)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=use_mtp), plain)
    assert rounds and all(accepted == drafted for drafted, accepted in rounds), rounds
    assert max(drafted for drafted, _ in rounds) == use_mtp
    assert len(rounds) <= -(-11 // (use_mtp + 1)) + 1  # (the prompt's forward gives the first token)


@pytest.mark.parametrize("use_mtp", [1, 4])
def test_a_head_that_always_disagrees_has_no_draft_accepted(monkeypatch, use_mtp):
    model = _model()
    _head_that_agrees(model, -1.0)
    rounds = _record_rounds(monkeypatch)
    ids = _ids((1, 5), seed=2)
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, use_mtp=use_mtp), plain)
    assert rounds and all(accepted == 0 for _, accepted in rounds) and rounds[1][0] == use_mtp, rounds


def test_sampling_with_the_head_runs_and_stays_in_the_vocabulary():
    model = _model()
    torch.manual_seed(0)
    out = model.generate(_ids((1, 5)), max_new_tokens=8, do_sample=True, use_mtp=2)
    assert out.shape == (1, 13) and int(out.max()) < 128


@pytest.mark.parametrize("use_mtp, fragment", [
    (5, "use_mtp must be True or a number of draft tokens from 1 to 4, got 5"),
    (0, "use_mtp must be True or a number of draft tokens from 1 to 4, got 0"),
    ("2", "use_mtp must be True or a number of draft tokens from 1 to 4, got '2'"),
])
def test_bad_draft_lengths_are_refused_before_any_forward(use_mtp, fragment):
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError) as caught:
        model.generate(_ids((1, 5)), max_new_tokens=4, do_sample=False, use_mtp=use_mtp)
    assert str(caught.value) == fragment + "." and not calls


def test_a_model_without_mtp_weights_is_refused_before_any_forward():
    model = tiny_model(LAYERS)
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=r"^use_mtp needs the model's multi-token-prediction weights") as caught:
        model.generate(_ids((1, 5)), max_new_tokens=4, do_sample=False, use_mtp=2)
    assert "\n" not in str(caught.value) and not calls


@pytest.mark.parametrize("extra", [{"do_sample": False}, {"do_sample": True}])
def test_use_mtp_with_beam_search_is_refused_before_any_forward(extra):
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=r"^use_mtp drafts for greedy or sampled decoding.*num_beams is 2") as caught:
        model.generate(_ids((1, 5)), max_new_tokens=4, num_beams=2, use_mtp=2, **extra)
    assert "\n" not in str(caught.value) and not calls


def check_drafts(monkeypatch, generator, expected) -> list[float]:
    """Patches the candidate generator `generator` (a class): for each round that drafts, the largest difference
    between its draft logits and `expected(input_ids)`, the reference logits [B, V] of its first drafts (as many as
    the list holds, or as the round drafts); returns them, filled as generate runs."""
    checked = []
    get_candidates = generator.get_candidates

    def checking(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        if logits is not None:
            with torch.no_grad():
                references = expected(input_ids)
            checked.extend((logits[:, draft] - reference).abs().max().item()
                           for draft, reference in zip(range(logits.shape[1]), references))
        return candidates, logits

    monkeypatch.setattr(generator, "get_candidates", checking)
    return checked


@pytest.mark.parametrize("head", ["random", "nearly_right"])
def test_every_first_draft_is_the_head_run_afresh_over_the_accepted_tokens(monkeypatch, head):
    """The head's own cache after rounds of full, partial and no acceptance: each round's first draft logits equal
    the head run from scratch over the accepted sequence (the model's hidden states of a fresh forward), to float64
    rounding (the verify forwards and the fresh one differ in kernel summation order only)."""
    model = _model()
    if head == "nearly_right":
        _head_that_nearly_agrees(model)
    rounds = _record_rounds(monkeypatch)

    def first_draft(input_ids):
        hidden = model.model(input_ids).last_hidden_state
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        g = model.mtp(hidden[:, :-1], model.model.embed_tokens(input_ids[:, 1:]), positions[:, 1:])
        return [model.lm_head(g[:, -1]).float()]

    checked = check_drafts(monkeypatch, MtpCandidateGenerator, first_draft)
    ids = _ids((1, 5), seed=2)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=3), plain)
    # the drafts' logits are float32 (as generate takes the model's): rounding ~1e-6 on logits of order 10; a cache
    # entry missing, doubled or at the wrong position moves them by 1e-2 and more
    assert checked and max(checked) <= 1e-5, checked
    if head == "nearly_right":
        assert any(0 < accepted < drafted for drafted, accepted in rounds), rounds


def _padded_batch(features: list[dict]) -> dict[str, torch.Tensor]:
    """Rows padded on the right (pad 0, label -100): the MTP loss takes padding, not packing."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, feature in enumerate(features):
        ids[row, : len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
        mask[row, : len(feature["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.slow  # Trainer's setup and ten steps (tens of seconds on a loaded CPU)
def test_trainer_fine_tunes_the_heads_alone(tmp_path):
    """Trainer with the main model frozen, config.mtp_loss_weight and gradient checkpointing: the loss (main, constant,
    plus the weighted MTP loss) falls, only mtp.* parameters move."""
    datasets = pytest.importorskip("datasets")
    from transformers import Trainer, TrainingArguments

    model = tiny_model(LAYERS, seed=0, num_mtp_layers=1, mtp_loss_weight=1.0, fuse_linear_cross_entropy=False).train()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("mtp."))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not name.startswith("mtp.")}
    generator = torch.Generator().manual_seed(0)
    documents = []
    for _ in range(40):  # arithmetic progressions: a learnable rule for the token after next
        start, step = int(torch.randint(2, 60, (1,), generator=generator)), int(torch.randint(1, 4, (1,)))
        documents.append([2 + (start + step * i) % 126 for i in range(int(torch.randint(8, 16, (1,))))])
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=10, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, remove_unused_columns=False, use_cpu=True,
        activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": documents}),
                      data_collator=_padded_batch)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)


_REMOTE_CODE_RUN = WITHOUT_THE_PACKAGE_PRELUDE + textwrap.dedent("""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert "hybrid_linear_models" not in sys.modules
    ids = torch.tensor([[5, 9, 17, 3, 44, 8]])
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    drafted = model.generate(ids, max_new_tokens=6, do_sample=False, use_mtp=2)
    loss = model(input_ids=ids, labels=ids, mtp_loss_weight=0.5).mtp_loss
    print("RESULT", json.dumps({"same": bool(torch.equal(plain, drafted)), "loss": float(loss)}))
""")


@pytest.mark.slow  # a subprocess that loads the model without the package
@pytest.mark.parametrize("kind", [{}, {"mtp_type": "fast_llm", "num_mtp_layers": 2}])  # (Qwen3-Next's; Fast-LLM's)
def test_a_saved_model_drafts_and_trains_as_remote_code(tmp_path, kind):
    model = _model(**kind).float()
    model.save_pretrained(tmp_path / "model")
    sources = {"mtp_head.py", "mtp_drafting.py", "mtp_parallel_heads.py", "mtp_parallel_drafting.py", "mtp_heads.py"}
    assert sources <= {path.name for path in (tmp_path / "model").iterdir()}
    script = tmp_path / "run.py"
    script.write_text(_REMOTE_CODE_RUN)
    result = run_without_the_package(script, tmp_path / "model", cwd=tmp_path)
    found = json.loads(result.stdout.split("RESULT")[1])
    ids = torch.tensor([[5, 9, 17, 3, 44, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids, mtp_loss_weight=0.5).mtp_loss
    # (the same float32 computation in both processes: equal up to thread-count summation order, far below 1e-5)
    assert found["same"] and abs(found["loss"] - float(expected)) <= 1e-5, found
