"""`python -m hybrid_linear_models.conversion ...` runs the converter CLI."""

import sys

from .cli import main

sys.exit(main())
