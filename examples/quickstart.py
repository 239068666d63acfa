"""End to end on a small built-in example, CPU only, no network:

1. convert a real Fast-LLM checkpoint (a tiny attention + Gated DeltaNet + Kimi Delta Attention model shipped in
   tests/fixtures) to the Hugging Face format and check it reproduces Fast-LLM's own logits;
2. load it with `AutoModelForCausalLM.from_pretrained` and generate;
3. build a fresh model from a config, save it, reload it and generate again.

It prints a few lines (what was converted and how close it is to Fast-LLM, the generated tokens, where the models
are) and fails if the converted model does not reproduce Fast-LLM's logits.

    python examples/quickstart.py [--output DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda"
SHORT_NAMES = {"full_attention": "attention", "sliding_attention": "sliding attention", "gated_deltanet": "GDN",
               "kimi_delta_attention": "KDA"}


def layer_summary(layer_types: list[str]) -> str:
    return ", ".join(SHORT_NAMES.get(layer_type, layer_type) for layer_type in layer_types)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="where to write the models (default: a temporary folder)")
    args = parser.parse_args(argv)
    # torch, transformers and the package load once there is work to do: --help answers at once
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
    from hybrid_linear_models.conversion.api import convert_checkpoint

    workdir = args.output or Path(tempfile.mkdtemp(prefix="hybrid-quickstart-"))
    workdir.mkdir(parents=True, exist_ok=True)
    transformers_logging.disable_progress_bar()  # tiny models: the loading/saving bars would outnumber the results

    # 1. Fast-LLM -> Hugging Face (the same as: hybrid-linear-convert --from fast_llm --to hf SRC DST)
    converted = workdir / "converted-hf"
    result = convert_checkpoint(FIXTURE / "fast_llm", converted, from_format="fast_llm", to_format="hf", force=True)

    # 2. load it like any Hub model, compare with Fast-LLM's logits, generate
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    reference = load_file(FIXTURE / "reference_logits.safetensors")
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    error = (logits - reference["logits"]).abs().max().item()
    assert error <= 1e-4, f"the converted model does not reproduce Fast-LLM's logits (max difference {error:.2e})"
    print(f"converted the Fast-LLM checkpoint ({layer_summary(model.config.mixer_types)}): {result.tensors} tensors, "
          f"{result.bytes / 2**20:.1f} MiB; max |logits - Fast-LLM's| = {error:.1e} (tolerance 1e-4)")
    generated = model.generate(reference["input_ids"][:1, :8], max_new_tokens=12, do_sample=False)
    print(f"  greedy continuation of 8 prompt tokens: {generated[0, 8:].tolist()}")

    # 3. a fresh model from a config: save, reload, generate
    config = HybridLinearConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=32, gdn_value_head_dim=32,
        kda_num_heads=4, kda_head_dim=32,
        mixer_types=["gated_deltanet", "kimi_delta_attention", "gated_deltanet", "full_attention"],
    )
    fresh = workdir / "fresh-hf"
    torch.manual_seed(0)  # the same weights and samples on every run
    model = HybridLinearForCausalLM(config).eval()
    model.save_pretrained(fresh)
    reloaded = AutoModelForCausalLM.from_pretrained(fresh).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, reloaded(prompt).logits), "the reloaded model differs from the saved one"
    sampled = reloaded.generate(prompt, max_new_tokens=16, do_sample=True)[0, 10:].tolist()
    print(f"fresh model ({layer_summary(config.mixer_types)}), saved and reloaded (same logits): 16 sampled tokens "
          f"{sampled}")
    print(f"models in {workdir}: converted-hf/ and fresh-hf/ (each loads with AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
