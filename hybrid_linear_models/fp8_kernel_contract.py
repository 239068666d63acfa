"""What the FP8 products' plain reference (`kernels_fp8`) and their Triton kernels (`kernels_fp8_triton`) agree on:
the prefill forms, the row tiles, and the routes check. Both import it; neither imports the other at import time
(`kernels_fp8` loads the kernels only where it calls them), so the two stay one-directional.
"""

from __future__ import annotations

import torch

# what products of more than 16 rows (prefill) can run; `kernels_fp8.PREFILL_FORM` picks one
PREFILL_FORMS = ("dequantized_dot", "fp8_dot", "dequantize_then_linear")
OFFSET_DTYPES = (torch.int32, torch.int64)  # expert offsets and routes
# rows of x (per expert, on average, for the experts) past which a product takes the next larger row tile of 16, 64
# and 128 rows (`kernels_fp8_triton._tile_rows`; up to the first, the decoding form): each tile is its own tuning key
TILE_ROW_BOUNDS = (16, 64)


def check_routes(x: torch.Tensor, routes: torch.Tensor, most: int | None = None) -> None:
    """A ValueError line unless x is [T, in] and `routes` [T * R] one int32/int64 expert per route (at most `most`)."""
    if (x.dim() != 2 or routes.dim() != 1 or routes.dtype not in OFFSET_DTYPES
            or (x.shape[0] and routes.shape[0] % x.shape[0]) or (most is not None and routes.shape[0] > most)):
        limit = f", at most {most} (a kernel program row each; sort more routes by expert)" if most else ""
        raise ValueError(f"routed experts: x {tuple(x.shape)} must be [T, in] and routes {tuple(routes.shape)} "
                         f"{routes.dtype} one int32/int64 expert per route, the same number of routes per row of x"
                         f"{limit}")


__all__ = ["OFFSET_DTYPES", "PREFILL_FORMS", "TILE_ROW_BOUNDS", "check_routes"]
