"""Side-by-side timing of this package's delta-rule kernels against transformers' own torch paths (and, with --gpu,
against fla's Triton kernels called directly).

    python benchmarks/bench_delta_rule.py            # CPU, 2 threads, float32, forward + backward (about 1-2 min)
    python benchmarks/bench_delta_rule.py --gpu      # CUDA, bf16, 64k tokens: fla directly vs our ops dispatch
    python benchmarks/bench_delta_rule.py --tiny     # CPU smoke test: T=128, one repetition of each, GDN's memory

CPU comparison (B=1, T=2048 or `--length`, float32, forward + backward of the output):
- GDN, 4 key heads / 8 value heads of 64: `hybrid_linear_models.ops.gated_delta_rule` vs transformers'
  `qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule` (undecorated, use_qk_l2norm_in_kernel=True).
- KDA, 8 heads of 64: `ops.kimi_delta_rule` vs `kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention`
  (undecorated; about 6 s per forward + backward, so it runs only twice).
Repetitions of ours and theirs are interleaved after a warm-up; the table gives the median of each, the ratio
theirs / ours, and each side's peak memory: the growth of the process's peak RSS over one forward + backward, measured
in a fresh subprocess per side (an RSS peak cannot be reset within a process).

Gates are realistic, drawn the way fla's GatedDeltaNet / KDA layers initialise them: A = uniform(1, 16) per head,
dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (per head for GDN, per channel for KDA), and
g = -A * softplus(a + dt_bias) with a ~ N(0, 0.5^2) standing for the projection output. That gives g in about
[-1, -1e-3], median ~-0.02 per token. beta = sigmoid(randn); q, k, v = randn.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

CPU_THREADS = 2


def undecorated(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def realistic_gates(B, T, H, d, per_channel, generator, device="cpu"):
    """beta, g as fla's layers produce them at initialisation (see the module docstring)."""
    A = torch.empty(H, device=device).uniform_(1.0, 16.0, generator=generator)
    dt_shape = (H, d) if per_channel else (H,)
    dt = torch.exp(torch.empty(dt_shape, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=generator))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    a_shape = (B, T, H, d) if per_channel else (B, T, H)
    a = torch.randn(a_shape, generator=generator, device=device) * 0.5
    A = A[:, None] if per_channel else A
    g = -A * F.softplus(a + dt_bias)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=generator, device=device))
    return g, beta


# --------------------------------------------------------------------------------------------------------- CPU


def cpu_problem(kind, length, seed=0):
    """Inputs (leaves requiring grad) and the output gradient for one CPU case of `length` tokens."""
    gen = torch.Generator().manual_seed(seed)
    B, T, d = 1, length, 64
    Hk, Hv = (4, 8) if kind == "gdn" else (8, 8)
    q = torch.randn(B, T, Hk, d, generator=gen)
    k = torch.randn(B, T, Hk, d, generator=gen)
    v = torch.randn(B, T, Hv, d, generator=gen)
    g, beta = realistic_gates(B, T, Hv, d, kind == "kda", gen)
    d_out = torch.randn(B, T, Hv, d, generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    return leaves, d_out


def cpu_functions(kind):
    """(ours, theirs): each maps (q, k, v, g, beta) to the output."""
    from hybrid_linear_models import ops

    if kind == "gdn":
        from transformers.models.qwen3_next import modeling_qwen3_next

        theirs_fn = undecorated(modeling_qwen3_next.torch_chunk_gated_delta_rule)
        ours_fn = ops.gated_delta_rule
    else:
        from transformers.models.kimi_linear import modeling_kimi_linear

        theirs_fn = undecorated(modeling_kimi_linear.chunk_kimi_delta_attention)
        ours_fn = ops.kimi_delta_rule

    def ours(q, k, v, g, beta):
        return ours_fn(q, k, v, g, beta, use_qk_l2norm=True)[0]

    def theirs(q, k, v, g, beta):
        return theirs_fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    return ours, theirs


def fwd_bwd(fn, leaves, d_out):
    for x in leaves:
        x.grad = None
    out = fn(*leaves)
    out.backward(d_out)
    return out


def timed(fn, leaves, d_out):
    start = time.perf_counter()
    fwd_bwd(fn, leaves, d_out)
    return (time.perf_counter() - start) * 1e3


def _own_peak_rss_kb():
    """This process image's own RSS high-water mark (VmHWM, kB), or None off Linux."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def measure_memory(kind, side, length):
    """Child process: print the growth of peak RSS (MB) over one forward + backward.

    Linux carries a parent's peak RSS into ru_maxrss across fork + exec, so the parent starts these children before
    it grows (see run_cpu); a child that still finds its ru_maxrss above its own high-water mark says so."""
    torch.set_num_threads(CPU_THREADS)
    ours, theirs = cpu_functions(kind)
    fn = ours if side == "ours" else theirs
    leaves, d_out = cpu_problem(kind, length)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    own = _own_peak_rss_kb()
    if own is not None and before > own + 1024:
        print(f"warning: ru_maxrss {before} kB was inherited from the parent (own peak {own} kB)", file=sys.stderr)
    fwd_bwd(fn, leaves, d_out)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{(after - before) / 1024:.1f}")


def memory_in_subprocess(kind, side, length):
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure-memory", kind, side,
                             "--length", str(length)],
                            capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def run_cpu(args):
    torch.set_num_threads(CPU_THREADS)
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, float32, forward + backward, B=1, T={args.length}")
    import transformers

    print(f"transformers {transformers.__version__}")
    cases = [
        ("GDN Hk=4 Hv=8 d=64", "gdn", args.reps, args.reps),
        ("KDA H=8 d=64", "kda", args.reps, args.kda_reps),
    ]
    # Peak memory first, while this process is still small: its own peak RSS would otherwise be inherited by the
    # children's ru_maxrss and hide their growth.
    memory = {}
    if not args.no_memory:
        print("measuring peak memory in fresh subprocesses ...", flush=True)
        # --tiny: the GDN case's pair alone (each subprocess is a few seconds of imports; the KDA row prints "-")
        for _, kind, _, _ in cases[:1] if args.tiny else cases:
            memory[kind] = (memory_in_subprocess(kind, "ours", args.length),
                            memory_in_subprocess(kind, "theirs", args.length))
    rows = []
    for label, kind, reps_ours, reps_theirs in cases:
        ours, theirs = cpu_functions(kind)
        leaves, d_out = cpu_problem(kind, args.length)
        g = leaves[3].detach()
        print(f"\n{label}: g in [{g.min():.3g}, {g.max():.3g}], median {g.median():.3g}", flush=True)
        # agreement first (also warms both up)
        out_ours = fwd_bwd(ours, leaves, d_out).detach()
        grads_ours = [x.grad.clone() for x in leaves]
        out_theirs = fwd_bwd(theirs, leaves, d_out).detach()
        grads_theirs = [x.grad.clone() for x in leaves]
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        print(f"  max |ours - theirs| / max |theirs|: output {rel(out_ours, out_theirs):.1e}, gradients "
              + ", ".join(f"d{n} {rel(a, b):.1e}" for n, a, b in zip("qkvgb", grads_ours, grads_theirs)))
        for _ in range(args.warmup - 1):
            fwd_bwd(ours, leaves, d_out)
        times_ours, times_theirs = [], []
        for i in range(max(reps_ours, reps_theirs)):  # interleaved
            if i < reps_ours:
                times_ours.append(timed(ours, leaves, d_out))
            if i < reps_theirs:
                times_theirs.append(timed(theirs, leaves, d_out))
        print(f"  ours   ms: {' '.join(f'{t:.0f}' for t in times_ours)}")
        print(f"  theirs ms: {' '.join(f'{t:.0f}' for t in times_theirs)}", flush=True)
        rows.append((label, times_ours, times_theirs, *memory.get(kind, (None, None))))

    print("\nforward + backward, CPU float32, 2 threads (median of the interleaved runs; peak memory = growth of "
          "peak RSS over one fwd+bwd, fresh process each)")
    header = (f"{'case':<20} {'ours ms':>9} {'(min)':>7} {'n':>3} {'theirs ms':>10} {'(min)':>8} {'n':>3} "
              f"{'theirs/ours':>12} {'ours MB':>8} {'theirs MB':>10}")
    print(header)
    print("-" * len(header))
    for label, t_ours, t_theirs, m_ours, m_theirs in rows:
        med_ours, med_theirs = statistics.median(t_ours), statistics.median(t_theirs)
        mem = f"{m_ours:>8.0f} {m_theirs:>10.0f}" if m_ours is not None else f"{'-':>8} {'-':>10}"
        print(f"{label:<20} {med_ours:>9.1f} {min(t_ours):>7.1f} {len(t_ours):>3} {med_theirs:>10.1f} "
              f"{min(t_theirs):>8.1f} {len(t_theirs):>3} {med_theirs / med_ours:>11.1f}x {mem}")
    print("theirs: transformers' torch_chunk_gated_delta_rule (Qwen3-Next) / chunk_kimi_delta_attention (Kimi-Linear)")


# --------------------------------------------------------------------------------------------------------- GPU


def run_gpu(args):
    if not torch.cuda.is_available():
        print("GPU comparison skipped: CUDA is not available.")
        return
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as error:  # ImportError, or triton failing to start
        print(f"GPU comparison skipped: flash-linear-attention is not importable ({error!r}).")
        return
    from hybrid_linear_models import ops

    import fla

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, fla {getattr(fla, '__version__', '?')}, "
          f"bf16, forward + backward, B=16, T=4096 (64k tokens)")
    dev = "cuda"
    B, T, d = 16, 4096, 128

    def fla_gdn(q, k, v, g, beta):
        return chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, scale=d**-0.5, initial_state=None,
                                      output_final_state=False, use_qk_l2norm_in_kernel=True)[0]

    def fla_kda(q, k, v, g, beta):
        return chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=d**-0.5, initial_state=None,
                         output_final_state=False, use_qk_l2norm_in_kernel=True)[0]

    cases = [
        ("GDN Hk=16 Hv=32 d=128", 16, 32, False, fla_gdn, lambda *x: ops.gated_delta_rule(*x)[0]),
        ("KDA H=32 d=128", 32, 32, True, fla_kda, lambda *x: ops.kimi_delta_rule(*x)[0]),
    ]
    rows = []
    for label, Hk, Hv, per_channel, theirs, ours in cases:
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k = (torch.randn(B, T, Hk, d, generator=gen, device=dev).bfloat16() for _ in range(2))
        v = torch.randn(B, T, Hv, d, generator=gen, device=dev).bfloat16()
        g, beta = realistic_gates(B, T, Hv, d, per_channel, gen, device=dev)
        leaves = [x.requires_grad_() for x in (q, k, v, g.float(), beta.bfloat16())]
        d_out = torch.randn(B, T, Hv, d, generator=gen, device=dev).bfloat16()
        print(f"\n{label}: warming up (fla autotunes on first use) ...", flush=True)
        start = time.perf_counter()
        for _ in range(args.gpu_warmup):
            fwd_bwd(theirs, leaves, d_out)
            fwd_bwd(ours, leaves, d_out)
        torch.cuda.synchronize()
        print(f"  warm-up {time.perf_counter() - start:.1f} s", flush=True)
        times = {"fla": [], "ours": []}
        peak = {}
        for i in range(args.gpu_reps):
            for name, fn in (("fla", theirs), ("ours", ours)):
                if i == 0:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                begin.record()
                fwd_bwd(fn, leaves, d_out)
                end.record()
                torch.cuda.synchronize()
                times[name].append(begin.elapsed_time(end))
                if i == 0:
                    peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        t_fla, t_ours = statistics.median(times["fla"]), statistics.median(times["ours"])
        rows.append((label, t_fla, t_ours, 100 * (t_ours - t_fla) / t_fla, peak["fla"], peak["ours"]))

    print(f"\nforward + backward, bf16, 64k tokens, median of {args.gpu_reps} interleaved runs")
    header = f"{'case':<22} {'fla ms':>8} {'ours ms':>8} {'overhead':>9} {'fla MB':>8} {'ours MB':>8}"
    print(header)
    print("-" * len(header))
    for label, t_fla, t_ours, overhead, m_fla, m_ours in rows:
        print(f"{label:<22} {t_fla:>8.2f} {t_ours:>8.2f} {overhead:>8.1f}% {m_fla:>8.0f} {m_ours:>8.0f}")
    print("fla: chunk_gated_delta_rule / chunk_kda called directly; ours: hybrid_linear_models.ops on the same tensors")


# -------------------------------------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="run the CUDA comparison (fla vs ops) instead of the CPU one")
    parser.add_argument("--reps", type=int, default=15, help="timed CPU repetitions per side (GDN, and ours for KDA)")
    parser.add_argument("--kda-reps", type=int, default=2, help="timed repetitions of transformers' slow KDA")
    parser.add_argument("--warmup", type=int, default=2, help="CPU warm-up runs of ours (theirs: one)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--gpu-reps", type=int, default=20)
    parser.add_argument("--gpu-warmup", type=int, default=3)
    parser.add_argument("--length", type=int, default=2048, help="CPU: tokens (T) of each case")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke test: T=128, one repetition of each, the peak memory of GDN alone")
    parser.add_argument("--measure-memory", nargs=2, metavar=("KIND", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.length, args.reps, args.kda_reps, args.warmup = 128, 1, 1, 1
    if args.measure_memory:
        measure_memory(*args.measure_memory, args.length)
        return
    print("$ " + shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])), flush=True)
    if args.gpu:
        run_gpu(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
