"""`--from fla` against fla's own model classes (GPU, fla installed; skipped otherwise): a tiny fla checkpoint loaded
by fla's GatedDeltaNetForCausalLM / KDAForCausalLM, and the same folder converted and loaded by ours, give the
logits of the float64 reference of tests/test_convert_fla.py, which is thereby checked against fla itself.

Tolerance: fla's kernels multiply in TF32 (10-bit mantissa), which moves a tiny random model's logits by about as
much as rounding its weights to TF32 does. Each comparison is calibrated by that shift, computed on the reference
(`TF32_MARGIN` times it); a convention read wrong (a gate activation, a head grouping, a missing bias) moves the
logits by tens of percent, far above it. fla's softmax attention needs flash-attn: the hybrid case runs only where
it is installed.

Short prompts (at most 64 tokens, no gradient) run fla's fused_recurrent kernels, which compute in float32 without
tensor cores: there fla's own models must match the reference to float32 rounding (`RECURRENT_TOL`). Measured on an
H200 (fla 0.6.0, triton 3.7.1, torch 2.11; a standalone copy of this comparison): fla against the
reference 1.8e-6 (GDN, 2 value heads per key head), 2.5e-6 (GDN, sigmoid gate, expand_v 2), 1.2e-6 (KDA, g_proj
bias) on 20 tokens; 5.9e-3 / 3.1e-3 / 3.3e-3 on 100 tokens (chunked, TF32) against TF32 weight shifts of
3.2e-2 / 7.0e-3 / 5.3e-3.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hybrid_linear_models import HybridLinearForCausalLM, fla_backend
from hybrid_linear_models.conversion import convert_checkpoint
from numerics import max_rel_err
from test_convert_fla import TINY, fla_config, fla_tensors, reference_logits, write_fla_checkpoint

TF32_MARGIN = 3.0
RECURRENT_TOL = 1e-4  # float32 over a few layers of ~1e2 accumulations: ~1e-6 measured, 1e-4 leaves a wide margin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or fla_backend.fla_kernels() is None,
                       reason="needs CUDA and fla"),
]

# fla's kernels need head dims of at least 16
CASES = {
    "gdn": ("gated_deltanet", dict(TINY, hidden_size=64, num_hidden_layers=3, num_heads=2, num_v_heads=4,
                                   head_dim=16, expand_v=1.0)),
    "gdn_sigmoid_expand": ("gated_deltanet", dict(TINY, hidden_size=64, num_hidden_layers=2, num_heads=2,
                                                  head_dim=16, expand_v=2.0, output_gate_activation="sigmoid")),
    "kda": ("kda", dict(TINY, hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=16)),
    "gdn_attn": ("gated_deltanet", dict(TINY, hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=16,
                                        expand_v=1.0, attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2})),
}


def _tf32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor rounded to TF32 precision (10-bit mantissa, to nearest)."""
    return {name: ((t.float().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32) for name, t in
            tensors.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_fla_model_and_converted_model_agree_with_the_reference(tmp_path, case):
    model_type, overrides = CASES[case]
    if overrides.get("attn") and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("fla's attention layers need flash-attn")
    import fla.models  # noqa: F401  (registers fla's model types with the Auto classes)
    from transformers import AutoModelForCausalLM

    config = fla_config(model_type, **overrides)
    tensors = fla_tensors(config)
    src = write_fla_checkpoint(tmp_path / "fla", config, tensors)
    convert_checkpoint(src, tmp_path / "hf", from_format="fla", to_format="hf")
    tokens = torch.randint(0, config["vocab_size"], (1, 100), generator=torch.Generator().manual_seed(1))
    reference = reference_logits(config, tensors, tokens[0])
    shift = max_rel_err(reference_logits(config, _tf32(tensors), tokens[0]), reference)

    fla_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
    ours = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        fla_logits = fla_model(tokens.cuda()).logits[0].double().cpu()
        our_logits = ours(tokens.cuda()).logits[0].double().cpu()
        fla_short = fla_model(tokens[:, :20].cuda()).logits[0].double().cpu()
    assert max_rel_err(fla_short, reference[:20]) <= RECURRENT_TOL, (case, max_rel_err(fla_short, reference[:20]))
    fla_error, our_error = max_rel_err(fla_logits, reference), max_rel_err(our_logits, reference)
    print(f"{case}: TF32 weight shift {shift:.2e}, fla {fla_error:.2e}, ours {our_error:.2e}, "
          f"ours vs fla {max_rel_err(our_logits, fla_logits):.2e}")
    assert fla_error <= TF32_MARGIN * shift, (case, fla_error, shift)
    assert our_error <= TF32_MARGIN * shift, (case, our_error, shift)
