"""Sampled speculative decoding keeps the model's distribution: `generate(do_sample=True, assistant_model=...)`
(transformers' speculative sampling: a draft token x sampled from the assistant's q is kept with probability
min(1, p(x) / q(x)), else the token is drawn from max(p - q, 0) normalised, and the caches are cut back to the
accepted prefix) draws each sequence with the probability plain sampling from the model gives it.

The reference is exact: P(a, b, c) = p(a | prompt) p(b | prompt, a) p(c | prompt, a, b), the model's next-token
probabilities from one uncached float64 forward of every prompt + a + b. Three new tokens, so later rounds start from
a cache that was cut back after a rejected draft (the GDN layers restored by state_rollback.py): a state that is not
restored changes the probabilities of the tokens after it, and the test sees it.

The test is Pearson's chi-square on the counts of the V^3 sequences, cells whose expected count is below 5 pooled
into one (so the chi-square approximation holds). It rejects at p < 1e-4: a correct sampler fails it once in 10^4
seeds. The samples are seeded, so the outcome is reproducible. Power: the same test, on as many samples or fewer,
rejects two wrong samplers by a wide margin (p below 1e-12 for these seeds): the assistant's own sequences (every
draft kept), and speculative sampling whose GDN states are not restored after a rejection. The model's own MTP heads
as the drafter (`use_mtp`, both kinds) keep the distribution too; a drafter that reports another distribution than
the one it sampled from is rejected (p ~ 1e-39).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from model_helpers import tiny_model

from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer

VOCAB = 8  # 512 three-token sequences: in 400 samples, 13 cells expect 5 or more (72% of the mass), then the rest
NEW_TOKENS = 3
SAMPLES = 400  # assisted decoding is batch 1: one generate call a sample (about 20 ms on a CPU core)
POWER_SAMPLES = 150  # what the wrong samplers are given: fewer, and still rejected
ALPHA = 1e-4  # the false-alarm rate of each test
PROMPT = torch.tensor([[2, 5, 3, 7, 1, 4]])


def _model(layer_types, seed):
    return tiny_model(layer_types, seed=seed, vocab_size=VOCAB).double()


@pytest.fixture(scope="module")
def models():
    """The model (GDN + attention) and its assistant, a smaller model of the family with other weights."""
    return (_model(["gated_deltanet", "full_attention", "gated_deltanet"], seed=0),
            _model(["gated_deltanet", "full_attention"], seed=3))


def exact_distribution(model, prompt: torch.Tensor) -> dict[tuple[int, ...], float]:
    """The probability of every NEW_TOKENS-token continuation of `prompt` under plain sampling from `model`."""
    continuations = list(itertools.product(range(VOCAB), repeat=NEW_TOKENS))
    heads = sorted({c[:-1] for c in continuations})
    ids = torch.cat([prompt.expand(len(heads), -1), torch.tensor(heads)], dim=1)
    with torch.no_grad():
        probs = model(ids, use_cache=False).logits[:, -NEW_TOKENS:].softmax(-1)  # [head, step, token]
    row = {head: i for i, head in enumerate(heads)}
    return {c: float(torch.prod(probs[row[c[:-1]], torch.arange(NEW_TOKENS), torch.tensor(c)]))
            for c in continuations}


def chi_square_p_value(counts: Counter, expected: dict[tuple[int, ...], float]) -> float:
    """Pearson's chi-square of `counts` against the probabilities `expected`, cells expecting fewer than 5 samples
    pooled into one; the p-value from the chi-square law (the regularised upper incomplete gamma function)."""
    total = sum(counts.values())
    observed, means, rest_observed, rest_mean = [], [], 0, 0.0
    for cell, probability in expected.items():
        if probability * total >= 5:
            observed.append(counts[cell])
            means.append(probability * total)
        else:
            rest_observed += counts[cell]
            rest_mean += probability * total
    assert sum(counts[c] for c in counts if c not in expected) == 0, "a sample outside the continuations"
    if rest_mean > 0:
        observed.append(rest_observed)
        means.append(rest_mean)
    observed_t, means_t = torch.tensor(observed, dtype=torch.float64), torch.tensor(means, dtype=torch.float64)
    statistic = float(((observed_t - means_t) ** 2 / means_t).sum())
    freedom = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2), torch.tensor(statistic / 2)))


def sample_counting_crops(model, samples: int, seed: int, **kwargs) -> tuple[Counter, list[int]]:
    """`sample`, and the length change of every GDN/KDA layer's crop (negative: a rejected draft restored)."""
    crops = []
    original = LinearStateLayer.crop

    def counting_crop(self, n):
        crops.append(n)
        return original(self, n)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LinearStateLayer, "crop", counting_crop)
        return sample(model, samples, seed, **kwargs), crops


def sample(model, samples: int, seed: int, **kwargs) -> Counter:
    """The counts of `samples` sampled continuations of PROMPT (one generate call a sample: assisted decoding is
    batch 1). One thread: the tensors are tiny, and a second thread only waits for a core other processes hold."""
    torch.manual_seed(seed)
    counts: Counter = Counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(samples):
                out = model.generate(PROMPT, do_sample=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     pad_token_id=0, **kwargs)
                counts[tuple(out[0, PROMPT.shape[1]:].tolist())] += 1
    finally:
        torch.set_num_threads(threads)
    return counts


def plain_sample(model, samples: int, seed: int) -> Counter:
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(PROMPT.expand(samples, -1), do_sample=True, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return Counter(tuple(row) for row in out[:, PROMPT.shape[1]:].tolist())


def test_the_reference_is_plain_sampling(models):
    """The exact distribution is what plain sampling draws (a batch of many rows: cheap), and the test is not
    trivially passed: the assistant's plain samples are rejected."""
    model, assistant = models
    expected = exact_distribution(model, PROMPT)
    assert abs(sum(expected.values()) - 1) < 1e-12
    assert chi_square_p_value(plain_sample(model, 10 * SAMPLES, seed=1), expected) > ALPHA
    assert chi_square_p_value(plain_sample(assistant, POWER_SAMPLES, seed=1), expected) < ALPHA


@pytest.mark.slow
def test_speculative_sampling_with_an_assistant_model_keeps_the_distribution(models):
    model, assistant = models
    expected = exact_distribution(model, PROMPT)
    counts, crops = sample_counting_crops(model, SAMPLES, seed=2, assistant_model=assistant)
    assert sum(n < 0 for n in crops) > SAMPLES // 4  # many drafts were rejected and the GDN states restored
    assert chi_square_p_value(counts, expected) > ALPHA


def test_speculative_sampling_without_state_restoration_is_rejected(models, monkeypatch):
    """Power: a crop that cuts the counts back but leaves each GDN layer's states as the rejected tokens left them
    draws from another distribution, and the test, on POWER_SAMPLES samples, says so."""
    model, assistant = models
    expected = exact_distribution(model, PROMPT)
    original = LinearStateLayer.crop

    def stale_crop(self, n):
        conv, recurrent = self.conv_states[0].clone(), self.recurrent_states[0].clone()
        original(self, n)
        self.conv_states[0].copy_(conv)
        self.recurrent_states[0].copy_(recurrent)

    monkeypatch.setattr(LinearStateLayer, "crop", stale_crop)
    counts = sample(model, POWER_SAMPLES, seed=2, assistant_model=assistant)
    assert chi_square_p_value(counts, expected) < ALPHA


def _peaked_heads(model):
    """The MTP heads' final norms scaled by 10: their draft distributions q peaked (the model's own p unchanged), far
    from the model's, so that drafts are often rejected and a q misreported matters."""
    with torch.no_grad():
        for name, parameter in model.mtp.named_parameters():
            if name == "norm.weight" or name.startswith("norms."):
                parameter.copy_(10 * (1 + parameter) - 1)  # (zero-centred: the scale is 1 + w)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("mtp", [{"mtp_type": "qwen3_next", "num_mtp_layers": 1},  # one layer, applied recursively
                                 {"mtp_type": "fast_llm", "num_mtp_layers": 2}])  # one draft per head
def test_speculative_sampling_with_the_models_mtp_heads_keeps_the_distribution(mtp):
    """`generate(do_sample=True, use_mtp=2)`: the heads' drafts sampled from their processed logits q, kept or
    resampled by transformers' rule, the caches (the model's and the heads' own) cut back after each rejection."""
    model = _peaked_heads(tiny_model(["gated_deltanet", "full_attention", "gated_deltanet"], seed=0,
                                     vocab_size=VOCAB, **mtp).double())
    expected = exact_distribution(model, PROMPT)
    counts, crops = sample_counting_crops(model, SAMPLES, seed=4, use_mtp=2)
    assert sum(n < 0 for n in crops) > SAMPLES // 4  # many drafts were rejected and the GDN states restored
    assert chi_square_p_value(counts, expected) > ALPHA


def test_mtp_drafts_reported_with_another_distribution_are_rejected(monkeypatch):
    """Power: a drafter that samples its drafts from its heads' distribution q and hands transformers' rule another
    (softmax of the negated logits, under which a likely draft looks unlikely, so it is nearly always kept) draws
    from another distribution, and the test, on POWER_SAMPLES samples, says so."""
    from hybrid_linear_models.mtp_drafting import MtpCandidateGenerator

    model = _peaked_heads(tiny_model(["gated_deltanet", "full_attention", "gated_deltanet"], seed=0,
                                     vocab_size=VOCAB, mtp_type="fast_llm", num_mtp_layers=2).double())
    expected = exact_distribution(model, PROMPT)
    pick = MtpCandidateGenerator._pick

    def misreported(self, sequence, logits):
        token, processed = pick(self, sequence, logits)
        return token, -processed

    monkeypatch.setattr(MtpCandidateGenerator, "_pick", misreported)
    counts = sample(model, POWER_SAMPLES, seed=2, use_mtp=2)
    assert chi_square_p_value(counts, expected) < ALPHA
