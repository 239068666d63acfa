"""What the torchrun test scripts share."""

import os
import sys


def leave() -> None:
    """Exits at once. Destroying gloo/DDP objects (when a script's locals go, or at interpreter shutdown) sometimes
    hangs, about 1 run in 10 here; the work is done and flushed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
