"""Fine-tune a hybrid model folder with transformers.Trainer: see `hybrid_linear_models/finetune.py` (--help)."""

import sys

from hybrid_linear_models.finetune import main

if __name__ == "__main__":
    sys.exit(main())
