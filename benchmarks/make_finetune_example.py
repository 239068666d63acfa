"""Writes a small model folder (all four mixers, word-level tokenizer) and a JSONL dataset with a learnable rule,
for running the fine-tuning example end to end (e.g. on several GPUs).

    python benchmarks/make_finetune_example.py WORKDIR   # -> WORKDIR/model, WORKDIR/data.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from model_helpers import word_tokenizer  # noqa: E402

WORDS = [f"w{i}" for i in range(2, 512)]


def main() -> None:
    work = Path(sys.argv[1])
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
