"""Which form of the decoding GEMV (kernels_gemv_triton) takes a product, by its rows of x and its outputs: the
measured limits of each form against cuBLAS (the reasons and figures: kernels_gemv's docstring). Its own module, since
both kernels_gemv (which routes products) and kernels_gemv_triton (which launches a form) read it."""

from __future__ import annotations

# out_features (gathered outputs for `linear_rows`) up to which each form of the kernel is taken: "one_row" for x of
# one row (batch-1 decoding), "few_rows" for 2 to FEW_ROWS rows (a verify round of a few tokens), "rows" (tl.dot) for
# more, and for a few rows past their limit; None: any width
WIDEST_OUTPUTS: dict[str, int | None] = {"one_row": None, "few_rows": 1024, "rows": 2048}
MAX_ROWS = 16  # rows of x (batch x tokens) the kernel takes
FEW_ROWS = 8  # rows of x up to which it runs its elementwise form (kernels_gemv_triton)


def within_width(outputs: int, rows_of_x: int, gathered: bool, paired: bool) -> bool:
    """Plain products up to the measured width of the form that serves them; past it, a gather is worth folding in
    (it is a kernel of its own otherwise: GDN's regrouped input projection runs faster as one kernel in every form),
    and so are SwiGLU's pairs, except for 2 to FEW_ROWS rows, where cuBLAS and SwiGLU's own kernel run faster than the
    tl.dot form (kernels_gemv's docstring)."""
    widest = WIDEST_OUTPUTS[form(rows_of_x, outputs)]
    if widest is None or outputs <= widest:
        return True
    return gathered and not (paired and 1 < rows_of_x <= FEW_ROWS)


def form(rows_of_x: int, outputs: int) -> str:
    """The kernel's form for x of `rows_of_x` rows and `outputs` output columns: "one_row"; "few_rows" (2 to
    FEW_ROWS rows, up to its widest outputs); else "rows" (tl.dot)."""
    if rows_of_x == 1:
        return "one_row"
    widest = WIDEST_OUTPUTS["few_rows"]
    return "few_rows" if rows_of_x <= FEW_ROWS and (widest is None or outputs <= widest) else "rows"


__all__ = ["FEW_ROWS", "MAX_ROWS", "WIDEST_OUTPUTS", "form", "within_width"]
