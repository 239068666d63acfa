"""`hybrid-linear-finetune` (placeholder: forwards to the fine-tuning script until the light front end lands)."""

import sys


def main(argv=None) -> int:
    from hybrid_linear_models.finetune import main as finetune_main

    return finetune_main(argv)


if __name__ == "__main__":
    sys.exit(main())
