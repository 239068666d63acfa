"""Loading a flagship's folder from disk onto the GPU with `from_pretrained`: seconds and the host's peak resident
memory, this package's reading of the shards (streamed_loading) beside transformers' memory maps, in one run.

It builds the first `--layers` layers of a released flagship (flagship_models: Qwen3-Next-80B-A3B in its FP8 layout,
or Kimi-Linear-48B-A3B in bf16; random weights drawn on the device), writes it with `save_pretrained` in shards of at
most `--shard-gb` GB, keeps its logits on a fixed prompt, frees the device, then loads the folder in a fresh process
per way, the folder's pages first dropped from the page cache (posix_fadvise), so each way reads the disk:
- streamed: `HybridLinearForCausalLM.from_pretrained(folder, device_map=device)` as the package runs it;
- mapped: the same with `streamed_loading.STREAMED_DEVICE_TYPES` emptied: transformers' memory-mapped shards.
Each prints the load's seconds, the host's resident memory before it and at its peak (Linux's VmRSS and VmHWM; the
growth is what the load held), whether the growth is within the largest shard + 1 GiB, and whether the loaded model's
logits equal the written model's (the same weights, read back).

    python benchmarks/bench_loading.py [--model qwen3-next-fp8|kimi-linear] [--layers 8] [--shard-gb 5]
        [--folder DIR] [--device cuda] [--tiny]

`--tiny` (the flagships' tiny layouts on the CPU, which then counts as an accelerator for the streamed way; shards of
20 KB) is the configuration CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 2 ** 30
MODELS = ("qwen3-next-fp8", "kimi-linear")
WAYS = ("streamed", "mapped")


def fields_of(model: str, layers: int | None, tiny: bool) -> dict:
    from flagship_models import kimi_linear_fields, qwen3_next_fields

    if model == "qwen3-next-fp8":
        return qwen3_next_fields(layers=layers, tiny=tiny, fp8=True)
    return kimi_linear_fields(layers=layers, tiny=tiny)


def prompt(vocab: int):
    import torch

    return torch.randint(1, vocab, (1, 16), generator=torch.Generator().manual_seed(0))


def write_folder(args, folder: Path) -> None:
    """The model of `args` built on the device, its logits on the prompt kept in folder/bench_logits.safetensors,
    written with save_pretrained."""
    import torch
    from flagship_models import build_ours
    from safetensors.torch import save_file

    device = torch.device(args.device)
    model = build_ours(fields_of(args.model, None if args.tiny else args.layers, args.tiny), device)
    with torch.no_grad():
        logits = model(prompt(model.config.vocab_size).to(device)).logits.float().cpu()
    model.save_pretrained(folder, max_shard_size=args.shard_size)
    save_file({"logits": logits}, folder / "bench_logits.safetensors")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def drop_page_cache(folder: Path) -> None:
    """Asks the kernel to forget the folder's cached pages (clean pages: no privilege needed), so a load reads the
    disk."""
    for file in folder.iterdir():
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def child(args) -> None:
    """One load of args.folder the way args.way says; its figures as a JSON line."""
    import torch
    from bench_memory import _status_kib
    from safetensors.torch import load_file
    from timing import timed

    from hybrid_linear_models import HybridLinearForCausalLM, streamed_loading

    def resident(field: str) -> float:
        return _status_kib(field) * 1024 / GIB

    device = torch.device(args.device)
    if args.way == "mapped":
        streamed_loading.STREAMED_DEVICE_TYPES = ()
    elif device.type == "cpu":  # (--tiny: the CPU stands in for the accelerator)
        streamed_loading.STREAMED_DEVICE_TYPES = (*streamed_loading.STREAMED_DEVICE_TYPES, "cpu")
    if device.type == "cuda":
        torch.zeros(1, device=device)  # (the CUDA context, before the baseline)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here
    before = resident("VmRSS")
    model, seconds = timed(lambda: HybridLinearForCausalLM.from_pretrained(args.folder, device_map=str(device)),
                           device)
    peak = resident("VmHWM")
    with torch.no_grad():
        logits = model(prompt(model.config.vocab_size).to(device)).logits.float().cpu()
    expected = load_file(Path(args.folder) / "bench_logits.safetensors")["logits"]
    print(json.dumps({"seconds": seconds, "before_gib": before, "peak_gib": peak,
                      "same_logits": bool(torch.equal(logits, expected))}))


def run_way(args, folder: Path, way: str) -> dict:
    drop_page_cache(folder)
    command = [sys.executable, __file__, "--child", "--way", way, "--folder", str(folder), "--device", args.device]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(args, folder: Path, results: dict[str, dict]) -> None:
    shards = [file.stat().st_size for file in folder.glob("*.safetensors") if file.name != "bench_logits.safetensors"]
    largest = max(shards) / GIB
    print(f"{args.model}, {'tiny' if args.tiny else f'first {args.layers} layers'}: {len(shards)} shards, "
          f"{sum(shards) / GIB:.2f} GiB, the largest {largest:.3f} GiB; loaded onto {args.device}")
    print(f"{'way':<9} | {'seconds':>8} | {'host GiB before':>15} {'peak':>7} {'growth':>7} | "
          f"{'within largest shard + 1 GiB':>28} | same logits")
    for way, row in results.items():
        if "error" in row:
            print(f"{way:<9} | failed: {row['error']}")
            continue
        growth = row["peak_gib"] - row["before_gib"]
        print(f"{way:<9} | {row['seconds']:8.2f} | {row['before_gib']:15.2f} {row['peak_gib']:7.2f} {growth:7.2f} | "
              f"{growth <= largest + 1!s:>28} | {row['same_logits']}")
    if all("error" not in row for row in results.values()):
        streamed, mapped = results["streamed"], results["mapped"]
        print(f"streamed / mapped: seconds {streamed['seconds'] / mapped['seconds']:.2f}x, peak growth "
              f"{streamed['peak_gib'] - streamed['before_gib']:.2f} against "
              f"{mapped['peak_gib'] - mapped['before_gib']:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--layers", type=int, default=8, help="the flagship's first layers written (not with --tiny)")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="save_pretrained's max_shard_size, GB")
    parser.add_argument("--folder", help="where to write the folder (a new folder; default: a temporary one)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny layouts on the CPU (a smoke test of this script)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print("command: python " + " ".join(sys.argv))
    if not Path("/proc/self/clear_refs").exists():
        print("bench_loading.py: skipped, it reads the host's peak resident memory from Linux's /proc")
        return
    import torch

    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if not args.tiny and not args.device.startswith("cuda"):  # (the flagships' layers are GBs: host memory is no GPU)
        raise SystemExit("bench_loading: the flagships' layers load onto a CUDA device; run with --tiny for the CPU "
                         "smoke test.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"bench_loading: --device {args.device} but this torch sees no CUDA device.")
    if args.layers < 1 or args.shard_gb <= 0:
        raise SystemExit("bench_loading: --layers and --shard-gb must be positive.")
    args.shard_size = "20KB" if args.tiny else f"{int(args.shard_gb * 1000)}MB"
    if args.folder and Path(args.folder).exists():
        raise SystemExit(f"bench_loading: --folder {args.folder} exists; name a new folder (it is written, then read)")
    scratch = None if args.folder else Path(tempfile.mkdtemp(prefix="bench_loading_"))
    folder = Path(args.folder) if args.folder else scratch / "model"
    try:
        write_folder(args, folder)
        report(args, folder, {way: run_way(args, folder, way) for way in WAYS})
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
