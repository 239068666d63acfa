"""The oldest transformers this package runs on, checked on import of the configuration module: the package's first
import, and the first file transformers loads from a saved folder's remote code (`trust_remote_code=True`), which may
run where this package was never installed and an older transformers is. An older one fails here in one line naming
both versions and the upgrade, not later at a missing name deep in the modeling code.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

MINIMUM_TRANSFORMERS = "5.24"  # pyproject.toml's lower bound (tests/test_packaging.py checks that they agree)


def check_transformers_version(found: str = transformers.__version__) -> None:
    """ImportError when `found` is older than MINIMUM_TRANSFORMERS (its pre-releases and dev builds count as it)."""
    if Version(Version(found).base_version) < Version(MINIMUM_TRANSFORMERS):
        raise ImportError(f"hybrid_linear_models needs transformers>={MINIMUM_TRANSFORMERS}, found {found}: "
                          f"pip install -U 'transformers>={MINIMUM_TRANSFORMERS},<6'")


check_transformers_version()
