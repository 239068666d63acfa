"""Block-scaled FP8 linear layers on a GPU: this package's Triton kernels beside the dense bf16 product of the same
weight, at Qwen3-Next-80B-A3B's shapes (the released FP8 build: e4m3 weights, one float32 scale per 128 x 128 block).

For each weight shape and row count this times CUDA-graph replays (no launch overhead in the figures) of:
- fp8: `kernels_fp8.block_fp8_linear` / `block_fp8_grouped_linear` (the Triton kernels, autotuned first: one row
  "one_row", up to 16 rows "scaled_dot", more "dequantized_dot"; the experts one launch, the offsets on the device);
- fp8xfp8 (prefill rows): the same kernel's "fp8_dot" form, x quantized per 1 x 128 (timed with it) and FP8 tensor
  cores (`kernels_fp8.PREFILL_FORM = "fp8_dot"`, not the default: not the reference's numbers);
- bf16: F.linear (cuBLAS) on the dequantized bf16 weight, or for the experts torch's grouped_mm on it (what a bf16
  checkpoint runs: twice the weight bytes);
- deq+bf16: the FP8 weight dequantized by the package's kernel (`kernels_fp8_triton.dequantize`; torch ops without
  CUDA), then F.linear (dense shapes: `kernels_fp8.PREFILL_FORM = "dequantize_then_linear"`, the reference's
  product);
- scaled_mm: torch's FP8 tensor-core product with DeepSeek's block scales (x quantized per 1 x 128, the weight's
  128 x 128; x's quantization not timed), where this torch and GPU offer it (dense shapes);
- transformers: transformers' fine-grained FP8 linear (its Hub kernel or DeepGEMM), where it loads with no network
  (HF_HUB_OFFLINE, unless set otherwise: a kernel already in the Hub cache) (dense shapes).
A form that fails once (no kernel for this torch or GPU) is not tried again; the last lines say why.
It prints microseconds, the FP8 kernel's achieved GB/s (its weight's bytes, FP8 plus scales, over its time) and
that share of `--bandwidth-gbs` (the weight-read limit, 4.8 TB/s on an H200: what bounds decoding), TFLOP/s where
the product is compute-bound (prefill), and each other form's time over the FP8 kernel's.

Without CUDA it says so and exits; `--tiny` then runs its forms on the CPU instead (each shape 16 times narrower,
float32, timed by the host clock; the Triton kernels only on CUDA tensors, so fp8 is the dequantizing reference
there): a smoke test of this script, whose figures mean nothing there.

    python benchmarks/bench_fp8_linear.py [--rows 1 16 4096] [--bandwidth-gbs 4800] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_decode_gemv import bench_device  # (a sibling script: the same device choice and timing)

BLOCK = (128, 128)
# Qwen3-Next-80B-A3B's FP8 products, (out, in): hidden 2048; GDN's in_proj_qkvz and in_proj_ba and out_proj; the
# gated attention's q (with its gate), k or v and o_proj; the shared expert's gate+up and down
DENSE = {
    "gdn in_proj_qkvz": (12288, 2048), "gdn in_proj_ba": (64, 2048), "gdn out_proj": (2048, 4096),
    "attention q+gate": (8192, 2048), "attention k or v": (512, 2048), "attention o_proj": (2048, 4096),
    "shared expert gate+up": (1024, 2048), "shared expert down": (2048, 512),
}
# the routed experts: 512 of them, 10 per token, each (out, in)
EXPERTS = {"expert gate+up": (1024, 2048), "expert down": (2048, 512)}
NUM_EXPERTS, TOP_K = 512, 10


def fp8_weight(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight and its float32 block scales (unit-size outputs)."""
    *lead, out, inp = shape
    w = (torch.randn(*shape, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(*lead, -(-out // BLOCK[0]), -(-inp // BLOCK[1]), device=device) + 0.5) / (64 * inp ** 0.5)
    return w, scale


def dequantized(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` by torch ops (float32's product, as kernels_fp8's reference rounds it)."""
    out, inp = w.shape[-2:]
    full = scale.repeat_interleave(BLOCK[0], -2)[..., :out, :].repeat_interleave(BLOCK[1], -1)[..., :inp]
    return (w.float() * full).to(dtype)


def scaled_mm_form(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor):
    """torch's block-scaled FP8 product (DeepSeek's 1 x 128 activation and 128 x 128 weight scales), as a function
    of nothing, or the reason it is not available."""
    if not hasattr(F, "scaled_mm") or x.device.type != "cuda":
        return "needs torch's F.scaled_mm on CUDA"
    rows, inp = x.shape
    if inp % 128:
        return "in not a multiple of 128"
    groups = x.float().view(rows, inp // 128, 128)
    x_scale = groups.abs().amax(-1).clamp(min=1e-12) / 448.0  # [rows, in / 128]
    x_fp8 = (groups / x_scale[..., None]).view(rows, inp).to(torch.float8_e4m3fn)
    recipe = F.ScalingType
    last = None
    for a_scale in (x_scale, x_scale.t().contiguous().t()):  # row-major scales, then the M-major layout cuBLAS wants
        def call(a_scale=a_scale):
            return F.scaled_mm(x_fp8, w.t(), a_scale, recipe.BlockWise1x128, scale.t(), recipe.BlockWise128x128,
                               output_dtype=torch.bfloat16)
        try:
            call()
            return call
        except Exception as error:  # noqa: BLE001  (no kernel for this GPU, torch or layout)
            last = error
    return f"{type(last).__name__}: {str(last).splitlines()[0][:70]}"


def transformers_form(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor):
    """transformers' fine-grained FP8 linear (its Hub kernel, or DeepGEMM) as a function, or why it is not there."""
    if x.device.type != "cuda":
        return "needs CUDA"
    try:
        from transformers.integrations.finegrained_fp8 import fp8_linear

        def call():
            return fp8_linear(x, w, scale, list(BLOCK))

        call()
        return call
    except Exception as error:  # noqa: BLE001  (no kernels package, no network for the Hub kernel)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:70] if str(error) else ''}"


def tuned_config(form: str) -> str:
    """The configuration the autotuner chose last for a form of the FP8 kernel, or '' without triton."""
    try:
        from hybrid_linear_models import kernels_fp8_triton as kernel
    except ImportError:
        return ""
    config = getattr(kernel._TUNED[form], "best_config", None)
    if config is None:
        return ""
    return f"{form} {config.kwargs['BLOCK_N']}x{config.kwargs['BLOCK_K']} w{config.num_warps} s{config.num_stages}"


def routing(tokens: int, experts: int, device: torch.device) -> torch.Tensor:
    """Offsets (int32, cumulative rows per expert) of `tokens` tokens each routed to TOP_K distinct experts."""
    g = torch.Generator().manual_seed(tokens)
    chosen = torch.rand(tokens, experts, generator=g).topk(min(TOP_K, experts), dim=-1).indices.flatten()
    return torch.bincount(chosen, minlength=experts).cumsum(0).to(device, torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 16, 4096],
                        help="rows of x (tokens; the experts take TOP_K rows per token)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0)
    parser.add_argument("--tiny", action="store_true", help="without CUDA: narrow shapes on the CPU (a smoke test)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers' Hub kernel only where it is cached: no network
    chosen = bench_device("bench_fp8_linear.py", args.tiny, "FP8 kernels")
    if chosen is None:
        return
    device, timer = chosen
    dtype, narrow, experts = (torch.bfloat16, 1, NUM_EXPERTS) if device.type == "cuda" else (torch.float32, 16, 16)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    # the kernels' tuned configurations are what this compares (kernel_tuning); HYBRID_LINEAR_AUTOTUNE=0 times the
    # default ones instead
    os.environ.setdefault("HYBRID_LINEAR_AUTOTUNE", "1")
    from transformers.integrations.moe import _grouped_mm

    from hybrid_linear_models.kernels_fp8 import (
        block_fp8_grouped_linear,
        block_fp8_linear,
        triton_applies,
    )

    probe = fp8_weight((128, 128), device)
    fp8_dot = None  # the kernels' FP8 x FP8 form (x quantized per 1 x 128), called directly (its switch is off)
    if not triton_applies(torch.zeros(1, 128, device=device, dtype=dtype), *probe, None):
        print("the Triton kernels: skipped, they run on CUDA tensors only (fp8 is the dequantizing reference here)")
    else:
        from hybrid_linear_models.kernels_fp8_triton import (
            fp8_grouped_linear,
            fp8_linear,
        )

        fp8_dot = (fp8_linear, fp8_grouped_linear)
    print(f"{'weight':22s} {'out x in':>11s} {'rows':>6s} {'fp8 us':>9s} {'GB/s':>7s} {'share':>6s} {'TFLOP/s':>7s}  "
          f"{'other forms: us (x fp8)':36s} fp8 form")
    reasons = {}
    for name, (out, inp) in {**DENSE, **EXPERTS}.items():
        grouped = name in EXPERTS
        out, inp = max(out // narrow, 16), max(inp // narrow, 16)
        lead = (experts,) if grouped else ()
        weight_bytes = out * inp * (experts if grouped else 1)
        # several weights in turn, 4x the L2 cache together, so each product reads its weight from memory
        copies = max(1, int(4 * 50e6 // weight_bytes) + 1) if device.type == "cuda" else 1
        weights = [fp8_weight((*lead, out, inp), device) for _ in range(copies)]
        dense = [dequantized(w, s, dtype) for w, s in weights]
        for tokens in args.rows:
            rows = tokens * min(TOP_K, experts) if grouped else tokens
            x = torch.randn(rows, inp, device=device, dtype=dtype)
            forms = {}
            if grouped:
                offsets = routing(tokens, experts, device)
                forms["fp8"] = [lambda w=w, s=s, x=x, o=offsets: block_fp8_grouped_linear(x, w, s, o, BLOCK)
                                for w, s in weights]
                forms["bf16"] = [lambda d=d, x=x, o=offsets: _grouped_mm(x, d.transpose(1, 2), o) for d in dense]
                if fp8_dot is not None and rows > 16 * experts:
                    forms["fp8xfp8"] = [lambda w=w, s=s, x=x, o=offsets: fp8_dot[1](x, w, s, o, BLOCK, form="fp8_dot")
                                        for w, s in weights]
            else:
                forms["fp8"] = [lambda w=w, s=s, x=x: block_fp8_linear(x, w, s, BLOCK) for w, s in weights]
                forms["bf16"] = [lambda d=d, x=x: F.linear(x, d) for d in dense]
                if fp8_dot is not None:  # the package's dequantizing kernel (PREFILL_FORM "dequantize_then_linear")
                    forms["deq+bf16"] = [lambda w=w, s=s, x=x: fp8_dot[0](x, w, s, BLOCK, form="dequantize_then_linear")
                                         for w, s in weights]
                else:
                    forms["deq+bf16"] = [lambda w=w, s=s, x=x: F.linear(x, dequantized(w, s, dtype))
                                         for w, s in weights]
                if fp8_dot is not None and rows > 16:
                    forms["fp8xfp8"] = [lambda w=w, s=s, x=x: fp8_dot[0](x, w, s, BLOCK, form="fp8_dot")
                                        for w, s in weights]
                for label, make in (("scaled_mm", scaled_mm_form), ("transformers", transformers_form)):
                    if label in reasons:  # failed once: not tried again
                        continue
                    calls = [make(x, w, s) for w, s in weights]
                    if any(isinstance(c, str) for c in calls):
                        reasons[label] = next(c for c in calls if isinstance(c, str))
                    else:
                        forms[label] = calls
            figures = {}
            with torch.no_grad():
                for label, calls in forms.items():
                    try:
                        figures[label] = timer(lambda calls=calls: [c() for c in calls],
                                               repeats=max(1, 100 // copies)) / copies
                    except Exception as error:
                        if label == "fp8":
                            raise
                        reasons[label] = f"{type(error).__name__}: {str(error).splitlines()[0][:70]}"
            read = weight_bytes + weights[0][1].numel() * 4 if not grouped else None
            if grouped:  # the experts that have rows: their weights are what is read
                used = int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())
                read = used * (out * inp + weights[0][1][0].numel() * 4)
            us = figures["fp8"]
            gbs = read / (us * 1e-6) / 1e9
            tflops = 2 * rows * out * inp / (us * 1e-6) / 1e12
            others = " ".join(f"{label} {t:.1f} ({t / us:.2f}x)" for label, t in figures.items() if label != "fp8")
            print(f"{name:22s} {f'{out}x{inp}':>11s} {rows:>6d} {us:>9.2f} {gbs:>7.0f} "
                  f"{gbs / args.bandwidth_gbs:>6.1%} {tflops:>7.1f}  {others:36s} "
                  f"{tuned_config(_form(rows, grouped, experts)) if device.type == 'cuda' else ''}")
    for label, reason in reasons.items():
        print(f"{label}: not timed ({reason})")


def _form(rows: int, grouped: bool, experts: int) -> str:
    """The form of the FP8 kernel that serves `rows` rows (kernels_fp8_triton's choice)."""
    from hybrid_linear_models.kernels_fp8_triton import DECODING_ROWS

    per = -(-rows // experts) if grouped else rows
    if not grouped and rows == 1:
        return "one_row"
    return "scaled_dot" if per <= DECODING_ROWS else "dequantized_dot"


if __name__ == "__main__":
    main()
