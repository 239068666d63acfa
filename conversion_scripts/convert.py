#!/usr/bin/env python
"""Thin wrapper so the converter runs from a source checkout: `python conversion_scripts/convert.py --help`.
Installed, the same CLI is `hybrid-linear-convert`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when the package is not installed

from hybrid_linear_cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
