"""End to end on a small built-in example, CPU only, no network:

1. convert a real Fast-LLM checkpoint (a tiny attention + Gated DeltaNet + Kimi Delta Attention model shipped in
   tests/fixtures) to the Hugging Face format and check it reproduces Fast-LLM's own logits;
2. load it with `AutoModelForCausalLM.from_pretrained` and generate;
3. build a fresh model from a config, save it, reload it and generate again.

    python examples/quickstart.py [--output DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.conversion.api import convert_checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="where to write the models (default: a temporary folder)")
    args = parser.parse_args()
    workdir = args.output or Path(tempfile.mkdtemp(prefix="hybrid-quickstart-"))
    workdir.mkdir(parents=True, exist_ok=True)

    # 1. Fast-LLM -> Hugging Face (the same as: hybrid-linear-convert --from fast_llm --to hf SRC DST)
    converted = workdir / "converted-hf"
    convert_checkpoint(FIXTURE / "fast_llm", converted, from_format="fast_llm", to_format="hf", force=True)
    print(f"converted {FIXTURE / 'fast_llm'} -> {converted}: {sorted(p.name for p in converted.iterdir())}")

    # 2. load it like any Hub model, compare with Fast-LLM's logits, generate
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    reference = load_file(FIXTURE / "reference_logits.safetensors")
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    error = (logits - reference["logits"]).abs().max().item()
    print(f"{type(model).__name__} with layers {model.config.layer_types}: max |logits - Fast-LLM's| = {error:.2e}")
    assert error <= 1e-4, "the converted model does not reproduce Fast-LLM's logits"
    generated = model.generate(reference["input_ids"][:, :8], max_new_tokens=12, do_sample=False)
    print("greedy continuation of the first 8 tokens:", generated[:, 8:].tolist())

    # 3. a fresh model from a config: save, reload, generate
    config = HybridLinearConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=32, gdn_value_head_dim=32,
        kda_num_heads=4, kda_head_dim=32,
        layer_types=["gated_deltanet", "kimi_delta_attention", "gated_deltanet", "full_attention"],
    )
    fresh = workdir / "fresh-hf"
    HybridLinearForCausalLM(config).save_pretrained(fresh)
    reloaded = AutoModelForCausalLM.from_pretrained(fresh)
    prompt = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    print("fresh model, 16 sampled tokens:", reloaded.generate(prompt, max_new_tokens=16, do_sample=True)[0, 10:].tolist())
    print(f"done; models are in {workdir}")


if __name__ == "__main__":
    main()
