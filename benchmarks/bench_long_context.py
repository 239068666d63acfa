"""Long contexts on one GPU, batch 1: prefill speed and peak memory, then decoding at that context, ours against
transformers.

The pairs (benchmarks/model_configs.py; TINY_* with `--tiny`):
- gdn: ours (GPU_GDN, ~1.2B, 12 GDN + 4 gated attention layers) against transformers' Qwen3NextForCausalLM with the
  same config and weights (`gdn_pair`, weights copied by name);
- kda: ours (GPU_KDA, KDA + gated attention) against transformers' KimiLinearForCausalLM of about the same size
  (`kda_pair`: the KDA layers identical in shape, the attention layers MLA; its own random weights).
Both sides' full-attention layers reach every asked length through YaRN: where the longest length passes
max_position_embeddings (32,768), both configs get rope_parameters {"rope_type": "yarn", "factor": F,
"original_max_position_embeddings": 32768}, F the smallest power of two that covers it and the decoding steps after it
(Kimi-Linear's MLA takes no positions).

For each length of `--lengths` (32k, 128k, 256k, 1M), ascending, in one process per (pair, side) so an out-of-memory
or a failing kernel on one side leaves the other's figures:
- prefill: `model(input_ids, use_cache=True, logits_to_keep=1)` (the default cache; what `generate` runs first), its
  first call at this length (first calls include autotuning for the shapes) and the best of `--repeats` warm calls:
  tokens/s, and the peak memory allocated over the warm calls (`torch.cuda.max_memory_allocated`);
- decoding (`--decode-steps` steps, 0 to skip) at that context: ours into a StaticCache of length + steps slots, its
  one-token steps replayed from a captured CUDA graph (the first step captures; the timed ones replay), transformers
  with its default cache continuing its prefill; tokens/s, and for ours the share of the bytes-per-step limit (every
  weight and the caches read once per step over `--bandwidth-gbs`, bench_generation.bytes_per_step).
A side that runs out of memory prints "OOM at N" and goes on with the next length (a longer one would not fit either:
the rest of its lengths are skipped); another failure prints its first line.

Expected peak memory of ours at length L (bf16, GPU_GDN; hidden H = 2048): the weights (2.4 GB) plus the KV caches
of the 4 attention layers (4 x 2 x 2 heads x 256 x 2 bytes = 8 KiB per token: 8 GiB at 1M) plus one layer's working
set, about 40 x L x H bytes (the residual stream and the mixer's projections, q/k/v/z and the delta rule's chunk
states, all O(L)): no term in L x vocabulary (only the last token's logits) nor L x intermediate_size (the MLP runs
8,192 tokens at a time: token_chunks).

    python benchmarks/bench_long_context.py [--device cuda] [--tiny] [--models gdn kda] [--sides ours transformers]
        [--lengths 32768 131072 262144 1048576] [--repeats 2] [--decode-steps 32] [--bandwidth-gbs 4800]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from timing import timed  # noqa: E402

MODELS = ("gdn", "kda")
SIDES = ("ours", "transformers")
PEERS = {"gdn": "Qwen3-Next", "kda": "Kimi-Linear"}
LENGTHS = (32_768, 131_072, 262_144, 1_048_576)
TINY_LENGTHS = (48, 160)  # --tiny: the second past the tiny run's 64 positions, through YaRN
TRAINED_POSITIONS = {False: 32_768, True: 64}  # max_position_embeddings of the benchmark configs (tiny: 64)


def yarn_factor(longest: int, trained: int) -> float | None:
    """The smallest power-of-two YaRN factor whose positions cover `longest` (None: no scaling needed)."""
    if longest <= trained:
        return None
    return float(2 ** math.ceil(math.log2(longest / trained)))


def reach(args) -> int:
    """The positions the run needs: its longest prompt and the decoding steps after it (with the capture's)."""
    return max(args.lengths) + args.decode_steps + 2


def build(model: str, side: str, tiny: bool, longest: int, device: torch.device, dtype: torch.dtype):
    """One side of the pair, its positions reaching `longest` (see the module docstring)."""
    from model_configs import GPU_GDN, GPU_KDA, TINY_GDN, TINY_KDA, gdn_pair, kda_pair
    from transformers import KimiLinearForCausalLM, Qwen3NextForCausalLM

    from hybrid_linear_models import HybridLinearForCausalLM

    trained = TRAINED_POSITIONS[tiny]
    factor = yarn_factor(longest, trained)
    if model == "gdn":
        ours_config, theirs_config = gdn_pair(**(TINY_GDN if tiny else GPU_GDN))
    else:
        ours_config, theirs_config = kda_pair(**(TINY_KDA if tiny else GPU_KDA))
    # the configs again from their fields, with the positions of the run (each config resolves its layers' rotary
    # settings when built)
    yarn = {}
    if factor is not None:
        yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained}
    ours_config = type(ours_config).from_dict({**ours_config.to_dict(), "max_position_embeddings": trained,
                                               "rope_parameters": {**ours_config.rope_parameters, **yarn}})
    theirs_fields = {**theirs_config.to_dict(), "max_position_embeddings": trained}
    if model == "gdn":  # (Kimi-Linear's MLA takes no positions)
        theirs_fields["rope_parameters"] = {**theirs_config.rope_parameters, **yarn}
    theirs_config = type(theirs_config).from_dict(theirs_fields)
    torch.manual_seed(0)
    with torch.device(device):
        ours = HybridLinearForCausalLM(ours_config)
        if side == "ours":
            return ours.to(dtype).eval()
        theirs = (Qwen3NextForCausalLM if model == "gdn" else KimiLinearForCausalLM)(theirs_config)
    if model == "gdn":
        theirs.load_state_dict(ours.state_dict())
    del ours
    return theirs.to(dtype).eval()


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def prefill(model, input_ids: torch.Tensor, repeats: int) -> dict:
    """First and best warm seconds of the prefill (no warm call for `repeats` 0: warm None), and the warm calls' peak
    memory (GiB; the first call's without warm calls; None off CUDA)."""
    device = input_ids.device

    def once() -> float:
        with torch.no_grad():
            out, seconds = timed(lambda: model(input_ids=input_ids, use_cache=True, logits_to_keep=1), device)
        assert out.logits.shape[1] == 1
        del out
        return seconds

    if device.type == "cuda" and not repeats:  # (the peak of the first call, the only one)
        torch.cuda.reset_peak_memory_stats(device)
    first = once()
    if device.type == "cuda" and repeats:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    warm = min(once() for _ in range(repeats)) if repeats else None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"first_s": first, "warm_s": warm, "peak_gib": peak}


def decode(model, side: str, input_ids: torch.Tensor, steps: int) -> float:
    """Tokens/s of `steps` one-token steps after a prefill of input_ids (ours: a static cache, replayed steps)."""
    from transformers import StaticCache

    device = input_ids.device
    length = input_ids.shape[1]
    token = input_ids[:, -1:]
    with torch.no_grad():
        if side == "ours":
            cache = StaticCache(config=model.config, max_cache_len=length + steps + 2)
            model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
            model(input_ids=token, cache=cache, use_cache=True)  # the step's capture (CUDA), a warm-up elsewhere
            step = lambda: model(input_ids=token, cache=cache, use_cache=True)
        else:
            out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
            state = {"past": out.past_key_values}
            del out

            def step():
                state["past"] = model(input_ids=token, past_key_values=state["past"], use_cache=True).past_key_values

            step()
        _, seconds = timed(lambda: [step() for _ in range(steps)], device)
    return steps / seconds


def child(args) -> None:
    """One (pair, side) over every length; results as JSON lines in args.out."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []

    def emit(**row) -> None:
        results.append(row)
        Path(args.out).write_text(json.dumps(results))

    model = build(args.models[0], args.sides[0], args.tiny, reach(args), device, dtype)
    limit_of = None
    if args.sides[0] == "ours":
        from bench_generation import bytes_per_step

        limit_of = lambda length: args.bandwidth_gbs * 1e9 / bytes_per_step(model, 1, length)
    vocab = model.config.vocab_size
    for length in sorted(args.lengths):
        input_ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
        row = {"length": length}
        try:
            row.update(prefill(model, input_ids, args.repeats))
            if args.decode_steps:
                row["decode_tok_s"] = decode(model, args.sides[0], input_ids, args.decode_steps)
                if limit_of is not None:
                    row["limit_tok_s"] = limit_of(length + args.decode_steps // 2)
        except Exception as error:  # noqa: BLE001  (a side's failure is a result: printed, the next length runs)
            row["error"] = "OOM" if is_oom(error) else f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        del input_ids
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        emit(**row)
        if row.get("error") == "OOM":
            break  # (a longer prompt does not fit either)


def run_side(model: str, side: str, args) -> list[dict]:
    """The child process of (model, side); its rows (an 'error' row where the process itself failed)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, __file__, "--child", "--out", str(out), "--device", args.device, "--models", model,
                   "--sides", side, "--lengths", *map(str, args.lengths), "--repeats", str(args.repeats),
                   "--decode-steps", str(args.decode_steps), "--bandwidth-gbs", str(args.bandwidth_gbs)]
        done = subprocess.run(command + (["--tiny"] if args.tiny else []), check=False, capture_output=True,
                              text=True)
        rows = json.loads(out.read_text()) if out.exists() else []
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        seen = {row["length"] for row in rows}
        rows += [{"length": length, "error": f"process failed (exit {done.returncode}): {last}"}
                 for length in args.lengths if length not in seen][:1]
    return rows


def cell(row: dict | None, key: str, fmt: str) -> str:
    if row is None or row.get(key) is None:
        return ""
    return format(row[key], fmt)


def print_table(model: str, results: dict[str, list[dict]], args) -> None:
    print(f"\n{model} vs {PEERS[model]}: batch 1, prefill `model(ids, use_cache=True, logits_to_keep=1)`, "
          f"decoding {args.decode_steps} steps at that context (ours: static cache"
          f"{', CUDA graphs' if args.device.startswith('cuda') else ', eager on the CPU'})")
    print(f"{'tokens':>9} | {'side':<12} {'first tok/s':>12} {'warm tok/s':>11} {'peak GiB':>9} | "
          f"{'decode tok/s':>12} {'limit tok/s':>11} {'share':>6} | {'prefill ratio':>13} {'decode ratio':>12}")
    by_length = {side: {row["length"]: row for row in rows} for side, rows in results.items()}
    for length in sorted(args.lengths):
        theirs = by_length.get("transformers", {}).get(length)
        for side in args.sides:
            row = by_length[side].get(length)
            if row is None:
                print(f"{length:>9} | {side:<12} skipped (a shorter length ran out of memory)")
                continue
            if "error" in row:
                text = f"OOM at {length}" if row["error"] == "OOM" else f"failed at {length}: {row['error']}"
                print(f"{length:>9} | {side:<12} {text}")
                continue
            first = length / row["first_s"]
            warm = format(length / row["warm_s"], ".0f") if row.get("warm_s") else ""
            share = (format(row["decode_tok_s"] / row["limit_tok_s"], ".1%")
                     if row.get("limit_tok_s") and row.get("decode_tok_s") else "")
            ratios = ""
            if side == "ours" and theirs is not None and "error" not in theirs:
                timed_as = "warm_s" if row.get("warm_s") and theirs.get("warm_s") else "first_s"  # (--repeats 0)
                ratios = f"{theirs[timed_as] / row[timed_as]:>9.2f}x" + ("" if timed_as == "warm_s" else " (first)")
                if row.get("decode_tok_s") and theirs.get("decode_tok_s"):
                    ratios += f" {row['decode_tok_s'] / theirs['decode_tok_s']:>11.2f}x"
            print(f"{length:>9} | {side:<12} {first:>12.0f} {warm:>11} {cell(row, 'peak_gib', '9.2f'):>9} | "
                  f"{cell(row, 'decode_tok_s', '12.1f'):>12} {cell(row, 'limit_tok_s', '11.0f'):>11} {share:>6} | "
                  f"{ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (a smoke test of this script)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=2,
                        help="warm prefill calls after the first (0: the first only, the ratio then between first calls;"
                             " a 1M-token prompt takes a minute a call)")
    parser.add_argument("--decode-steps", type=int, default=None, help="0: no decoding (default 32, --tiny 4)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="the GPU's memory bandwidth in GB/s for the bytes-per-step limit (H200: 4800)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.device = "cpu"
    args.lengths = args.lengths or list(TINY_LENGTHS if args.tiny else LENGTHS)
    if args.decode_steps is None:
        args.decode_steps = 4 if args.tiny else 32
    if min(args.lengths) < 2 or args.repeats < 0 or args.decode_steps < 0:
        raise SystemExit("bench_long_context: need --lengths of at least 2 tokens, --repeats >= 0 and "
                         "--decode-steps >= 0")
    if args.device == "cpu":
        # --tiny on one thread: the smoke run's tensors are tiny, and a second thread waits for a core that
        # other processes hold (CI runs two test workers on two cores)
        torch.set_num_threads(1 if args.tiny else 2)
    if args.child:
        child(args)
        return
    print("command: python " + " ".join(sys.argv))
    factor = yarn_factor(reach(args), TRAINED_POSITIONS[args.tiny])
    print(f"positions: max_position_embeddings {TRAINED_POSITIONS[args.tiny]}"
          + (f", YaRN factor {factor:g} (to {reach(args)} tokens: the longest prompt and its decoding steps)"
             if factor else ""))
    for model in args.models:
        results = {side: run_side(model, side, args) for side in args.sides}
        print_table(model, results, args)


if __name__ == "__main__":
    main()
