"""`hybrid-linear-convert` (placeholder: forwards to the conversion CLI until the light front end lands)."""

import sys


def main(argv=None) -> int:
    from hybrid_linear_models.conversion.cli import main as convert_main

    return convert_main(argv)


if __name__ == "__main__":
    sys.exit(main())
