"""Fine-tune a hybrid model folder with transformers.Trainer: the same script as `hybrid-linear-finetune`
(see `python examples/finetune.py --help`, and `hybrid_linear_models/training/finetune.py` for how it works)."""

import sys

from hybrid_linear_cli.finetune import main

if __name__ == "__main__":
    sys.exit(main())
