"""Counts the device kernels of one batch-1 decoding step on the CPU, as the CUDA path would launch them: fla's ops
are stood in by this package's torch kernels and counted as one launch each (plus one copy per non-contiguous tensor
fla's `input_guard` would make contiguous first), every other non-view aten op as one. A quick, GPU-free check of the
per-token kernel count that sets CUDA-graph decoding speed (see profile_gpu.py; on a GPU, bench_generation.py counts
the kernels of a replayed step with torch.profiler).

By default it counts what `generate(..., cache_implementation="static")` runs per token on a GPU: the step captured in
the CUDA graph (`HybridLinearModel.decode_step` and the LM head, through `CudaGraphDecoder`), and, separately, the
few kernels `CudaGraphDecoder.step` launches around each replay (inputs copied into the graph's buffers, the logits
copied out). `--eager` counts the uncaptured one-token forward instead (a dynamic cache, or the graph turned off).
`--verify K` counts a speculative verify round of K tokens (speculative_decoding.verify_round: the forward of K
tokens, the acceptance and the restore of every layer; the ops `CapturedVerifyRound` captures), beside the captured
step: at a few microseconds a kernel, what a round's count adds over the step's is most of its extra time.

    python benchmarks/count_decode_ops.py [--model gdn|kda|kimi|qwen3-next-fp8] [--eager] [--by-site] [--verify 4]
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).parent))
from flagship_models import ours_config, qwen3_next_fields
from model_configs import GPU_GDN, GPU_KDA, gdn_pair, kda_pair, kimi_linear_config  # noqa: E402

from hybrid_linear_models import HybridLinearForCausalLM, fla_backend  # noqa: E402
from hybrid_linear_models import attention_step, block_ops, kernels_conv, kernels_delta_rule, ops  # noqa: E402
from hybrid_linear_models import experts_routed, kernels_fp8, moe_inference_ops
from hybrid_linear_models.cuda_graph_decoding import CudaGraphDecoder  # noqa: E402
from hybrid_linear_models.speculative_decoding import prefill, verify_round  # noqa: E402
from hybrid_linear_models.verify_cache import VerifyCache  # noqa: E402

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "_local_scalar_dense", "set_", "resize_", "_unsafe_view", "promote_types", "scalar_tensor"}


class KernelCounter(TorchDispatchMode):
    """Counts kernels by aten op (and, with `by_site`, by the line of this package or transformers that ran it)."""

    def __init__(self, by_site: bool = False):
        super().__init__()
        self.counts = collections.Counter()
        self.sites = collections.Counter()
        self.by_site = by_site
        self.paused = 0

    def count(self, name: str) -> None:
        self.counts[name] += 1
        if self.by_site:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "hybrid_linear_models" in f.filename or "/transformers/" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.sites[(name, where)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in NO_KERNEL:
            self.count(name)
        return func(*args, **(kwargs or {}))


COUNTER: KernelCounter | None = None


# fla's ops that take strided rows as they are (no input_guard copy): swiglu, and the conv update's x
STRIDED_OK = {"swiglu": None, "causal_conv1d_update": 0}


def _counted_reference(name: str, reference):
    """One of this package's Triton kernels, counted as one launch, its output the torch reference's."""
    def run(*args, **kwargs):
        COUNTER.count(name)
        COUNTER.paused += 1
        try:
            return reference(*args, **kwargs)
        finally:
            COUNTER.paused -= 1
    return run


def _fused(name, fn):
    """fla's kernel `name`, counted as one launch (plus the copies its input_guard makes), run as `fn`."""
    kernel = _counted_reference(f"fla.{name}", fn)

    def run(*args, **kwargs):
        ok = STRIDED_OK.get(name, -1)
        for i, arg in enumerate([*args, *kwargs.values()]):
            if isinstance(arg, torch.Tensor) and not arg.is_contiguous() and ok is not None and i != ok:
                COUNTER.count("fla.input_guard_copy")  # fla's input_guard: .contiguous() before the kernel
        return kernel(*args, **kwargs)
    return run


def _rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return block_ops.rms_norm(x, weight, eps, residual=residual)  # (normed, sum) with a residual: prenorm


def _rule(per_channel):
    def rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens=None,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, **_):
        if use_beta_sigmoid_in_kernel:
            beta = beta.sigmoid()
        if use_gate_in_kernel:
            g = ops.gate_log_decay(g, A_log, dt_bias)
        return kernels_delta_rule.recurrent_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       use_qk_l2norm_in_kernel)
    return rule


def _conv(x, weight, activation=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    state = initial_state[..., 1:] if initial_state is not None else None
    out, final = kernels_conv.causal_conv1d_torch(x, weight, activation, state, output_final_state, cu_seqlens)
    return out, (torch.nn.functional.pad(final, (1, 0)) if final is not None else None)


def _in_place(per_channel):
    """fla's recurrent kernel run with the state in place (recurrent_in_place.py), as the torch rule plus copies
    into the output and the state: counted as one kernel."""
    def run(q, k, v, g, beta, scale, state, use_qk_l2norm, A_log, dt_bias, beta_logits, out):
        COUNTER.count("fla.fused_recurrent_kda (state in place)" if per_channel
                      else "fla.fused_recurrent_gated_delta_rule (state in place)")
        COUNTER.paused += 1
        try:
            o, final = _rule(per_channel)(q, k, v, g, beta, scale, state, True, use_qk_l2norm,
                                          use_gate_in_kernel=A_log is not None, A_log=A_log, dt_bias=dt_bias,
                                          use_beta_sigmoid_in_kernel=beta_logits)
            state.copy_(final)
            return out.copy_(o) if out is not None else o
        finally:
            COUNTER.paused -= 1
    return run


class _RecurrentKernel:
    """fla's GDN recurrent Triton kernel as `recurrent_in_place` launches it: kernel[grid](...)."""

    def __getitem__(self, grid):
        def launch(q, k, v, g, beta, A_log, dt_bias, o, h0, scale, USE_QK_L2NORM_IN_KERNEL, APPLY_BETA_SIGMOID,
                   **_):
            _in_place(False)(q, k, v, g, beta, scale, h0, USE_QK_L2NORM_IN_KERNEL, A_log, dt_bias, APPLY_BETA_SIGMOID,
                             o)
        return launch


def _kda_in_place(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, use_qk_l2norm_in_kernel,
                  use_beta_sigmoid_in_kernel, **_):
    return _in_place(True)(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, A_log, dt_bias,
                           use_beta_sigmoid_in_kernel, None), initial_state


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
    # (a prompt's chunked rules, counted as one kernel each; their presence is what says the rules go to fla)
    chunk_gated_delta_rule=_fused("chunk_gated_delta_rule", _rule(False)),
    chunk_kda=_fused("chunk_kda", _rule(True)),
    fused_recurrent_gated_delta_rule_fwd_kernel=_RecurrentKernel(),
    fused_recurrent_kda_fwd=_kda_in_place,
)


def _attention_step(qkv, keys, values, slot, q_scale, k_scale, eps, cos, sin, rotary, mask, scale, heads, gate):
    """The fused attention step's three kernels (attention_step.py), counted; its output stood in by zeros (the count
    does not depend on the values)."""
    for kernel in ("prepare", "attend", "combine"):
        COUNTER.count(f"attention_step.{kernel}")
    COUNTER.paused += 1
    try:
        return qkv.new_zeros(qkv.shape[0], heads * keys.shape[-1])
    finally:
        COUNTER.paused -= 1


def _counted_zeros(name: str, rows_of, width_of):
    """One of this package's Triton kernels, counted as one launch; its output stood in by zeros of its shape."""
    return _counted_reference(name, lambda *args, **kwargs: args[0].new_zeros(rows_of(*args, **kwargs),
                                                                              width_of(*args, **kwargs)))


def _moe_reference(reference):
    """A moe_inference_ops function's torch path (`reference` of the kernel's arguments), its kernels turned off
    while it runs."""
    def run(*args):
        previous, moe_inference_ops.MOE_DEVICE_TYPES = moe_inference_ops.MOE_DEVICE_TYPES, ()
        try:
            return reference(*args)
        finally:
            moe_inference_ops.MOE_DEVICE_TYPES = previous
    return run


# this package's FP8 and MoE Triton kernels, as their dispatch reaches them (module, attribute, stand-in)
KERNEL_STAND_INS = [
    (kernels_fp8, "fp8_linear_kernel", _counted_zeros("fp8.linear", lambda x, *a, **k: x.shape[0],
                                                      lambda x, w, *a, **k: w.shape[-2])),
    (kernels_fp8, "fp8_routed_linear_kernel",
     _counted_zeros("fp8.routed_linear", lambda x, w, s, r, *a, **k: r.shape[0], lambda x, w, *a, **k: w.shape[-2])),
    (kernels_fp8, "fp8_grouped_linear_kernel", _counted_zeros("fp8.grouped_linear", lambda x, *a, **k: x.shape[0],
                                                              lambda x, w, *a, **k: w.shape[-2])),
    (experts_routed, "routed_experts_kernel", _counted_zeros("experts.routed", lambda x, w, r, *a, **k: r.shape[0],
                                                            lambda x, w, *a, **k: w.shape[-2])),
    (moe_inference_ops, "triton_route_top_k_kernel",
     _counted_reference("moe.route_top_k", _moe_reference(
         lambda logits, k, sigmoid, normalize, bias, eps, scale: moe_inference_ops.route_top_k(
             logits, k, sigmoid=sigmoid, normalize=normalize, bias=bias, eps=eps, scale=scale)))),
    (moe_inference_ops, "triton_add_gated_kernel",
     _counted_reference("moe.add_gated", _moe_reference(moe_inference_ops.add_gated))),
]
# their dispatch's device types, with the CPU added while counting
KERNEL_DEVICE_SWITCHES = [(kernels_fp8, "KERNEL_DEVICE_TYPES"), (kernels_fp8, "SWIGLU_INPUT_DEVICE_TYPES"),
                          (moe_inference_ops, "MOE_DEVICE_TYPES"), (experts_routed, "ROUTED_DEVICE_TYPES")]


MODELS = {  # the GPU benchmark models' layer structure at narrow widths (the kernel count does not depend on them)
    "gdn": lambda: gdn_pair(**dict(GPU_GDN, hidden=256, intermediate=512, vocab=1000))[0],
    "kda": lambda: kda_pair(**dict(GPU_KDA, hidden=256, intermediate=512, vocab=1000))[0],
    "kimi": lambda: kimi_linear_config(hidden=256, vocab=1000, dense_width=512, expert_width=64, kda_dim=32, kda_heads=4,
                                       mla_heads=4, kv_lora_rank=64, qk_nope=32, qk_rope=16, v_dim=32),
    # Qwen3-Next-80B-A3B's released FP8 layout in miniature, its first period of layers (3 GDN, 1 gated attention)
    "qwen3-next-fp8": lambda: ours_config(qwen3_next_fields(layers=4, tiny=True, fp8=True)),
}


def _model(kind: str):
    torch.manual_seed(0)
    return HybridLinearForCausalLM(MODELS[kind]()).to(torch.bfloat16).eval()  # the GPU benchmarks' dtype


def count_step(kind: str = "gdn", eager: bool = False, by_site: bool = False) -> dict[str, KernelCounter]:
    """The kernels of one batch-1 decoding step after an 8-token prompt: {"step": ...} eagerly, or {"graph": the
    captured step, "around": around each replay} (see the module docstring)."""
    global COUNTER
    model = _model(kind)
    config = model.config
    ids = torch.randint(1, config.vocab_size, (1, 9))
    cache = StaticCache(config=config, max_cache_len=16)
    counted: dict[str, KernelCounter] = {}
    previous = fla_backend.fla_for, CudaGraphDecoder.device_types, CudaGraphDecoder._record
    step_previous = attention_step.STEP_DEVICE_TYPES, attention_step.attention_step_kernel
    kernels_previous = [(module, name, getattr(module, name)) for module, name, _ in KERNEL_STAND_INS]
    switches_previous = [(module, name, getattr(module, name)) for module, name in KERNEL_DEVICE_SWITCHES]

    def record(run, device, reset, pool=None):  # the capture: a warm-up run (as on the GPU: kept tensors built), then one counted
        global COUNTER
        run()
        reset()
        COUNTER = counted["graph"] = KernelCounter(by_site)
        with COUNTER:
            out = run()
        COUNTER = KernelCounter(by_site)  # the capture's own restoring copies are not per-token work
        return SimpleNamespace(replay=lambda: None, expired=False), out

    try:
        with torch.no_grad():
            model(input_ids=ids[:, :8], cache=cache, use_cache=True)
            # from here on every op takes the fla path; inside a stand-in, the torch path; this package's FP8 and MoE
            # kernels are counted where their dispatch takes them
            fla_backend.fla_for = lambda tensor: None if COUNTER.paused else STAND_INS
            for module, name, stand_in in KERNEL_STAND_INS:
                setattr(module, name, lambda stand_in=stand_in: stand_in)
            for module, name in KERNEL_DEVICE_SWITCHES:
                setattr(module, name, (*getattr(module, name), "cpu"))
            COUNTER = KernelCounter(by_site)
            if eager:
                model.set_cuda_graph_decoding(False)
                model(input_ids=ids[:, 8:], cache=cache, use_cache=True)  # a warm-up step: kept tensors built
                COUNTER = counted["step"] = KernelCounter(by_site)
                with COUNTER:
                    model(input_ids=ids[:, 8:], cache=cache, use_cache=True)
            else:
                CudaGraphDecoder.device_types = ("cuda", "cpu")
                CudaGraphDecoder._record = staticmethod(record)
                attention_step.STEP_DEVICE_TYPES = ("cuda", "cpu")  # the full-attention layers as three kernels
                attention_step.attention_step_kernel = lambda: _attention_step
                model(input_ids=ids[:, 8:], cache=cache, use_cache=True)  # captured (counted), not replayed
                COUNTER = counted["around"] = KernelCounter(by_site)
                with COUNTER:
                    model(input_ids=ids[:, 8:], cache=cache, use_cache=True)
    finally:
        fla_backend.fla_for, CudaGraphDecoder.device_types = previous[:2]
        CudaGraphDecoder._record = staticmethod(previous[2])
        attention_step.STEP_DEVICE_TYPES, attention_step.attention_step_kernel = step_previous
        for module, name, value in kernels_previous + switches_previous:
            setattr(module, name, value)
    return counted


def count_verify_round(kind: str = "gdn", width: int = 4, by_site: bool = False) -> KernelCounter:
    """The kernels of one batch-1 verify round of `width` tokens (one draft kept, as random drafts mostly are) after
    an 8-token prompt, on a VerifyCache, fla's ops stood in as for the step (a warm-up round first: kept tensors
    built)."""
    global COUNTER
    model = _model(kind)
    ids = torch.randint(1, 1000, (1, 8))
    previous = fla_backend.fla_for
    try:
        with torch.no_grad():
            cache = VerifyCache(model, 1, 8 + 4 * width, torch.device("cpu"))
            first = prefill(model, cache, ids, None)
            drafts = torch.cat([first[:, None], torch.randint(0, 1000, (1, width - 1))], dim=1)
            live = torch.ones(1, dtype=torch.bool)
            COUNTER = KernelCounter(by_site)
            fla_backend.fla_for = lambda tensor: None if COUNTER.paused else STAND_INS
            verify_round(model, cache, drafts, live)
            COUNTER = counted = KernelCounter(by_site)
            with COUNTER:
                verify_round(model, cache, drafts, live)
    finally:
        fla_backend.fla_for = previous
    return counted


def _show(label: str, counter: KernelCounter) -> None:
    print(f"  {label}: {sum(counter.counts.values())}")
    for name, n in counter.counts.most_common():
        print(f"    {n:5d} {name}")
    for (name, where), n in sorted(counter.sites.items(), key=lambda item: -item[1]):
        print(f"    {n:5d} {name:32s} {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="gdn")
    parser.add_argument("--kda", action="store_true", help="--model kda")
    parser.add_argument("--eager", action="store_true", help="the uncaptured one-token forward")
    parser.add_argument("--by-site", action="store_true", help="also list kernels by source line")
    parser.add_argument("--verify", type=int, default=0, metavar="K",
                        help="instead: a verify round of K tokens beside the captured step")
    args = parser.parse_args()
    kind = "kda" if args.kda else args.model
    if args.verify:
        step = sum(count_step(kind)["graph"].counts.values())
        round_ = count_verify_round(kind, args.verify, args.by_site)
        print(f"{kind}: {sum(round_.counts.values())} kernels in a verify round of {args.verify} tokens, "
              f"{step} in the captured decoding step")
        _show(f"verify round of {args.verify}", round_)
        return
    counted = count_step(kind, args.eager, args.by_site)
    layers = len(MODELS[kind]().layer_types)
    if args.eager:
        print(f"{kind}: {sum(counted['step'].counts.values())} kernels per eager decoding step ({layers} layers)")
        _show("eager step", counted["step"])
    else:
        graph, around = (sum(counted[k].counts.values()) for k in ("graph", "around"))
        print(f"{kind}: {graph} kernels in the captured decoding step + {around} around each replay ({layers} layers)")
        _show("captured step", counted["graph"])
        _show("around the replay", counted["around"])


if __name__ == "__main__":
    main()
