"""Counts the device kernels of one eager batch-1 decoding step on the CPU, as the CUDA path would launch them: fla's
ops are stood in by this package's torch kernels and counted as one launch each, every other non-view aten op as one.
A quick, GPU-free check of the per-token kernel count that sets CUDA-graph decoding speed (see profile_gpu.py).

    python benchmarks/count_decode_ops.py [--kda]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).parent))
from model_configs import GPU_GDN, GPU_KDA, gdn_pair, kda_pair  # noqa: E402

from hybrid_linear_models import HybridLinearForCausalLM, fla_backend  # noqa: E402
from hybrid_linear_models import block_ops, kernels_conv, kernels_delta_rule, ops  # noqa: E402

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "_local_scalar_dense", "set_", "resize_", "_unsafe_view", "promote_types", "scalar_tensor"}


class KernelCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


COUNTER: KernelCounter | None = None


def _fused(name, fn):
    def run(*args, **kwargs):
        COUNTER.counts[f"fla.{name}"] += 1
        COUNTER.paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            COUNTER.paused -= 1
    return run


def _rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return block_ops.rms_norm(x, weight, eps, residual=residual)  # (normed, sum) with a residual: prenorm


def _rule(per_channel):
    def rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens=None,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, **_):
        if use_gate_in_kernel:
            g = ops.gate_log_decay(g, A_log, dt_bias)
        return kernels_delta_rule.recurrent_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       use_qk_l2norm_in_kernel)
    return rule


def _conv(x, weight, activation=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    state = initial_state[..., 1:] if initial_state is not None else None
    out, final = kernels_conv.causal_conv1d_torch(x, weight, activation, state, output_final_state, cu_seqlens)
    return out, (torch.nn.functional.pad(final, (1, 0)) if final is not None else None)


STAND_INS = SimpleNamespace(
    rms_norm=_fused("rms_norm", _rms_norm),
    rms_norm_gated=_fused("rms_norm_gated", lambda x, g, w, b, activation, eps: ops.gated_rms_norm(
        x, g, w, eps=eps, activation=activation)),
    swiglu=_fused("swiglu", lambda a, b: torch.nn.functional.silu(a) * b),
    causal_conv1d=_fused("causal_conv1d", _conv),
    causal_conv1d_update=_fused("causal_conv1d_update", lambda x, cache, weight, activation: (
        ops.causal_conv1d_step(x, weight, cache, activation=activation), cache)),
    fused_recurrent_gated_delta_rule=_fused("fused_recurrent_gated_delta_rule", _rule(False)),
    fused_recurrent_kda=_fused("fused_recurrent_kda", _rule(True)),
)


def main() -> None:
    global COUNTER
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kda", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    dims = dict(GPU_KDA if args.kda else GPU_GDN, hidden=256, intermediate=512, vocab=1000)
    config = (kda_pair if args.kda else gdn_pair)(**dims)[0]
    model = HybridLinearForCausalLM(config).to(torch.bfloat16).eval()  # the GPU benchmarks' dtype
    ids = torch.randint(1, 1000, (1, 8))
    cache = StaticCache(config=config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        # every op now takes the fla path; inside a stand-in, the torch path
        fla_backend.fla_for = lambda tensor: None if COUNTER.paused else STAND_INS
        COUNTER = KernelCounter()
        with COUNTER:
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
    counts = COUNTER.counts
    print(f"{'kda' if args.kda else 'gdn'}: {sum(counts.values())} kernels per decoding step "
          f"({config.num_hidden_layers} layers)")
    for name, n in counts.most_common():
        print(f"  {n:5d} {name}")


if __name__ == "__main__":
    main()
