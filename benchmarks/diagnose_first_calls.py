"""What a first call at a new prompt length pays for, and where: one process, lengths it has never seen.

For each prompt length (each new to the process) it times `generate(max_new_tokens=1)` and a second decoding token,
with generate's default cache (static on CUDA with graph decoding on), `cache_implementation="static"` and
`cache_implementation="dynamic"` (`--caches`), then the same call again (the warm time
at that length), and counts what ran during the call:
- Triton compilations: new entries in the Triton cache folder (`TRITON_CACHE_DIR`; a kernel compiled for a new
  specialisation: a new constexpr or a new divisibility of an integer argument) and new autotuning records
  (`*.autotune.json`, written with `TRITON_CACHE_AUTOTUNING=1`: a kernel tuned for a new key);
- CUDA graph captures, with the seconds spent between each capture's begin and end;
- the seconds spent in this package's graph decoder and graph prefill captures (their `_capture` methods).
The difference between first and warm is the stall; the counts say what it is made of.

    python benchmarks/diagnose_first_calls.py [--device cuda] [--model gdn|kda|qwen3-next-fp8|kimi-linear]
        [--lengths 1000 1537 3000 ...]
        [--caches default static dynamic] [--new-tokens 2] [--batch 1] [--package-warm-up MAX_LENGTH]
        [--prompt-graphs] [--tiny]

`--package-warm-up MAX_LENGTH` calls `model.warm_up(max_batch_size=--batch, max_length=MAX_LENGTH)` first: the rows
then say what a first call still pays after it. `--prompt-graphs` turns the captured prompts on
(`model.set_cuda_graph_decoding(True, prompts=True)`: static caches' prompts of up to 4,096 tokens replayed from
graphs, which `warm_up` captures).

`--tiny` (CPU, a tiny model, a few short lengths) is the configuration CI runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


FLAGSHIPS = ("qwen3-next-fp8", "kimi-linear")  # the released flagships at full size (flagship_models.py)


def flagship_fields(name: str, tiny: bool) -> dict:
    from flagship_models import kimi_linear_fields, qwen3_next_fields

    return qwen3_next_fields(tiny=tiny, fp8=True) if name == "qwen3-next-fp8" else kimi_linear_fields(tiny=tiny)


class Counters:
    """Counts captures and the time inside them, by patching the capture entry points for the script's lifetime."""

    def __init__(self) -> None:
        self.captures = 0
        self.capture_seconds = 0.0
        self.package_capture_seconds = 0.0

    def install(self) -> None:
        import torch

        from hybrid_linear_models import cuda_graph_decoding, cuda_graph_prefill

        graph = torch.cuda.CUDAGraph
        begin, end = graph.capture_begin, graph.capture_end
        counters = self

        def capture_begin(self, *args, **kwargs):
            self._diagnose_start = time.perf_counter()
            return begin(self, *args, **kwargs)

        def capture_end(self, *args, **kwargs):
            result = end(self, *args, **kwargs)
            counters.captures += 1
            counters.capture_seconds += time.perf_counter() - getattr(self, "_diagnose_start", time.perf_counter())
            return result

        graph.capture_begin, graph.capture_end = capture_begin, capture_end
        for owner in (cuda_graph_decoding.CudaGraphDecoder, getattr(cuda_graph_prefill, "CudaGraphPrefill", None)):
            if owner is not None and hasattr(owner, "_capture"):
                owner._capture = self._timed(owner._capture)

    def _timed(self, method):
        counters = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                counters.package_capture_seconds += time.perf_counter() - start

        return timed

    def snapshot(self) -> tuple[int, float, float]:
        return self.captures, self.capture_seconds, self.package_capture_seconds


def triton_cache_entries(folder: Path) -> tuple[int, int]:
    """(compiled kernels, autotuning records) in the Triton cache folder."""
    if not folder.is_dir():
        return 0, 0
    kernels = sum(1 for entry in folder.iterdir() if entry.is_dir())
    tunings = sum(1 for _ in folder.rglob("*.autotune.json"))
    return kernels, tunings


@contextmanager
def measured(device, counters: Counters, cache_dir: Path, row: dict, prefix: str):
    import torch

    kernels, tunings = triton_cache_entries(cache_dir)
    captures, capture_s, package_s = counters.snapshot()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    row[prefix + "s"] = time.perf_counter() - start
    new_kernels, new_tunings = triton_cache_entries(cache_dir)
    new_captures, new_capture_s, new_package_s = counters.snapshot()
    row[prefix + "compiled"] = new_kernels - kernels
    row[prefix + "tuned"] = new_tunings - tunings
    row[prefix + "captures"] = new_captures - captures
    row[prefix + "capture_s"] = new_capture_s - capture_s
    row[prefix + "package_capture_s"] = new_package_s - package_s


def build(name: str, tiny: bool, device, dtype, on_device: bool = False):
    import torch

    from hybrid_linear_models import HybridLinearForCausalLM
    from model_configs import GPU_GDN, GPU_KDA, TINY_GDN, TINY_KDA, gdn_pair, kda_pair

    torch.manual_seed(0)
    if name in FLAGSHIPS:  # (flagship_models: random weights drawn on the device, FP8 where the config says)
        from flagship_models import build_ours

        model = build_ours(flagship_fields(name, tiny), device, dtype)
        return model, model.config.vocab_size
    sizes = {"gdn": (gdn_pair, TINY_GDN, GPU_GDN), "kda": (kda_pair, TINY_KDA, GPU_KDA)}[name]
    config, _ = sizes[0](**(sizes[1] if tiny else sizes[2]))
    with torch.device(device if on_device else "cpu"):
        model = HybridLinearForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval(), config.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=("gdn", "kda", *FLAGSHIPS), default="gdn",
                        help="a benchmark model, or a released flagship at full size (random weights)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 1537, 3000, 7000, 16000])
    parser.add_argument("--caches", nargs="+", choices=("default", "static", "dynamic"),
                        default=["default", "dynamic"])
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--warmup-length", type=int, default=512,
                        help="one generate at this length first, as the issue's user does (0: none)")
    parser.add_argument("--package-warm-up", type=int, default=0, metavar="MAX_LENGTH",
                        help="call model.warm_up(max_batch_size=--batch, max_length=MAX_LENGTH) first (0: not)")
    parser.add_argument("--batch", type=int, default=1, help="rows per request")
    parser.add_argument("--prompt-graphs", action="store_true",
                        help="replay static caches' prompts from captured graphs (set_cuda_graph_decoding(prompts=))")
    parser.add_argument("--forward-lengths", type=int, nargs="*", default=[],
                        help="also time model(ids, use_cache=True, logits_to_keep=1) alone at these lengths")
    parser.add_argument("--no-counters", action="store_true", help="time only (no capture counting hooks)")
    parser.add_argument("--build-on-device", action="store_true",
                        help="construct the model under torch.device(--device) instead of on the CPU, then moving it")
    parser.add_argument("--tiny", action="store_true", help="CPU, a tiny model, short lengths (CI)")
    args = parser.parse_args()
    if args.tiny:
        args.device, args.lengths, args.warmup_length, args.forward_lengths = "cpu", [5, 17, 33], 8, [40]
        args.package_warm_up = args.package_warm_up and 64
    if "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    cache_dir = Path(os.environ["TRITON_CACHE_DIR"])

    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("diagnose_first_calls: --device cuda needs a CUDA device; use --tiny for the CPU run")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    counters = Counters()
    if device.type == "cuda" and not args.no_counters:
        counters.install()
    model, vocab = build(args.model, args.tiny, device, dtype, args.build_on_device)
    generator = torch.Generator().manual_seed(0)

    def generate(length: int, cache: str) -> None:
        ids = torch.randint(1, vocab, (args.batch, length), generator=generator).to(device)
        kwargs = {} if cache == "default" else {"cache_implementation": cache}
        with torch.no_grad():
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0, **kwargs)

    print(process_start(device, dtype), flush=True)
    if args.prompt_graphs:
        model.set_cuda_graph_decoding(True, prompts=True)
    if args.package_warm_up:
        model.warm_up(max_batch_size=args.batch, max_length=args.package_warm_up)
    if args.warmup_length:
        for cache in args.caches:
            generate(args.warmup_length, cache)
    print(f"model {args.model}, {args.device}, {dtype}, batch {args.batch}, {args.new_tokens} new tokens, prompt "
          f"graphs {'on' if args.prompt_graphs else 'off'}; Triton cache {cache_dir}")
    print(f"{'cache':>8} {'prompt':>7} | {'first s':>8} {'warm s':>7} {'ratio':>6} | {'compiled':>8} {'tuned':>5} "
          f"{'captures':>8} {'capture s':>9} {'pkg capture s':>13}")
    for length in args.lengths:
        for cache in args.caches:
            row: dict = {}
            with measured(device, counters, cache_dir, row, "first_"):
                generate(length, cache)
            with measured(device, counters, cache_dir, row, "warm_"):
                generate(length, cache)
            ratio = row["first_s"] / max(row["warm_s"], 1e-9)
            print(f"{cache:>8} {length:>7} | {row['first_s']:>8.3f} {row['warm_s']:>7.3f} {ratio:>6.2f} | "
                  f"{row['first_compiled']:>8} {row['first_tuned']:>5} {row['first_captures']:>8} "
                  f"{row['first_capture_s']:>9.3f} {row['first_package_capture_s']:>13.3f}", flush=True)
    for length in args.forward_lengths:
        ids = torch.randint(1, vocab, (1, length), generator=generator).to(device)
        row = {}
        for prefix in ("first_", "warm_"):
            with measured(device, counters, cache_dir, row, prefix), torch.no_grad():
                model(ids, use_cache=True, logits_to_keep=1)
        ratio = row["first_s"] / max(row["warm_s"], 1e-9)
        print(f"{'forward':>8} {length:>7} | {row['first_s']:>8.3f} {row['warm_s']:>7.3f} {ratio:>6.2f} | "
              f"{row['first_compiled']:>8} {row['first_tuned']:>5} {row['first_captures']:>8} "
              f"{row['first_capture_s']:>9.3f} {row['first_package_capture_s']:>13.3f}", flush=True)


def process_start(device, dtype) -> str:
    """What a process's first generate would pay before any of this package's kernels: importing fla (none left to
    pay once the model is on the GPU: moving it there imports fla) and the device libraries' first GEMM and attention
    call."""
    import torch
    import torch.nn.functional as F

    from hybrid_linear_models import fla_backend

    def seconds(run) -> float:
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    x = torch.randn(1, 4, 64, 64, device=device, dtype=dtype)
    fla = seconds(lambda: fla_backend.fla_for(x))
    gemm = seconds(lambda: x[0, 0] @ x[0, 0])
    sdpa = seconds(lambda: F.scaled_dot_product_attention(x, x, x, is_causal=True))
    return f"process start: import fla {fla:.3f} s, first GEMM {gemm:.3f} s, first sdpa {sdpa:.3f} s"


if __name__ == "__main__":
    main()
