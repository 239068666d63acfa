"""`python -m hybrid_linear_models.conversion ...` runs the converter CLI (`hybrid-linear-convert`)."""

import sys

from hybrid_linear_cli.convert import main

sys.exit(main())
