"""The cost of a speculative verify step of k tokens against a one-token decoding step, on the ~1.2B GDN benchmark
model (model_configs.GPU_GDN: 16 layers, 3 GDN : 1 attention) or with `--model kda` the 1B KDA one (GPU_KDA), bf16 on
CUDA.

The one-token step is `generate`'s: the model's forward on a StaticCache, replayed from its captured CUDA graph
(cuda_graph_decoding). The verify step is speculative_decoding's `verify_round`: one forward of k tokens per row,
the greedy acceptance and the per-row restore of every GDN layer and attention length, replayed from its captured
graph (`CapturedVerifyRound`), and also run uncaptured; its GDN/KDA layers on this package's round kernels
(`verify_delta_rule`) and its attention layers on the fused attention kernels (`attention_step`), and, in the same
run, the attention layers on their torch path, then both on the torch path over fla's kernels. All attend over the
same number of cache slots. The goal: verify(4) <= 1.3 x the one-token step, so that a round that accepts one draft on average
already pays.

Then `generate` itself on the same model at batch 1 (greedy, `cache_implementation="static"` for plain decoding,
`use_mtp=k` for the model's MTP head, whose random weights draft tokens the model rejects): the milliseconds a step
or a round costs, every host and device cost of the loop included, from the difference of two lengths; and the
tokens/s those rounds give at the acceptance lengths `bench_mtp_acceptance.py` measured on the small model it trains
(`--acceptance`, one per k), against the weight-read limit of a decoding step (its bytes over `--bandwidth-gbs`).

    python benchmarks/bench_verify_step.py [--model gdn|kda] [--batch 1] [--prompt 512] [--repeats 50]
                                           [--widths 2 3 4 5] [--mtp-k 1 2 3 4] [--acceptance 1.75 2.24 2.58 2.75]
    python benchmarks/bench_verify_step.py --tiny     # the CPU smoke configuration (eager, tiny model)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_generation import bytes_per_step
from model_configs import GPU_GDN, GPU_KDA, TINY_GDN, TINY_KDA, gdn_pair, kda_pair
from timing import timed

from hybrid_linear_models import (
    HybridLinearForCausalLM,
    attention_step,
    speculative_decoding,
    verify_delta_rule,
)
from hybrid_linear_models.speculative_decoding import (
    CapturedVerifyRound,
    ReportReader,
    prefill,
    verify_round,
)
from hybrid_linear_models.verify_cache import VerifyCache


def _median_ms(run, repeats: int, device: torch.device) -> float:
    """Median milliseconds of `run()` over `repeats` calls."""
    return statistics.median(timed(run, device)[1] * 1e3 for _ in range(repeats))


def one_token_step_ms(model, prompt_ids, slots: int, repeats: int) -> float:
    """A one-token decoding step on a StaticCache of `slots` slots after the prompt (captured on CUDA)."""
    cache = StaticCache(config=model.config, max_cache_len=slots)
    with torch.no_grad():
        token = model(prompt_ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(3):  # the capture, then warm replays
            token = model(token, cache=cache, use_cache=True).logits.argmax(-1)
        return _median_ms(lambda: model(token, cache=cache, use_cache=True), repeats, prompt_ids.device)


def verify_ms(model, prompt_ids, slots: int, width: int, repeats: int, captured: bool) -> float:
    """A verify round of `width` tokens per row (random drafts: mostly one token kept), on a VerifyCache of `slots`,
    its layers on the kernels `verify_delta_rule.ROUND_DEVICE_TYPES`, `speculative_decoding.SHORT_RULE_KERNEL` and
    `attention_step.STEP_DEVICE_TYPES` choose."""
    device = prompt_ids.device
    batch = prompt_ids.shape[0]
    cache = VerifyCache(model, batch, slots, device)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        first = prefill(model, cache, prompt_ids, None)
        ids = torch.cat([first[:, None], torch.randint(0, model.config.vocab_size, (batch, width - 1),
                                                       generator=generator).to(device)], dim=1)
        live = torch.ones(batch, dtype=torch.bool, device=device)
        run = CapturedVerifyRound(model, cache, width) if captured else (
            lambda i, a: verify_round(model, cache, i, a))
        for _ in range(3):
            run(ids, live)
        return _median_ms(lambda: run(ids, live), repeats, device)


def generate_ms_per_round(model, prompt_ids, lengths: tuple[int, int], repeats: int, **kwargs) -> tuple[float, float]:
    """(ms, tokens) a decoding step or a verify round of `generate(prompt_ids, **kwargs)` costs and gains at batch 1,
    from its calls of two lengths (after a warm-up call of each): the difference of their times and rounds. The rounds
    are counted as the batched loop's reads of a round's tokens (speculative_decoding.ReportReader), plus the model's
    forward calls (transformers' assisted loop, which one row takes where graphs are off: a forward a round), or,
    without drafts, the steps."""
    rounds = []
    pop = ReportReader.pop

    def counted(self):
        rounds.append(1)
        return pop(self)

    def run(new_tokens: int) -> tuple[float, int]:
        rounds.clear()
        hook = model.register_forward_pre_hook(lambda *_: rounds.append(1))
        try:
            with mock.patch.object(ReportReader, "pop", counted):
                out, seconds = timed(lambda: model.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False,
                                                            pad_token_id=0, **kwargs), prompt_ids.device)
        finally:
            hook.remove()
        assert out.shape[1] == prompt_ids.shape[1] + new_tokens, "generate stopped early (an end-of-sequence token)"
        return seconds, len(rounds) if "use_mtp" in kwargs else new_tokens - 1

    with torch.no_grad():
        for new_tokens in lengths:
            run(new_tokens)
        (short, short_rounds), (long, long_rounds) = (min(run(n) for _ in range(repeats)) for n in lengths)
    rounds = long_rounds - short_rounds
    return (long - short) * 1e3 / rounds, (lengths[1] - lengths[0]) / rounds


def generate_table(model, prompt_ids, ks: list[int], acceptance: list[float], repeats: int,
                   bandwidth_gbs: float) -> None:
    """The `generate` rows of the module docstring."""
    lengths = (9, 25) if prompt_ids.device.type == "cpu" else (33, 161)
    mtp_bytes = sum(p.numel() * p.element_size() for p in model.mtp.parameters())
    step_bytes = bytes_per_step(model, 1, prompt_ids.shape[1] + lengths[1]) - mtp_bytes  # (the head's weights aside)
    limit = bandwidth_gbs * 1e9 / step_bytes
    print(f"\ngenerate, batch 1, prompt {prompt_ids.shape[1]}, {lengths[1]} - {lengths[0]} new tokens; weight-read "
          f"limit {limit:,.0f} tok/s ({step_bytes / 1e9:.2f} GB a step at {bandwidth_gbs:,.0f} GB/s)")
    print("| decoding | ms a step or round | tokens a round here | acceptance (bench_mtp_acceptance) | tok/s at it "
          "| vs plain | share of the limit |")
    print("|---|---|---|---|---|---|---|")
    step_ms, _ = generate_ms_per_round(model, prompt_ids, lengths, repeats, cache_implementation="static")
    plain = 1e3 / step_ms
    print(f"| plain, static cache | {step_ms:.3f} | 1 | 1 | {plain:,.0f} | 1.00x | {plain / limit:.1%} |")
    for k, accepted in zip(ks, acceptance):
        round_ms, gained = generate_ms_per_round(model, prompt_ids, lengths, repeats, use_mtp=k)
        tok_s = accepted * 1e3 / round_ms
        print(f"| use_mtp={k} | {round_ms:.3f} | {gained:.2f} | {accepted:.2f} | {tok_s:,.0f} | {tok_s / plain:.2f}x "
              f"| {tok_s / limit:.1%} |")


def verify_table(model, prompt_ids, slots: int, widths: list[int], repeats: int, step: float, captured: bool) -> None:
    """The verify rows of the module docstring: a round of each width on each kernel path, against the step."""
    print("the round's layers: this package's kernels (the default on CUDA: verify_delta_rule for GDN/KDA, "
          "attention_step for attention), those for GDN/KDA with the attention layers' torch path, or the torch path "
          "for both on fla's token-by-token kernels (recurrent) or its chunked ones")
    print("| k tokens | captured, all kernels ms | ratio to step | captured, attention torch path ms | ratio to step "
          "| captured, recurrent ms | ratio to step | captured, chunked ms | ratio to step | eager ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    switches = (speculative_decoding, "SHORT_RULE_KERNEL"), (verify_delta_rule, "ROUND_DEVICE_TYPES"), (
        attention_step, "STEP_DEVICE_TYPES")
    defaults = tuple(getattr(module, name) for module, name in switches)
    paths = {"kernels": defaults, "attention torch path": ("recurrent", defaults[1], ()),
             "recurrent": ("recurrent", (), ()), "chunked": ("chunked", (), ())}

    def use(path: str) -> None:
        for (module, name), value in zip(switches, paths[path]):
            setattr(module, name, value)

    for width in widths:
        times = {}
        for path in paths:
            use(path)
            times[path] = verify_ms(model, prompt_ids, slots, width, repeats, captured) if captured else None
        use("kernels")
        eager = verify_ms(model, prompt_ids, slots, width, repeats, captured=False)
        ratios[width] = (times["kernels"] if captured else eager) / step
        cells = [f"{times[p]:.3f} | {times[p] / step:.2f}" if captured else "skipped (needs CUDA) | -" for p in paths]
        print(f"| {width} | {' | '.join(cells)} | {eager:.3f} |")
    if 4 in ratios:
        verdict = "meets" if ratios[4] <= 1.3 else "misses"
        print(f"verify(4) / step = {ratios[4]:.2f} ({verdict} the goal of 1.3"
              f"{'' if captured else '; eager on the CPU, not the measure'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU, float32, uncaptured")
    parser.add_argument("--model", choices=["gdn", "kda"], default="gdn")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--widths", type=int, nargs="*", default=[2, 3, 4, 5], help="verify widths (none: generate only)")
    parser.add_argument("--mtp-k", type=int, nargs="*", default=[1, 2, 3, 4], help="use_mtp values for generate")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[1.75, 2.24, 2.58, 2.75],
                        help="tokens a round at each --mtp-k, as bench_mtp_acceptance.py measured them")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth (H200: 4800)")
    args = parser.parse_args()
    if len(args.acceptance) < len(args.mtp_k):
        parser.error(f"--acceptance gives {len(args.acceptance)} lengths for {len(args.mtp_k)} --mtp-k values: give "
                     "one acceptance length per k")
    if args.tiny:
        args.prompt, args.repeats = min(args.prompt, 32), min(args.repeats, 3)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pair, sizes = {"gdn": (gdn_pair, (GPU_GDN, TINY_GDN)), "kda": (kda_pair, (GPU_KDA, TINY_KDA))}[args.model]
    config = pair(**sizes[args.tiny])[0]
    # an MTP head for the generate table's use_mtp rows (the verify rounds do not run it)
    config.num_mtp_layers, config.mtp_mlp_type = 1, "dense"
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(config).to(device, dtype).eval()
    prompt_ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt), device=device)
    slots = args.prompt + (args.repeats + 8) * max(args.widths, default=1) + 8
    captured = device.type == "cuda"
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {config.num_hidden_layers} "
          f"layers, {dtype}, {device.type}; batch {args.batch}, prompt {args.prompt}, {slots} cache slots")
    step = one_token_step_ms(model, prompt_ids, slots, args.repeats)
    print(f"one-token decoding step ({'captured' if captured else 'eager'}): {step:.3f} ms")
    if args.widths:
        verify_table(model, prompt_ids, slots, args.widths, args.repeats, step, captured)
    if args.mtp_k and args.batch == 1:
        generate_table(model, prompt_ids, args.mtp_k, args.acceptance, 1 if args.tiny else min(args.repeats, 5),
                       args.bandwidth_gbs)


if __name__ == "__main__":
    main()
