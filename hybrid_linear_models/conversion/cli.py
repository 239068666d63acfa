"""`python -m hybrid_linear_models.conversion.cli`: the `hybrid-linear-convert` command line, which lives in the
light `hybrid_linear_cli.convert` (its --help needs no torch); kept here for the module path."""

from __future__ import annotations

import sys

from hybrid_linear_cli.convert import PROG, build_parser, main

__all__ = ["PROG", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
