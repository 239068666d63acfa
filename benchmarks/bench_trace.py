"""Generation as a service sees it: a trace of requests whose prompt lengths never repeat, ours against transformers
with the same weights, every first call included.

The trace (`--seed` 0): `--requests` (200) requests, prompt lengths log-uniform in [`--min-prompt`, `--max-prompt`]
([16, 16384]) with no two equal (a length drawn twice is drawn again), `--min-new` to `--max-new` (16 to 512) new
tokens each (uniform), prompt tokens uniform over the vocabulary (0 is the padding token). It is played two ways:
- one at a time (`single`): one user, each request its own greedy `generate` at batch 1, in trace order;
- in batches (`batched`): `--batch` (8) consecutive requests at once, left padded to the longest prompt of the
  batch, generating the most new tokens any of them asks for; each request counts only the tokens it asked for.
Each (model, side, way) runs in a fresh process of its own (this script, `--child`), so every first call is
included: captures, compilation, kernel tuning, the allocator's growth, in whichever call pays them. Nothing runs
before the trace unless asked: `--warmup generate` runs one generate of `--warmup-length` tokens (512; moved up to
the first length the trace does not hold) and 2 new tokens at the way's batch size; `--warmup package` calls the
package's warm-up method (`model.warm_up(max_batch_size=..., max_length=...)`) where the model has one. Which was
used is printed.

The pairs (benchmarks/model_configs.py, bench_kimi_linear.py; the same weights in both, built from seed 0):
- gdn: ours against transformers' Qwen3NextForCausalLM (the ~1.2B GDN model on CUDA, TINY_GDN with `--tiny`);
- kda: ours converted from transformers' KimiLinearForCausalLM (bench_kimi_linear's ~1B-active model on CUDA, its
  tiny size with `--tiny`), through the kimi_linear converter.
Ours runs with its default cache (static on CUDA with graph decoding on: the captured step), or with `--cache static`
or `--cache dynamic` naming one; transformers with its default cache. bfloat16 on CUDA, float32 on the CPU.

Timing: a streamer records the host time each step's tokens reach it (`generate` copies them to the host, which
waits for the device; with this package's deferred stop check on CUDA a step's tokens are handed over once the next
step is queued). Time to first token: from the call to `generate` to its first new token (in a batch, every request
of the batch shares it; no queueing is counted). Time between tokens: the gaps between consecutive steps' tokens.
End-to-end output tokens/s: the tokens the requests asked for over the summed wall time of the `generate` calls.
Printed per pair and way: tokens/s, time to first token p50 / p90 / p99 and its worst request, time between tokens
p50 / p99, for each side, and the ratios (> 1: ours better).

    python benchmarks/bench_trace.py [--device cuda] [--tiny] [--cache default|static|dynamic] [--models gdn kda]
        [--ways single batched] [--sides ours transformers] [--requests 200] [--seed 0] [--batch 8]
        [--warmup none|generate|package] [--json results.json]
    python benchmarks/bench_trace.py --combine ours.json transformers.json   # one table from separate runs' --json
    python benchmarks/bench_trace.py --sides transformers --ways single --slice 0:100 --json a.json   # then 100:200

A run can be split (`--sides`, `--ways`, `--models`; e.g. one call per side under a time limit per call) and its
parts' `--json` files combined into one table with the ratios. One (model, side, way) can be split too, by requests:
`--slice START:END` plays requests START to END - 1 of the same trace (the same prompts; in the batched way START a
multiple of `--batch`, so the batches are the whole run's) in a process of its own, which pays its own first calls;
`--combine` joins the slices of a (model, side, way), which must not overlap, and says which requests they cover.
`--stop-after SECONDS` ends a run's slice at the first request (or batch) that would start past that much played
time, and records the slice it played, so a way longer than one call runs in parts without guessing where to cut.
Ratios are printed only where both sides played the same requests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAD = 0
SIDES = ("ours", "transformers")
WAYS = ("single", "batched")
# --tiny: a CI smoke run of every path of this script on the CPU (a few seconds per child)
TINY = dict(requests=16, min_prompt=4, max_prompt=96, min_new=2, max_new=6, warmup_length=20)


@dataclass
class Request:
    prompt_length: int
    new_tokens: int


def make_trace(requests: int, min_prompt: int, max_prompt: int, min_new: int, max_new: int,
               seed: int) -> list[Request]:
    """`requests` requests with distinct prompt lengths, log-uniform in [min_prompt, max_prompt] (a repeat is drawn
    again), and uniform new-token counts in [min_new, max_new]."""
    if not 1 <= min_prompt <= max_prompt or not 1 <= min_new <= max_new:
        raise SystemExit(f"bench_trace: need 1 <= --min-prompt <= --max-prompt and 1 <= --min-new <= --max-new "
                         f"(got prompts {min_prompt}..{max_prompt}, new tokens {min_new}..{max_new})")
    if max_prompt - min_prompt + 1 < requests:
        raise SystemExit(f"bench_trace: {requests} distinct prompt lengths do not fit in [{min_prompt}, {max_prompt}]; "
                         f"ask for at most {max_prompt - min_prompt + 1} requests or widen the range")
    rng = random.Random(seed)
    low, high = math.log(min_prompt), math.log(max_prompt)
    seen: set[int] = set()
    trace = []
    while len(trace) < requests:
        length = min(max_prompt, max(min_prompt, round(math.exp(rng.uniform(low, high)))))
        if length not in seen:
            seen.add(length)
            trace.append(Request(length, rng.randint(min_new, max_new)))
    return trace


def prompt_tokens(index: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """The tokens of request `index` (1..vocab-1, so never the padding token), the same in every process."""
    return torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(seed * 100_003 + index))


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of `prompts` left padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


class TokenClock(BaseStreamer):
    """Host time of each step's tokens as `generate` hands them over (its first call carries the prompt)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def build(pair: str, side: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    """One side of the pair `pair`, its weights those both sides get from seed 0."""
    from transformers import Qwen3NextForCausalLM

    from hybrid_linear_models import HybridLinearForCausalLM

    torch.manual_seed(0)
    if pair == "gdn":
        from model_configs import GPU_GDN, TINY_GDN, gdn_pair

        ours_config, theirs_config = gdn_pair(**(TINY_GDN if tiny else GPU_GDN))
        with torch.device(device):
            model = HybridLinearForCausalLM(ours_config)
            if side == "transformers":
                theirs = Qwen3NextForCausalLM(theirs_config)
                theirs.load_state_dict(model.state_dict())
                model = theirs
    else:
        from bench_kimi_linear import SIZES, build_pair

        ours, theirs = build_pair(SIZES["tiny" if tiny else "gpu"], device)
        model = ours if side == "ours" else theirs
    return model.to(dtype).eval()


def timed_generate(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, device: torch.device,
                   kwargs: dict) -> tuple[float, list[float]]:
    """Wall seconds of one greedy `generate` of exactly `new_tokens` tokens, and the host times of its tokens
    relative to its start."""
    clock = TokenClock()
    ids, mask = ids.to(device), mask.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=PAD, streamer=clock, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + new_tokens or len(clock.times) != new_tokens:
        raise RuntimeError(f"generate gave {out.shape[1] - ids.shape[1]} new tokens and streamed "
                           f"{len(clock.times)}, {new_tokens} asked")
    return wall, [t - start for t in clock.times]


def warm_up(model, way: str, args, trace: list[Request], vocab: int, device: torch.device, kwargs: dict) -> str:
    """The warm-up asked for, before the trace; what ran, in words."""
    batch = 1 if way == "single" else args.batch
    if args.warmup == "package":
        method = getattr(model, "warm_up", None)
        if method is None:
            return f"the package's warm-up call: not used ({type(model).__name__} has no warm_up method)"
        start = time.perf_counter()
        method(max_batch_size=batch, max_length=args.max_prompt + args.max_new)
        return f"the package's warm-up call: used, model.warm_up took {time.perf_counter() - start:.2f} s"
    if args.warmup == "generate":
        lengths = {r.prompt_length for r in trace}
        length = args.warmup_length
        while length in lengths:
            length += 1
        prompts = [prompt_tokens(-1 - row, length, vocab, args.seed) for row in range(batch)]
        ids, mask = left_padded(prompts)
        wall, _ = timed_generate(model, ids, mask, 2, device, kwargs)
        return (f"the package's warm-up call: not used; one warm-up generate of {length} tokens (not in the trace), "
                f"batch {batch}, 2 new tokens, took {wall:.2f} s")
    return "the package's warm-up call: not used; no warm-up (every first call timed)"


def play(pair: str, side: str, way: str, args) -> dict:
    """Plays the trace on one side, one way, in this process; its figures."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    trace = make_trace(args.requests, args.min_prompt, args.max_prompt, args.min_new, args.max_new, args.seed)
    start = time.perf_counter()
    model = build(pair, side, args.tiny, device, dtype)
    built = time.perf_counter() - start
    vocab = model.config.vocab_size
    kwargs = {"cache_implementation": args.cache} if args.cache != "default" and side == "ours" else {}
    warmup = warm_up(model, way, args, trace, vocab, device, kwargs)
    size = 1 if way == "single" else args.batch
    start, end = args.slice or (0, len(trace))
    calls = []
    played = time.perf_counter()
    for begin in range(start, end, size):
        if args.stop_after is not None and time.perf_counter() - played > args.stop_after:
            end = begin  # the time asked for is spent: the slice played ends here
            break
        group = trace[begin:min(begin + size, end)]
        ids, mask = left_padded([prompt_tokens(begin + i, r.prompt_length, vocab, args.seed)
                                 for i, r in enumerate(group)])
        wall, times = timed_generate(model, ids, mask, max(r.new_tokens for r in group), device, kwargs)
        calls.append({"first": begin, "requests": len(group), "wall_s": wall,
                      "tokens": sum(r.new_tokens for r in group), "ttft": times[0], "prompt": ids.shape[1],
                      "gaps": [b - a for a, b in zip(times, times[1:])]})
    if not calls:
        raise SystemExit(f"bench_trace: --stop-after {args.stop_after} left no request played")
    return result_of_calls({"pair": pair, "side": side, "way": way, "built_s": built, "warmup": warmup,
                            "parameters": sum(p.numel() for p in model.parameters()), "slice": [start, end]}, calls)


def result_of_calls(base: dict, calls: list[dict]) -> dict:
    """A run's figures from its `generate` calls (each: the requests it played, its wall time, the tokens they asked
    for, its time to first token, its padded prompt length, its gaps between tokens), kept with them so that a table
    can take the calls of the requests another run played too (`on_common_requests`)."""
    wall, tokens = sum(call["wall_s"] for call in calls), sum(call["tokens"] for call in calls)
    return {**base, "calls": calls, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft": [call["ttft"] for call in calls for _ in range(call["requests"])],
            "gaps": [gap for call in calls for gap in call["gaps"]],
            "worst_ttft": max((call["ttft"], call["prompt"]) for call in calls),
            "slices": [(call["first"], call["first"] + call["requests"]) for call in calls]}


def on_common_requests(rows: dict[str, dict]) -> dict[str, dict] | None:
    """Each side's result cut to its calls whose requests every side played, where those are the same requests on
    every side (None where a result keeps no calls, or nothing is common)."""
    if not all("calls" in result for result in rows.values()):
        return None
    common = set.intersection(*({i for start, end in requests_played(result) for i in range(start, end)}
                                for result in rows.values()))
    cut = {side: [call for call in result["calls"]
                  if common.issuperset(range(call["first"], call["first"] + call["requests"]))]
           for side, result in rows.items()}
    if not all(cut.values()):
        return None
    results = {side: result_of_calls(rows[side], calls) for side, calls in cut.items()}
    return results if len({requests_played(result) for result in results.values()}) == 1 else None


def summary(result: dict) -> dict[str, float]:
    first, gaps = result["ttft"], result["gaps"] or [float("nan")]
    return {"tok/s": result["tok_s"], "TTFT p50": percentile(first, 50), "TTFT p90": percentile(first, 90),
            "TTFT p99": percentile(first, 99), "TBT p50": percentile(gaps, 50), "TBT p99": percentile(gaps, 99)}


def print_table(results: dict, pairs: list[str], ways: list[str]) -> None:
    """One table per pair: per way, each side's figures (seconds as ms) and the ratios (> 1: ours better)."""
    columns = ["tok/s", "TTFT p50", "TTFT p90", "TTFT p99", "TBT p50", "TBT p99"]
    for pair in pairs:
        print(f"\n{pair}: tokens/s end to end; time to first token (TTFT) and between tokens (TBT) in ms")
        print(f"{'way':<8} {'side':<13} " + " ".join(f"{c:>9}" for c in columns) + f" {'wall s':>8}  worst TTFT")
        for way in ways:
            rows = {side: results.get((pair, side, way)) for side in SIDES}
            for side, result in rows.items():
                if result is None:
                    continue
                figures = summary(result)
                cells = " ".join(f"{figures[c] * (1 if c == 'tok/s' else 1e3):>9.1f}" for c in columns)
                worst_s, worst_length = result["worst_ttft"]
                print(f"{way:<8} {side:<13} {cells} {result['wall_s']:>8.1f}  {worst_s * 1e3:.0f} ms at a "
                      f"{worst_length}-token prompt")
            if not all(rows.values()):
                continue
            played = {side: requests_played(result) for side, result in rows.items()}
            note = ""
            if len(set(played.values())) > 1:
                common = on_common_requests(rows)
                if common is None:
                    print(f"{way:<8} {'ratio':<13} not given: the sides played different requests "
                          f"({'; '.join(f'{side} {spans_text(spans)}' for side, spans in played.items())})")
                    continue
                rows = common
                note = f"  on requests {spans_text(requests_played(rows['ours']))}, those both sides played"
            ours, theirs = summary(rows["ours"]), summary(rows["transformers"])
            ratios = [ours[c] / theirs[c] if c == "tok/s" else theirs[c] / ours[c] for c in columns]
            print(f"{way:<8} {'ratio':<13} " + " ".join(f"{r:>8.2f}x" for r in ratios) + note)


def played_span(result: dict) -> tuple[int, int]:
    """The requests (START, END) one run played: its slice, or the whole trace of a result without one."""
    return tuple(result.get("slice") or (0, len(result["ttft"])))


def requests_played(result: dict) -> tuple[tuple[int, int], ...]:
    """The request spans (START, END) a result covers: its slices (a joined result's), joined where they touch."""
    spans = sorted(tuple(span) for span in result.get("slices") or [played_span(result)])
    joined = [list(spans[0])]
    for start, end in spans[1:]:
        if start == joined[-1][1]:
            joined[-1][1] = end
        else:
            joined.append([start, end])
    return tuple(tuple(span) for span in joined)


def spans_text(spans) -> str:
    return ", ".join(f"{start}..{end - 1}" for start, end in spans)


def saved_results(path: Path) -> list[dict]:
    """The results a run wrote with --json, or one line saying what is wrong with the file."""
    try:
        results = json.loads(path.read_text())
        for result in results:
            missing = {"pair", "side", "way", "tok_s", "ttft", "gaps", "wall_s", "worst_ttft"} - set(result)
            if missing:
                raise ValueError(f"a result without {sorted(missing)}")
    except (OSError, ValueError, TypeError) as error:
        raise SystemExit(f"bench_trace: {path} is not a --json file of this script ({error}); pass the files that "
                         f"runs with --json wrote") from None
    return results


def parse_slice(text: str | None, requests: int, batch: int, ways: list[str]) -> tuple[int, int] | None:
    """`--slice START:END` as (START, END), or one line naming what is wrong with it."""
    if text is None:
        return None
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"bench_trace: --slice takes START:END, two request numbers (got {text!r})") from None
    if not 0 <= start < end <= requests:
        raise SystemExit(f"bench_trace: --slice {text} is not within the trace's {requests} requests: need 0 <= START < "
                         f"END <= {requests}")
    if "batched" in ways and start % batch:
        raise SystemExit(f"bench_trace: --slice {text} starts inside a batch of {batch}: in the batched way START must be "
                         f"a multiple of --batch (the whole run's batches), e.g. {start - start % batch}")
    return start, end


def joined_slices(parts: list[dict]) -> dict:
    """One result from the slices of one (pair, side, way): their requests' figures together, the wall times and
    tokens summed; one line where two slices overlap."""
    spans = sorted(played_span(part) for part in parts)
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            first = parts[0]
            raise SystemExit(f"bench_trace: the --json files hold overlapping slices of {first['pair']} "
                             f"{first['side']} {first['way']} ({spans}): combine each request's figures once")
    if all("calls" in part for part in parts):
        return result_of_calls(parts[0], sorted((call for part in parts for call in part["calls"]),
                                                key=lambda call: call["first"]))
    joined = dict(parts[0])
    tokens, wall = sum(part["tokens"] for part in parts), sum(part["wall_s"] for part in parts)
    joined.update(wall_s=wall, tokens=tokens, tok_s=tokens / wall,
                  ttft=[t for part in parts for t in part["ttft"]], gaps=[g for part in parts for g in part["gaps"]],
                  worst_ttft=max(tuple(part["worst_ttft"]) for part in parts), slices=spans)
    return joined


def combined_results(paths: list[Path]) -> dict:
    """The results of --json files by (pair, side, way), the slices of each joined."""
    grouped: dict[tuple, list[dict]] = {}
    for path in paths:
        for result in saved_results(path):
            grouped.setdefault((result["pair"], result["side"], result["way"]), []).append(result)
    for (pair, side, way), parts in grouped.items():
        if len(parts) > 1:
            print(f"{pair} {side} {way}: requests {spans_text(sorted(played_span(part) for part in parts))} from "
                  f"{len(parts)} runs, each with its own first calls")
    return {key: parts[0] if len(parts) == 1 else joined_slices(parts) for key, parts in grouped.items()}


def run_child(pair: str, side: str, way: str, argv: list[str]) -> dict | None:
    """One (pair, side, way) in a fresh process; its result, or None (its error printed) when it failed."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", pair, side, way]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{pair} {side} {way}: failed (exit {done.returncode}): {error[:300]}", flush=True)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models and a short trace (a CPU smoke run)")
    parser.add_argument("--cache", default="default", choices=["default", "static", "dynamic"],
                        help="ours' cache_implementation (default: generate's own choice)")
    parser.add_argument("--models", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=16384)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="requests per batch in the batched way")
    parser.add_argument("--warmup", choices=["none", "generate", "package"], default="none")
    parser.add_argument("--warmup-length", type=int, default=512, help="--warmup generate: its prompt length")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--json", type=Path, default=None, help="also write every request's figures here")
    parser.add_argument("--slice", default=None, metavar="START:END",
                        help="play only requests START..END-1 of the trace (see the module docstring)")
    parser.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                        help="start no request (or batch) once this many seconds of the trace have been played; the "
                             "slice recorded is the one played (a long way run in parts under a time limit per call)")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                        help="print one table from these runs' --json files, and nothing else")
    parser.add_argument("--child", nargs=3, metavar=("PAIR", "SIDE", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.combine:
        results = combined_results(args.combine)
        print_table(results, list(dict.fromkeys(pair for pair, _, _ in results)),
                    [way for way in WAYS if any(key[2] == way for key in results)])
        return
    if args.tiny:  # the tiny trace's sizes, unless given explicitly
        given = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
        for name, value in TINY.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    if args.batch < 1:
        raise SystemExit(f"bench_trace: --batch must be at least 1 (got {args.batch})")
    args.slice = parse_slice(args.slice, args.requests, args.batch, args.ways)
    if args.child:
        print("RESULT " + json.dumps(play(*args.child, args)), flush=True)
        return
    trace = make_trace(args.requests, args.min_prompt, args.max_prompt, args.min_new, args.max_new, args.seed)
    lengths = sorted(r.prompt_length for r in trace)
    print("command: python " + " ".join(sys.argv))
    print(f"trace: {len(trace)} requests, seed {args.seed}, prompts {lengths[0]}..{lengths[-1]} tokens (median "
          f"{lengths[len(lengths) // 2]}, all distinct), {sum(r.new_tokens for r in trace)} new tokens "
          f"({args.min_new}..{args.max_new} each); {args.device}; ours with "
          f"{'its default cache' if args.cache == 'default' else 'cache_implementation=' + args.cache}, "
          f"transformers with its default cache; batched: {args.batch} requests per batch, left padded", flush=True)
    if args.slice:
        print(f"slice: requests {args.slice[0]}..{args.slice[1] - 1} of the trace (--combine joins a run's slices)")
    results = {}
    for pair in args.models:
        for way in args.ways:
            for side in args.sides:
                result = run_child(pair, side, way, sys.argv[1:])
                if result is None:
                    continue
                results[pair, side, way] = result
                figures = summary(result)
                print(f"{pair} {side} {way}: {result['parameters'] / 1e6:.1f}M parameters, built in "
                      f"{result['built_s']:.1f} s; {result['warmup']}; "
                      f"requests {spans_text([played_span(result)])} played; "
                      f"{figures['tok/s']:.1f} tok/s, {result['wall_s']:.1f} s", flush=True)
    print_table(results, args.models, args.ways)
    if args.json is not None:
        args.json.write_text(json.dumps([dict(r, trace=[asdict(q) for q in trace]) for r in results.values()]))
    expected = len(args.models) * len(args.ways) * len(args.sides)
    if len(results) < expected:
        raise SystemExit(f"bench_trace: {expected - len(results)} of {expected} runs failed (see above)")


if __name__ == "__main__":
    main()
