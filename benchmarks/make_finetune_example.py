"""Writes a small model folder (GDN, KDA and attention layers, word-level tokenizer; about 109 MB) and a JSONL dataset
with a learnable rule, for running the fine-tuning example end to end (e.g. on several GPUs).

    python benchmarks/make_finetune_example.py WORKDIR   # -> WORKDIR/model, WORKDIR/data.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(2, 512)]


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path, metavar="WORKDIR",
                        help="folder to write model/ and data.jsonl into (created if missing; both must not exist)")
    args = parser.parse_args(argv)
    existing = [path for path in (args.workdir / "model", args.workdir / "data.jsonl") if path.exists()]
    if existing:
        parser.error(f"{existing[0]} exists; choose another WORKDIR or remove it")
    return args


def main(argv: list[str] | None = None) -> None:
    work = parse_arguments(argv).workdir
    # torch, transformers and the package load only once the arguments are good (--help answers at once)
    import torch

    from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from model_helpers import word_tokenizer

    tokenizer = word_tokenizer(WORDS)
    torch.manual_seed(0)
    config = HybridLinearConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64,
        layer_types=["gated_deltanet", "kimi_delta_attention", "gated_deltanet", "full_attention"] * 2,
        gdn_num_key_heads=4, gdn_num_value_heads=8, gdn_key_head_dim=64, gdn_value_head_dim=64, kda_num_heads=8,
        kda_head_dim=64, pad_token_id=0, eos_token_id=1,
    )
    model = HybridLinearForCausalLM(config)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    rng = random.Random(0)
    with open(work / "data.jsonl", "w") as f:
        for _ in range(2000):  # arithmetic progressions of words: a rule the model can learn
            start, step, length = rng.randrange(len(WORDS)), rng.randrange(1, 5), rng.randrange(32, 256)
            f.write(json.dumps({"text": " ".join(WORDS[(start + step * i) % len(WORDS)] for i in range(length))}) + "\n")
    print(f"wrote {work / 'model'} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) and "
          f"{work / 'data.jsonl'}")


if __name__ == "__main__":
    main()
