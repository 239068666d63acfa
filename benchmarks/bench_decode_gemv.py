"""The decoding step's matrix-vector products on a GPU: which way of asking cuBLAS reads the weights fastest.

At batch 1 every linear layer of a decoding step is a GEMV whose time is its weight read, so its speed is bytes over
time against the GPU's bandwidth. cuBLAS picks a kernel per problem layout: profile_decode_step.py showed the same
product running at 3.3 TB/s for one width and 0.33 TB/s for another (Kimi-Linear's shared expert, 1024 x 2048, 12.7
us). For each weight shape of the benchmark models this times, in one run, CUDA-graph replays of:
- linear: F.linear(x, W)  (cuBLAS, what nn.Linear does);
- triton: this package's Triton GEMV in the form `gemv_forms.form` picks (`kernels_gemv_triton`: at batch 1 its
  one-row form; 2 to 8 rows its elementwise form up to 1,024 outputs; else its tl.dot form; captured decoding steps
  and verify rounds run it within the widths of `gemv_forms.WIDEST_OUTPUTS`, cuBLAS past them), autotuned first;
- elementwise (batches of 2 to 8): the elementwise form at every width, whether it should take wider products;
and prints microseconds per product, the share of `--bandwidth-gbs` (bf16) and which is faster. The "gathered" row is
GDN's decoding input projection with its outputs regrouped (a permutation): F.linear then index_select against the
kernel reading the weight rows in that order (`kernels_gemv.linear_rows`); the "with SwiGLU" row is the MLP's gate
and up projections with their activation: F.linear then SwiGLU's kernel (fla's where installed), against the kernel
reading the rows in (gate, up) pairs and storing silu(gate) * up (`kernels_gemv.linear_swiglu`). (Asking cuBLAS for
the transposed product, (W @ x^T)^T, gives the same kernels and the same times.)

Without CUDA it says so and exits; `--tiny` then runs its forms on the CPU instead (each shape 16 times narrower,
float32, timed by the host clock; the Triton form only where triton imports): a smoke test of this script, whose
shares of the bandwidth mean nothing there.

    python benchmarks/bench_decode_gemv.py [--batches 1 4 16] [--bandwidth-gbs 4800] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

# (out, in) of the benchmark models' decoding GEMMs: GDN 1.2B, KDA 1B, Kimi-Linear (bench_kimi_linear.py)
SHAPES = {
    "gdn in_proj (qkvz+ba)": (12352, 2048), "gdn out_proj": (2048, 4096), "mlp gate+up": (11264, 2048),
    "mlp down": (2048, 5632), "attention qkv (gated)": (9216, 2048), "attention o_proj": (2048, 4096),
    "kda in (q,k,v,f,b,g)": (8448, 2048), "kda o_proj": (2048, 2048), "shared expert gate+up": (1024, 2048),
    "shared expert down": (2048, 512), "mla kv_a": (576, 2048), "mla q": (3072, 2048), "lm head": (32000, 2048),
    "gdn in_proj, gathered": (12352, 2048), "mlp gate+up, with SwiGLU": (11264, 2048),
}


FORMS = {}  # form -> fn(x, w, rows, swiglu); filled in main, once the package is importable


def bench_device(script: str, tiny: bool, what: str) -> tuple[torch.device, object] | None:
    """The device a kernel benchmark times on and its timer: CUDA with `time_replays`, or with `tiny` the CPU with
    `time_calls`; None (one line printed: `script` skipped, it times `what`) without CUDA or `tiny`."""
    print("command: python " + " ".join(sys.argv))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not tiny:
        print(f"{script}: skipped, it times {what} against a GPU's bandwidth and needs a CUDA device (--tiny runs its "
              "forms on the CPU)")
        return None
    return device, time_replays if device.type == "cuda" else time_calls


def time_calls(fn, repeats: int) -> float:
    """Microseconds per call of fn on the CPU, by the host clock (the --tiny smoke run)."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) * 1e6 / repeats


def time_replays(fn, repeats: int) -> float:
    """Microseconds per call of fn, from a CUDA graph of `repeats` calls (no launch overhead in the figure)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def elementwise_at_any_width(run):
    """run() with the Triton GEMV's elementwise form of a few rows taken at any width (the "elementwise" column:
    where it beats the form `gemv_forms.WIDEST_OUTPUTS` picks past its widest outputs)."""
    from hybrid_linear_models import gemv_forms

    widest = gemv_forms.WIDEST_OUTPUTS["few_rows"]
    gemv_forms.WIDEST_OUTPUTS["few_rows"] = None
    try:
        return run()
    finally:
        gemv_forms.WIDEST_OUTPUTS["few_rows"] = widest


def tuned_config(batch: int, outputs: int) -> str:
    """The form of the Triton GEMV for this batch and width (gemv_forms.form) and the configuration its autotuner
    chose last (BLOCK_N, BLOCK_K, warps, stages), or '' without triton."""
    from hybrid_linear_models import gemv_forms

    try:
        from hybrid_linear_models import kernels_gemv_triton as kernel
    except ImportError:
        return ""
    kind = gemv_forms.form(batch, outputs)
    config = getattr(kernel._FORMS[kind][0], "best_config", None)
    if config is None:
        return ""
    return f"{kind} {config.kwargs['BLOCK_N']}x{config.kwargs['BLOCK_K']} w{config.num_warps} s{config.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0)
    parser.add_argument("--tiny", action="store_true", help="without CUDA: narrow shapes on the CPU (a smoke test)")
    args = parser.parse_args()
    chosen = bench_device("bench_decode_gemv.py", args.tiny, "GEMVs")
    if chosen is None:
        return
    device, timer = chosen
    dtype, narrow = (torch.bfloat16, 1) if device.type == "cuda" else (torch.float32, 16)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    # the kernels' tuned configurations are what this compares (kernel_tuning); HYBRID_LINEAR_AUTOTUNE=0 times the
    # default ones instead
    os.environ.setdefault("HYBRID_LINEAR_AUTOTUNE", "1")
    from hybrid_linear_models import gemv_forms
    from hybrid_linear_models.kernels_gemv import (swiglu_pair_rows, torch_linear_rows, torch_linear_swiglu,
                                                   triton_gemv_kernel)

    FORMS["linear"] = lambda x, w, rows, swiglu: (torch_linear_swiglu(x, w, None) if swiglu
                                                  else torch_linear_rows(x, w, None, rows))
    if device.type == "cuda" and triton_gemv_kernel() is not None:
        FORMS["triton"] = lambda x, w, rows, swiglu: triton_gemv_kernel()(x, w, None, rows, swiglu_pairs=swiglu)
        if any(1 < batch <= gemv_forms.FEW_ROWS for batch in args.batches):
            FORMS["elementwise"] = lambda x, w, rows, swiglu: elementwise_at_any_width(
                lambda: triton_gemv_kernel()(x, w, None, rows, swiglu_pairs=swiglu))
    else:
        print("the Triton GEMV: skipped, it runs on CUDA tensors only")
    print(f"{'weight':24s} {'out x in':>12s} {'batch':>5s} " + " ".join(f"{f + ' us':>11s} {'share':>6s}" for f in FORMS)
          + "  faster / linear")
    for name, (out, inp) in SHAPES.items():
        out, inp = out // narrow // 2 * 2, inp // narrow  # (an even width: SwiGLU's rows come in pairs)
        # several weights in turn, 4x the L2 cache together, so each product reads its weight from memory
        copies = max(1, int(4 * 50e6 // (out * inp * 2)) + 1) if device.type == "cuda" else 1
        weights = [torch.randn(out, inp, device=device, dtype=dtype) for _ in range(copies)]
        swiglu = "SwiGLU" in name
        rows = torch.randperm(out, device=device) if "gathered" in name else None
        if swiglu:
            rows = swiglu_pair_rows(out // 2, device)
        for batch in args.batches:
            x = torch.randn(batch, inp, device=device, dtype=dtype)
            figures = {}
            for form, fn in FORMS.items():
                calls = [lambda w=w, fn=fn: fn(x, w, rows, swiglu) for w in weights]
                figures[form] = timer(lambda: [c() for c in calls], repeats=max(1, 200 // copies)) / copies
            bytes_read = out * inp * weights[0].element_size()
            cells = " ".join(f"{us:>11.2f} {bytes_read / (us * 1e-6) / (args.bandwidth_gbs * 1e9):>6.1%}"
                             for us in figures.values())
            best = min(figures, key=figures.get)
            print(f"{name:24s} {f'{out}x{inp}':>12s} {batch:>5d} {cells}  {best} "
                  f"{figures['linear'] / figures[best]:.2f}x  {tuned_config(batch, out // 2 if swiglu else out)}")


if __name__ == "__main__":
    main()
