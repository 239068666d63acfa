"""Programmatic dependent launch (PDL) for this package's decoding kernels: a kernel starts while the one ahead of it
in the stream is still running, reads what no kernel of the step writes (its weights), then waits for it.

A batch-1 decoding step of the benchmark models is a chain of 148 (GDN) to 184 (KDA) kernels, each waiting for the
last. The GEMVs, most of the step, pay a fixed cost each besides their bytes (a launch, and the latency of the first
loads while no weight byte moves), which over a step's 65 GEMVs is its largest overhead (docs/performance.md gives
the fit on an H200). With PDL (Hopper on: PTX `griddepcontrol`), once every program of kernel A has passed
`gdc_launch_dependents`, kernel B, launched with `launch_pdl`, may start on the SMs A frees: B issues its first weight loads, then `gdc_wait`s until A has finished and its writes are visible. A CUDA
graph keeps these programmatic edges.

The contract of a kernel that calls `await_previous_kernel` (all of its programs do, on every path):
- before the call it reads only memory no kernel of the step writes (weights, index rows made before the capture),
  and writes nothing: an earlier kernel may still read the memory its outputs get (a captured step's pool reuses
  freed buffers);
- it calls it before it ends, so its completion implies its predecessor's, and a kernel after it that waits for it
  waits, transitively, for every kernel before.
A kernel of another library after one of ours launches normally (after ours has finished); one of ours after a
kernel that never signals early starts when that kernel ends, as without PDL.

Imported only for CUDA tensors (by the other Triton modules), since importing triton needs a GPU driver.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("programmatic dependent launch needs triton (a CUDA machine)") from error

PDL_DEVICE_TYPES = ("cuda",)  # (emptied: every kernel launched plainly; benchmarks/profile_decode_step.py --ab pdl)


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    """Waits until the kernel ahead in the stream has finished (its writes visible), then lets the next kernel start
    its launch (see the module docstring); nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(device: torch.device) -> bool:
    """Hopper (compute capability 9.0) and later, a triton with grid dependency control, not its interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def dependent_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel that calls `await_previous_kernel`: PDL on where the device supports it and
    `PDL_DEVICE_TYPES` allows it, else off."""
    on = device.type in PDL_DEVICE_TYPES and device.type == "cuda" and _supported(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
