"""Batched speculative decoding with per-row acceptance (speculative_decoding.py, verify_cache.py): each row of a
left-padded batch equals that row's plain greedy decoding alone (`generate` on the row without its padding), token
for token, whatever the drafter proposes and however many drafts the other rows accept.

Float64 models: the rows' logits then agree with the row decoded alone to float64 rounding, far below any gap
between the two largest logits, so a token that differs is a restoring or masking error, not rounding."""

from __future__ import annotations

import pytest
import torch
from model_helpers import HostReadsRefused, replay_rounds_eagerly, tiny_model

from hybrid_linear_models import speculative_decoding
from hybrid_linear_models.kernels_gemv import decode_gemv_mode
from hybrid_linear_models.speculative_decoding import (
    AssistantDrafter,
    CapturedVerifyRound,
    PromptLookupDrafter,
    speculative_generate,
)

MODELS = {
    "gdn+attention": ["gated_deltanet", "full_attention", "gated_deltanet"],
    "kda+attention": ["kimi_delta_attention", "full_attention", "kimi_delta_attention"],
    "sliding": ["gated_deltanet", "sliding_attention", "kimi_delta_attention"],  # window 6: passed while decoding
}
NEW = 12
NUM_TOKENS = 3  # tokens a verify round checks, where a test fixes it
GPU_DIMS = {"gdn_value_head_dim": 16, "gdn_key_head_dim": 16, "kda_head_dim": 16, "head_dim": 16}  # fla's smallest


def _model(layer_types, seed=0):
    return tiny_model(layer_types, seed=seed).double()


_MODELS: dict = {}
_TRUTH: dict = {}


def _named(name):
    """The test model `name` (built once; no test changes it)."""
    if name not in _MODELS:
        _MODELS[name] = _model(MODELS[name])
    return _MODELS[name]


def _truth(name, seed):
    """`_alone` of model `name` on `_batch(seed)`, computed once."""
    if (name, seed) not in _TRUTH:
        _TRUTH[name, seed] = _alone(_named(name), *_batch(seed))
    return _TRUTH[name, seed]


def _batch(seed=1, rows=3, length=9):
    """Left-padded prompts: row 0 whole, the others 3 and 5 pads shorter."""
    ids = torch.randint(2, 128, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(rows, length, dtype=torch.long)
    for row, pads in zip(range(1, rows), (3, 5)):
        mask[row, :pads] = 0
    return ids * mask, mask


def _alone(model, ids, mask, new=NEW):
    """Each row's plain greedy tokens, the row decoded by itself (no padding)."""
    rows = []
    with torch.no_grad():
        for row, real in zip(ids, mask.bool()):
            prompt = row[real][None]
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            rows.append(out[0, prompt.shape[1]:])
    return torch.stack(rows)


class RandomDrafter:
    """Random tokens: almost always wrong."""

    def __init__(self, seed=0):
        self.generator = torch.Generator().manual_seed(seed)

    def draft(self, sequences, count):
        return torch.randint(2, 128, (len(sequences), count), generator=self.generator)


class TruthDrafter:
    """Knows each row's greedy tokens (`truth`, after its `prompt_lengths`): proposes them all (right), none
    (wrong), or each row a random number of them then a wrong one (random: rows accept different counts)."""

    def __init__(self, truth, prompt_lengths, kind, seed=0):
        self.truth, self.prompt_lengths, self.kind = truth, prompt_lengths, kind
        self.generator = torch.Generator().manual_seed(seed)

    def draft(self, sequences, count):
        rows = []
        for b, tokens in enumerate(sequences):
            done = tokens.numel() - self.prompt_lengths[b]
            right = torch.cat([self.truth[b, done:done + count], torch.full((count,), 5)])[:count]
            if self.kind == "wrong":
                right = (right + 1) % 128
            elif self.kind == "random":
                cut = int(torch.randint(0, count + 1, (), generator=self.generator))
                right = torch.cat([right[:cut], (right[cut:] + 1) % 128])
            rows.append(right)
        return torch.stack(rows)


@pytest.fixture
def kept_counts(monkeypatch):
    """Every round's kept counts (per row), recorded around `verify_round`."""
    counts = []
    original = speculative_decoding.verify_round

    def spy(*args, **kwargs):
        greedy, kept = original(*args, **kwargs)
        counts.append(kept.tolist())
        return greedy, kept

    monkeypatch.setattr(speculative_decoding, "verify_round", spy)
    return counts


@pytest.mark.parametrize("kind", ["wrong", "right", "random"])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_row_equals_its_greedy_decoding_alone(name, kind, kept_counts):
    model = _named(name)
    ids, mask = _batch()
    truth = _truth(name, 1)
    drafter = TruthDrafter(truth, mask.sum(-1).tolist(), kind, seed=len(name))
    got = speculative_generate(model, ids, drafter, num_tokens=4, max_new_tokens=NEW, attention_mask=mask)
    assert torch.equal(got[:, : ids.shape[1]], ids)
    assert torch.equal(got[:, ids.shape[1]:], truth)
    live_rounds = [[k for k in round_ if k] for round_ in kept_counts]
    if kind == "right":
        assert max(max(r) for r in live_rounds) == 4
    if kind == "wrong":
        assert all(k == 1 for r in live_rounds for k in r)
    if kind == "random":  # rows accepted different counts in one round, and some drafts were rejected
        assert any(len(set(r)) > 1 for r in live_rounds)


@pytest.mark.parametrize(("name", "num_tokens"), [("gdn+attention", 2), ("kda+attention", 3), ("sliding", 5)])
def test_random_drafts_of_other_widths(name, num_tokens):
    ids, mask = _batch()
    got = speculative_generate(_named(name), ids, RandomDrafter(num_tokens), num_tokens=num_tokens,
                               max_new_tokens=NEW, attention_mask=mask)
    assert torch.equal(got[:, ids.shape[1]:], _truth(name, 1))


def test_prompt_lookup_and_assistant_drafters():
    """Repetitive prompts (lookup finds drafts that are partly right), and a smaller model of the family."""
    model = _model(MODELS["sliding"])
    ids = torch.tensor([[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8], [0, 0, 0, 3, 4, 5, 3, 4, 5, 3, 4, 5]])
    mask = (torch.arange(12) >= torch.tensor([[0], [3]])).long()
    truth = _alone(model, ids, mask)
    got = speculative_generate(model, ids, PromptLookupDrafter(), num_tokens=4, max_new_tokens=NEW,
                               attention_mask=mask)
    assert torch.equal(got[:, ids.shape[1]:], truth)
    assistant = AssistantDrafter(_model(["gated_deltanet", "full_attention"], seed=3))
    got = speculative_generate(model, ids, assistant, num_tokens=3, max_new_tokens=NEW, attention_mask=mask)
    assert torch.equal(got[:, ids.shape[1]:], truth)


def _lookup_from_scratch(tokens: torch.Tensor, count: int, max_ngram: int) -> list[int]:
    """Prompt lookup's definition, searched afresh over the whole row: the tokens after the latest earlier occurrence
    (one that ends before the row's last token) of the row's last n tokens, n = max_ngram down to 1; else the last
    token. Padded with the last found token to `count`."""
    row = tokens.tolist()
    for n in range(min(max_ngram, len(row) - 1), 0, -1):
        starts = [s for s in range(len(row) - n) if row[s: s + n] == row[len(row) - n:]]
        if starts:
            found = row[starts[-1] + n: starts[-1] + n + count]
            return (found + found[-1:] * count)[:count]
    return row[-1:] * count


@pytest.mark.parametrize("max_ngram", [1, 2, 3])
def test_prompt_lookup_indexed_as_rows_grow_equals_a_search_from_scratch(max_ngram):
    """The drafter indexes each row's n-grams as the row grows (NgramIndex); its drafts are a whole-row search's, for
    rows that grow by 1 to 5 tokens a round from 1 token up, of a small vocabulary (many matches), and when the same
    drafter is handed other rows (another call: the index starts over) or another number of rows."""
    generator = torch.Generator().manual_seed(max_ngram)
    drafter = PromptLookupDrafter(max_ngram)
    for call, rows in enumerate((3, 3, 2)):
        sequences = [torch.randint(0, 4, (1 + b,), generator=generator) for b in range(rows)]
        for _ in range(30):
            count = int(torch.randint(1, 6, (), generator=generator))
            got = drafter.draft(sequences, count)
            assert got.dtype == sequences[0].dtype
            assert got.tolist() == [_lookup_from_scratch(t, count, max_ngram) for t in sequences], call
            sequences = [torch.cat([t, torch.randint(0, 4, (int(torch.randint(1, 6, (), generator=generator)),),
                                                     generator=generator)]) for t in sequences]


def test_a_row_that_ends_with_every_draft_accepted_while_others_go_on():
    """Row 0 accepts all 7 drafts of each round and ends 7 tokens past max_new_tokens in its second round; row 1
    accepts none and goes on for 7 more rounds, in which row 0's verify tokens are still written after its cache's
    length (its slots hold them), and row 1 is still its greedy decoding alone."""
    model = _named("gdn+attention")
    ids = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    new = 10
    truth = _alone(model, ids, mask, new=new + 8)  # (the drafter knows the tokens past max_new_tokens too)
    right = TruthDrafter(truth, [6, 6], "right")

    class FirstRowRight:
        def draft(self, sequences, count):
            drafts = right.draft(sequences, count)
            drafts[1] = (drafts[1] + 1) % 128
            return drafts

    got = speculative_generate(model, ids, FirstRowRight(), num_tokens=8, max_new_tokens=new, attention_mask=mask)
    assert torch.equal(got[:, ids.shape[1]:], truth[:, :new])


def test_a_row_ends_at_its_end_of_sequence_token():
    model = _named("gdn+attention")
    ids, mask = _batch()
    truth = _truth("gdn+attention", 1)
    eos = int(truth[1, 4])  # row 1's fifth token
    got = speculative_generate(model, ids, RandomDrafter(), num_tokens=3, max_new_tokens=NEW, attention_mask=mask,
                               eos_token_id=eos, pad_token_id=0)[:, ids.shape[1]:]
    for b in range(3):
        stop = (truth[b] == eos).nonzero().flatten()
        end = int(stop[0]) + 1 if stop.numel() else NEW
        assert torch.equal(got[b, :end], truth[b, :end])
        assert (got[b, end:] == 0).all()


@pytest.mark.parametrize("name", ["sliding", "gdn+attention", "kda+attention"])
def test_the_verify_round_reads_nothing_on_the_host(name):
    """What a CUDA graph captures reads no tensor value on the host: every op that would wait for the device to hand
    a value over (bool/int/item/tolist of a tensor, bincount, nonzero, ...: HostReadsRefused) raises while a round
    runs (on the CPU here; on CUDA any such read is a synchronisation a capture refuses)."""
    model = _named(name)
    ids, mask = _batch()
    cache = speculative_decoding.VerifyCache(model, 3, 30, torch.device("cpu"))
    with torch.no_grad():
        first = speculative_decoding.prefill(model, cache, ids, mask)
        step = torch.cat([first[:, None], RandomDrafter().draft([None] * 3, 3)], dim=1)
        live = torch.ones(3, dtype=torch.bool)
        with HostReadsRefused():
            with pytest.raises(AssertionError):  # (the refusal is in place)
                bool(torch.ones(()))
            speculative_decoding.verify_round(model, cache, step, live)


def test_the_captured_round_equals_the_uncaptured_one(monkeypatch):
    """`graphs=True` with the capture stood in by an eager replay of the captured function (the CPU): the capture's
    warm-up leaves the cache as it found it, and every round replays."""
    replays = replay_rounds_eagerly(monkeypatch)
    ids, mask = _batch()
    truth = _truth("kda+attention", 1)
    drafter = TruthDrafter(truth, mask.sum(-1).tolist(), "random", seed=1)
    got = speculative_generate(_named("kda+attention"), ids, drafter, num_tokens=4, max_new_tokens=NEW,
                               attention_mask=mask, graphs=True)
    assert torch.equal(got[:, ids.shape[1]:], truth)
    assert replays


def test_the_captured_round_takes_the_decoding_gemv_for_its_products(monkeypatch):
    """The captured round runs its linear layers as the decoding step does: a product of at most 16 rows (batch x k)
    through this package's GEMV kernel (stood in here by F.linear on the CPU, which it must equal), in bf16, and the
    round's tokens, counts and cache are the uncaptured round's."""
    from hybrid_linear_models import kernels_gemv

    shapes = []

    def kernel(x, weight, bias, rows=None, swiglu_pairs=False, convolution=None):
        assert rows is None and not swiglu_pairs and convolution is None  # (none of these in a multi-token round)
        shapes.append((x.shape[0], weight.shape[0]))
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(kernels_gemv, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_gemv, "triton_gemv_kernel", lambda: kernel)
    monkeypatch.setattr(kernels_gemv, "_FAILED", {})
    replay_rounds_eagerly(monkeypatch)
    model = _model(MODELS["gdn+attention"]).to(torch.bfloat16)  # (its own: cast)
    ids, mask = _batch()
    results = []
    for captured in (True, False):
        cache = speculative_decoding.VerifyCache(model, 3, 30, torch.device("cpu"))
        with torch.no_grad():
            first = speculative_decoding.prefill(model, cache, ids, mask)
            step = torch.cat([first[:, None], RandomDrafter().draft([None] * 3, 3)], dim=1)
            live = torch.ones(3, dtype=torch.bool)
            if captured:
                round_ = CapturedVerifyRound(model, cache, 4)
                shapes.clear()
                outputs = round_(step, live)  # the replay
                shapes_of_replay = list(shapes)
            else:
                outputs = speculative_decoding.verify_round(model, cache, step, live)
        results.append((outputs, [t.clone() for t in cache.tensors()]))
    assert shapes_of_replay and all(rows == 12 for rows, _ in shapes_of_replay)  # 3 rows x 4 tokens
    assert shapes_of_replay[-1][1] == model.config.vocab_size  # the LM head too
    (captured_out, captured_cache), (plain_out, plain_cache) = results
    for a, b in zip([*captured_out, *captured_cache], [*plain_out, *plain_cache]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [2, 4, 5])
def test_captured_verify_round_equals_uncaptured_on_gpu(num_tokens):
    """On CUDA, bf16: the round replayed from its CUDA graph gives the same tokens, counts and cache as the same
    round run eagerly from the same cache, its products on the decoding GEMV as in the capture (the same kernels on
    the same inputs: bit for bit)."""
    torch.manual_seed(0)
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"],
                       seed=0, **GPU_DIMS).to("cuda", torch.bfloat16)
    ids, mask = _batch(seed=7)
    ids, mask = ids.cuda(), mask.cuda()
    device = torch.device("cuda")
    results = []
    for captured in (False, True):
        cache = speculative_decoding.VerifyCache(model, 3, 40, device)
        with torch.no_grad():
            first = speculative_decoding.prefill(model, cache, ids, mask)
            round_ = CapturedVerifyRound(model, cache, num_tokens) if captured else None
            outputs = []
            for r in range(3):
                draft = torch.randint(2, 128, (3, num_tokens - 1), generator=torch.Generator().manual_seed(r))
                step = torch.cat([first[:, None], draft.cuda()], dim=1)
                live = torch.ones(3, dtype=torch.bool, device=device)
                if captured:
                    greedy, kept = round_(step, live)
                else:  # (the products on the kernels the capture records them with: kernels_gemv)
                    with decode_gemv_mode(device):
                        greedy, kept = speculative_decoding.verify_round(model, cache, step, live)
                outputs += [greedy, kept]
                first = greedy[torch.arange(3, device=device), kept - 1]
        results.append((outputs, [t.clone() for t in cache.tensors()]))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(*[torch.cat([o.flatten().float() for o in r[0]]) for r in results])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_captured_rounds_on_gpu_decode_each_row_as_alone(kernel, monkeypatch):
    """On CUDA (fla's kernels, float32), rounds replayed from their CUDA graph, with either delta-rule kernel: each row
    of the batch equals its plain greedy decoding alone (float32: the logits agree to ~1e-5, far below the random
    model's gaps between its two largest logits)."""
    monkeypatch.setattr(speculative_decoding, "SHORT_RULE_KERNEL", kernel)
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"],
                       seed=0, **GPU_DIMS).cuda()
    ids, mask = _batch()
    truth = _alone(model, ids.cuda(), mask.cuda())
    drafter = TruthDrafter(truth.cpu(), mask.sum(-1).tolist(), "random", seed=2)
    got = speculative_generate(model, ids.cuda(), drafter, num_tokens=4, max_new_tokens=NEW,
                               attention_mask=mask.cuda(), graphs=True)
    assert torch.equal(got[:, ids.shape[1]:], truth)


@pytest.mark.parametrize("graphs_on", [True, False])
def test_generate_replays_captured_rounds_where_graph_decoding_is_on(monkeypatch, graphs_on):
    """`generate` with a drafter and several rows captures its verify round where the model's graph decoding is on
    for the device (the CPU stands in for CUDA, the capture by an eager replay), and the tokens are the same."""
    from hybrid_linear_models.cuda_graph_decoding import CudaGraphDecoder

    replays = replay_rounds_eagerly(monkeypatch)
    monkeypatch.setattr(CudaGraphDecoder, "device_types", ("cuda", "cpu"))
    model = _model(MODELS["gdn+attention"])  # (its own: its switch is set)
    model.set_cuda_graph_decoding(graphs_on)
    ids, mask = _batch()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             prompt_lookup_num_tokens=3)
    assert torch.equal(out[:, ids.shape[1]:], _truth("gdn+attention", 1))
    assert bool(replays) == graphs_on


@pytest.mark.parametrize("num_tokens", [1, 0, speculative_decoding.MAX_VERIFY_TOKENS + 1, 2.5])
def test_a_verify_width_out_of_range_is_refused_before_any_work(num_tokens):
    model = _model(MODELS["gdn+attention"])  # (its own: a hook is added)
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = _batch()
    with pytest.raises(ValueError, match="num_tokens") as error:
        speculative_generate(model, ids, RandomDrafter(), num_tokens=num_tokens, attention_mask=mask)
    assert "\n" not in str(error.value) and not calls


@pytest.mark.parametrize("rows", [1, 2])
def test_generate_with_an_assistant_of_another_vocabulary_is_refused_before_any_work(rows):
    """generate(assistant_model=) of another vocabulary size, without the tokenizers of transformers' universal
    assisted decoding: one line naming both sizes, for one row and a batch, before any forward."""
    model = _model(MODELS["gdn+attention"])
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = _batch()
    with pytest.raises(ValueError, match="vocabulary has 64 tokens and this model's 128") as error:
        model.generate(ids[:rows], attention_mask=mask[:rows], max_new_tokens=4, pad_token_id=0,
                       assistant_model=tiny_model(["gated_deltanet"], vocab_size=64))
    assert "\n" not in str(error.value) and not calls


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("count", [0, -2, 2.5])
def test_a_prompt_lookup_length_that_is_not_a_positive_integer_is_refused(rows, count):
    model = _model(MODELS["gdn+attention"])
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = _batch()
    with pytest.raises(ValueError, match=f"prompt_lookup_num_tokens={count}: .* positive integer") as error:
        model.generate(ids[:rows], attention_mask=mask[:rows], max_new_tokens=4, pad_token_id=0,
                       prompt_lookup_num_tokens=count)
    assert "\n" not in str(error.value) and not calls


def test_a_drafter_of_another_vocabulary_is_refused_before_any_work():
    model = _model(MODELS["gdn+attention"])
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
    other = AssistantDrafter(tiny_model(["gated_deltanet"], vocab_size=64))
    ids, mask = _batch()
    with pytest.raises(ValueError, match="vocabulary has 64 tokens and the model's 128") as error:
        speculative_generate(model, ids, other, num_tokens=3, attention_mask=mask)
    assert "\n" not in str(error.value) and not calls
    holes = mask.clone()
    holes[0, 4] = 0
    for wrong in (mask.flip(-1), holes):
        with pytest.raises(ValueError, match="padding on the left"):
            speculative_generate(model, ids, RandomDrafter(), attention_mask=wrong)
    with pytest.raises(TypeError, match="draft\\(sequences, count\\)"):
        speculative_generate(model, ids, object(), attention_mask=mask)
    assert not calls


def test_a_draft_of_the_wrong_shape_or_tokens_is_refused_in_one_line():
    model = _model(MODELS["gdn+attention"])
    ids, mask = _batch()

    class Short:
        def draft(self, sequences, count):
            return torch.zeros(len(sequences), count - 1, dtype=torch.long)

    class Outside:
        def draft(self, sequences, count):
            return torch.full((len(sequences), count), 500)

    for drafter, words in ((Short(), "must return integer token ids"), (Outside(), "outside the model's vocabulary")):
        with pytest.raises(ValueError, match=words) as error:
            speculative_generate(model, ids, drafter, num_tokens=3, attention_mask=mask)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["kda+attention", "sliding"])  # (GDN, KDA, full and sliding attention between them)
def test_generate_with_a_drafter_runs_a_batch(name):
    """transformers' assisted generate refuses batches; this family's runs them (speculative_generate), and equals
    plain batched greedy generate, with and without an end-of-sequence token (rows ended early padded, the columns
    after every row ended cut, as generate does)."""
    model = _named(name)
    ids, mask = _batch()
    settings = {"attention_mask": mask, "max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}
    eos = int(_truth(name, 1)[0, 6])
    with torch.no_grad():
        for extra in ({}, {"eos_token_id": eos}):
            plain = model.generate(ids, **settings, **extra)
            assert torch.equal(model.generate(ids, **settings, **extra, prompt_lookup_num_tokens=3), plain)
        if name == "sliding":  # (an assistant drafts with a generate per row and round: one model is enough)
            small = _model(["gated_deltanet", "full_attention"], seed=3)
            assert torch.equal(model.generate(ids, **settings, assistant_model=small, num_assistant_tokens=2),
                               model.generate(ids, **settings))


def test_generate_of_a_batch_refuses_what_it_does_not_take_in_one_line():
    model = _named("gdn+attention")
    ids, mask = _batch()
    for extra, words in (({"do_sample": True}, "do_sample=True"),
                         ({"repetition_penalty": 1.3}, "logits processors"),
                         ({"eos_token_id": [3, 4]}, "several eos_token_id values")):
        with pytest.raises(ValueError, match=words) as error:
            model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, prompt_lookup_num_tokens=3,
                           **extra)
        assert "\n" not in str(error.value)
        # (sampling's own warpers are not named as logits processors the request did not pass)
        assert extra != {"do_sample": True} or "logits processors" not in str(error.value)


def test_one_row_with_several_eos_ids_runs_transformers_loop_where_graphs_are_on(monkeypatch):
    """The batched loop takes one end-of-sequence id; one row with several, graphs on, runs transformers' loop (as
    it does with graphs off) instead of being refused, and gives the same tokens."""
    from hybrid_linear_models import modeling_hybrid_linear

    model = _named("gdn+attention")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    options = dict(max_new_tokens=NEW, pad_token_id=0, do_sample=False, eos_token_id=[3, 4], prompt_lookup_num_tokens=3)
    with torch.no_grad():
        plain = model.generate(ids, **options)
    calls = []
    monkeypatch.setattr(modeling_hybrid_linear, "assisted_generate_batch", lambda *args, **kwargs: calls.append(1))
    monkeypatch.setattr(type(model), "captures_graphs_on", lambda self, device: True)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **options), plain)
    assert not calls


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "3"])
@pytest.mark.parametrize("argument", ["prompt_lookup_num_tokens", "num_assistant_tokens"])
def test_a_draft_length_that_is_not_a_positive_integer_is_refused_by_name(monkeypatch, argument, value):
    """The batched loop (a batch, or one row where graphs are on) checks generate's draft length itself: one line
    naming the argument, before any work (the loop's own verify width, num_tokens, is not what the caller passed)."""
    model = _named("gdn+attention")
    ids, mask = _batch()
    drafter = {"assistant_model": _model(["gated_deltanet", "full_attention"], seed=3)} if "assistant" in argument \
        else {}
    for rows, graphs in ((slice(None), False), (slice(0, 1), True)):
        monkeypatch.setattr(type(model), "captures_graphs_on", lambda self, device, graphs=graphs: graphs)
        with pytest.raises(ValueError, match=f"{argument}={value!r}: the tokens drafted a round must be a positive"):
            model.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=4, pad_token_id=0,
                           **{argument: value}, **drafter)


@pytest.mark.parametrize(("layer_types", "extra"), [
    (["kimi_delta_attention", "mla_attention"], {}),  # latent attention: its latent cached as keys, no values
    (["gated_deltanet", "full_attention"], {"mlp_types": ["sparse_moe", "sparse_moe"]}),
])
def test_latent_attention_and_sparse_moe_models(layer_types, extra):
    model = tiny_model(layer_types, seed=0, **extra).double()
    ids, mask = _batch()
    got = speculative_generate(model, ids, RandomDrafter(), num_tokens=3, max_new_tokens=8, attention_mask=mask)
    assert torch.equal(got[:, ids.shape[1]:], _alone(model, ids, mask, new=8))


@pytest.mark.parametrize("name", ["gdn+attention", "kda+attention"])
def test_fla_s_rule_gets_contiguous_qkv_in_a_round_and_its_restore(monkeypatch, name):
    """Where fla runs the delta rule, a verify round hands it q, k and v contiguous, in the forward and in the restore
    that replays the accepted prefix (fla's input_guard would otherwise copy each strided slice of the convolution's
    output, twice a layer a round); with fla's kernels stood in by their contract, the tokens are the torch path's."""
    from types import SimpleNamespace

    from hybrid_linear_models import fla_backend, ops
    from hybrid_linear_models.kernels_delta_rule import recurrent_delta_rule

    layouts = []

    def contract(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                 use_beta_sigmoid_in_kernel=False):
        if q.shape[1] <= NUM_TOKENS:  # (the rounds' rules; the prompt's is one call of its own)
            layouts.append(tuple(t.is_contiguous() for t in (q, k, v)))
        beta = beta.sigmoid() if use_beta_sigmoid_in_kernel else beta
        g = ops.gate_log_decay(g, A_log, dt_bias) if use_gate_in_kernel else g
        return recurrent_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel)

    model = tiny_model(MODELS[name], seed=2)  # float32: fla takes no float64
    ids, mask = _batch()
    expected = speculative_generate(model, ids, RandomDrafter(), num_tokens=NUM_TOKENS, max_new_tokens=6,
                                    attention_mask=mask)
    kernels = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda")
    fake = SimpleNamespace(**dict.fromkeys(kernels, contract))
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: fake)
    got = speculative_generate(model, ids, RandomDrafter(), num_tokens=NUM_TOKENS, max_new_tokens=6,
                               attention_mask=mask)
    assert torch.equal(got, expected)
    assert len(layouts) >= 4 and all(layout == (True, True, True) for layout in layouts), layouts



@pytest.mark.parametrize("name", ["gdn+attention", "kda+attention"])
def test_a_verify_forward_leaves_the_states_for_restore_to_write(name):
    """A verify forward onto a VerifyCache keeps its GDN/KDA states as they were (its window's base is the state
    itself, its final states unstored); `restore` then writes each row's: all tokens kept, the states a plain
    forward of the same tokens onto the same cache stores (float64: the same sums)."""
    model = _named(name)
    ids, mask = _batch()
    cache = speculative_decoding.VerifyCache(model, 3, 30, torch.device("cpu"))
    step = torch.randint(2, 128, (3, NUM_TOKENS), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        speculative_decoding.prefill(model, cache, ids, mask)
        before = [(layer.conv_window.clone(), layer.recurrent_state.clone()) for layer in cache.linear_layers]
        speculative_decoding.forward_tokens(model, cache, step)
        for layer, (conv, state) in zip(cache.linear_layers, before):
            assert torch.equal(layer.conv_window, conv) and torch.equal(layer.recurrent_state, state)
            assert layer.rollback.base is layer.recurrent_state
        cache.restore(torch.full((3,), NUM_TOKENS))
        plain = model(ids, attention_mask=mask, use_cache=True).past_key_values
        model(step, attention_mask=torch.cat([mask, torch.ones_like(step)], dim=1), cache=plain, use_cache=True)
    for layer, index in zip(cache.linear_layers, [i for i, t in enumerate(MODELS[name]) if t != "full_attention"]):
        torch.testing.assert_close(layer.recurrent_state, plain.layers[index].recurrent_state, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.conv_state, plain.layers[index].conv_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sample", [False, True])
def test_one_row_runs_the_captured_loop_where_graphs_are_on(monkeypatch, sample):
    """A one-row assisted generate (here prompt lookup) runs the batched loop, its rounds replayed from a captured
    graph (stood in: `replay_rounds_eagerly`), where the model captures graphs on the device and the loop takes the
    request; greedy, it equals plain greedy decoding. Sampling stays on transformers' loop."""
    from hybrid_linear_models import modeling_hybrid_linear

    replays = replay_rounds_eagerly(monkeypatch)
    model = _named("gdn+attention")
    calls = []
    batched = modeling_hybrid_linear.assisted_generate_batch
    monkeypatch.setattr(modeling_hybrid_linear, "assisted_generate_batch",
                        lambda *args, **kwargs: calls.append(1) or batched(*args, **kwargs))
    monkeypatch.setattr(type(model), "captures_graphs_on", lambda self, device: True)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    options = dict(max_new_tokens=NEW, pad_token_id=0, do_sample=sample)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=3, **options)
    assert bool(calls) is not sample and bool(replays) is not sample
    if not sample:
        monkeypatch.undo()
        with torch.no_grad():
            plain = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
        assert torch.equal(got, plain)
