"""Malformed model inputs get one ValueError naming the shape (or dtype) and the fix, on a model of each layer type,
before any mixer sees them (a mixer would fail with a reshape or indexing error that names none of the inputs)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import ALL_TYPES, tiny_model

CASES = {
    "1-D input_ids": (lambda m: m(torch.arange(5)), r"2-D tensor \[batch, seq_len\].*\(5,\).*unsqueeze\(0\)"),
    "empty sequence": (lambda m: m(torch.zeros(2, 0, dtype=torch.long)), r"\[2, 0\] holds no tokens"),
    "empty batch": (lambda m: m(torch.zeros(0, 5, dtype=torch.long)), r"\[0, 5\] holds no tokens"),
    "empty inputs_embeds": (lambda m: m(inputs_embeds=torch.zeros(2, 0, 64)), r"inputs_embeds .*\[2, 0\] holds no"),
    "empty prompt to generate": (lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2),
                                 r"\[1, 0\] holds no tokens.*bos_token_id"),
    "empty prompt and mask to generate": (
        lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long), attention_mask=torch.zeros(1, 0, dtype=torch.long),
                             max_new_tokens=2), r"holds no tokens"),
    "2-D inputs_embeds": (lambda m: m(inputs_embeds=torch.zeros(5, 64)), r"\[batch, seq_len, 64\].*\(5, 64\)"),
    "inputs_embeds of the wrong width": (lambda m: m(inputs_embeds=torch.zeros(1, 5, 63)), r"hidden_size.*63"),
    "integer inputs_embeds": (lambda m: m(inputs_embeds=torch.zeros(1, 5, 64, dtype=torch.long)), "floating-point"),
    "float input_ids": (lambda m: m(torch.rand(2, 5)), "integer token ids"),
    "3-D input_ids": (lambda m: m(torch.zeros(2, 3, 5, dtype=torch.long)), "2-D tensor"),
    "ids out of the vocabulary": (lambda m: m(torch.full((1, 4), 500)), r"lie in \[0, 128\)"),
    "both ids and embeddings": (lambda m: m(torch.zeros(1, 2, dtype=torch.long), inputs_embeds=torch.zeros(1, 2, 64)),
                                "exactly one of"),
    "neither ids nor embeddings": (lambda m: m(), "exactly one of"),
    "mask of another batch": (lambda m: m(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(3, 5)),
                              "attention_mask must"),
    "3-D mask": (lambda m: m(torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 5, 5)), "2-D .* or 4-D"),
    "1-D position_ids": (lambda m: m(torch.zeros(1, 5, dtype=torch.long), position_ids=torch.arange(5)),
                         "position_ids must be"),
    "float position_ids": (lambda m: m(torch.zeros(1, 5, dtype=torch.long), position_ids=torch.zeros(1, 5)),
                           "integer positions"),
    "labels of another shape": (
        lambda m: m(torch.zeros(2, 5, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long)), "labels must"),
}


@pytest.fixture(scope="module", params=ALL_TYPES)
def model(request):
    return tiny_model([request.param])


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_input_raises_a_value_error_naming_it(model, case):
    call, pattern = CASES[case]
    with pytest.raises(ValueError, match=pattern) as caught:
        call(model)
    assert "\n" not in str(caught.value)


def test_a_one_token_prompt_generates_on_every_layer_type(model):
    out = model.generate(torch.tensor([[1]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 4)
