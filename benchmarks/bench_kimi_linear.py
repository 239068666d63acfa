"""Speed of ours against transformers' KimiLinearForCausalLM with the same weights.

The pair: transformers' `KimiLinearForCausalLM` built from a `KimiLinearConfig` with random weights, and ours converted
from it in memory through the kimi_linear converter (`kimi_to_hybrid_config` on its config.json fields, the
parameter map `build_kimi_rows` over its in-memory tensor names, each row's `converter.forward`), loaded strictly.
So every figure below also shows the converted model is the same model: the first line printed is the largest
logits difference of the two on a short input.

Model shapes (Kimi-Linear's: KDA layers with an MLA layer every 4th, 3:1; MLA without RoPE; sigmoid-routed MoE with
one shared expert, the first layer dense):
- gpu (default on CUDA), ~1B active: hidden 2048, 16 layers, KDA 16 heads of 128, MLA 16 heads (kv_lora_rank 512,
  qk_nope 128, qk_rope 64, v 128), MoE 64 experts top-8 (1 group), expert width 512, 1 shared expert, dense
  intermediate 5632 in layer 0, vocab 32000; bfloat16.
- tiny (default on CPU): the same structure in miniature; float32 (a smoke run, under a minute on 2 cores).

Measurements:
1. training: forward + backward tokens/s at B=4, T=4096 (tiny: B=2, T=128), ours vs theirs, the ratio and (CUDA)
   peak memory of each; the fastest of `--repeats` runs taken in turn (bench_moe.fastest_of);
2. decoding: greedy, batch 1 and 16 (`--decode`), prompt 512, 64 new tokens (tiny: 32 / 8): ours with a static cache
   (its one-token steps replayed from a captured CUDA graph on CUDA), theirs with its default cache (bench_generation
   .measure: decoding tokens/s from the time of prompt + N tokens minus prompt + 1 token); then the MLA cache bytes
   per token against full keys and values of the same heads, and the bytes our static cache holds.

    python benchmarks/bench_kimi_linear.py [--size tiny|gpu] [--decode 1 16] [--repeats N] [--skip-training]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import KimiLinearForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_generation import measure  # noqa: E402
from bench_moe import fastest_of, peak_memory  # noqa: E402
from model_configs import SIZES, kimi_config  # noqa: E402

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM  # noqa: E402
from hybrid_linear_models.conversion.hf_layout import layer_config  # noqa: E402
from hybrid_linear_models.conversion.kimi_linear.config import kimi_to_hybrid_config  # noqa: E402
from hybrid_linear_models.conversion.kimi_linear.parameters import build_kimi_rows  # noqa: E402
from hybrid_linear_models.mixer_mla import cache_bytes_per_token, full_kv_bytes_per_token  # noqa: E402

SAME_WEIGHTS_TOLERANCE = 1e-4  # float32 logits (see same_weights_line)


def converted(theirs: KimiLinearForCausalLM, device: torch.device, dtype: torch.dtype) -> HybridLinearForCausalLM:
    """Ours from transformers' model through the kimi_linear converter, in memory: its config as config.json holds
    it, its tensors under their in-memory names, mapped row by row into our canonical names; loaded strictly."""
    config: HybridLinearConfig = kimi_to_hybrid_config(json.loads(theirs.config.to_json_string()), "the benchmark's "
                                                       "KimiLinearConfig")
    source = theirs.state_dict()
    state = {}
    for row in build_kimi_rows(config, keys=source.keys()):
        for name, tensor in zip(row.canonical_keys, row.converter.forward([source[k] for k in row.format_keys])):
            state[name] = tensor
    with torch.device(device):  # built where it runs (on CUDA: no 3B-parameter CPU init), then overwritten
        ours = HybridLinearForCausalLM(config)
    ours.to(dtype).load_state_dict(state, strict=True)
    return ours


def build_pair(size: dict, device: torch.device):
    """The pair in float32 (the same-weights check runs there; main casts both to the benchmark's dtype after)."""
    torch.manual_seed(0)
    with torch.device(device):
        theirs = KimiLinearForCausalLM(kimi_config(size))
    with torch.no_grad():  # a router that prefers some experts, as a trained one (zeros at init pick by index)
        for module in theirs.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.01)
    return converted(theirs, device, torch.float32), theirs


def parameters(model: torch.nn.Module) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"


def same_weights_line(ours, theirs, size: dict, device: torch.device) -> None:
    """Both models' float32 logits on one input (run before the cast to the benchmark's dtype: in bfloat16 a random
    router's near ties flip expert choices between any two kernels, so a bfloat16 difference proves nothing)."""
    tokens = torch.randint(1, size["vocab"], (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = theirs(tokens, use_cache=False).logits.float()
        got = ours(tokens, use_cache=False).logits.float()
    difference = (expected - got).abs().max().item()
    print(f"same weights: max |logits ours - transformers'| = {difference:.3g} (logits up to "
          f"{expected.abs().max().item():.3g}), {tuple(tokens.shape)} tokens, float32, {device}", flush=True)
    # On the CPU both run PyTorch in float32 and differ by summation order only (~1e-6 here,
    # tests/test_convert_kimi_linear.py's 1e-4 bound); a mapping mistake moves logits by 1e-2 or more. On CUDA both
    # call fla's KDA kernels, which multiply in TF32 (~1e-3 relative): the line is printed, the bound is the CPU's.
    if device.type == "cpu" and difference > SAME_WEIGHTS_TOLERANCE:
        raise SystemExit(f"the converted model differs from transformers' by {difference:.3g} in float32 logits "
                         f"(> {SAME_WEIGHTS_TOLERANCE}): the kimi_linear conversion is wrong; benchmark not run.")


def bench_training(ours, theirs, size: dict, device: torch.device, dtype: torch.dtype, repeats: int) -> None:
    batch, seq = size["batch"], size["seq"]
    input_ids = torch.randint(1, size["vocab"], (batch, seq), generator=torch.Generator().manual_seed(2)).to(device)
    steps = {}
    for name, model in (("ours", ours), ("transformers", theirs)):
        model.train()

        def step(model=model):
            model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)  # the gradients of one model only, not both at once
        steps[name] = step
    seconds = fastest_of(steps, device, repeats)
    tokens = batch * seq
    print(f"\ntraining, fwd+bwd, B={batch} T={seq}, {dtype}, {device}")
    if device.type == "cuda":  # both models stay resident, so each peak includes the other's weights
        weights = sum(p.numel() * p.element_size() for m in (ours, theirs) for p in m.parameters()) / 2**30
        print(f"(peaks include both models' weights, {weights:.2f} GiB together)")
    print(f"{'model':<14} {'tok/s':>10} {'peak':>10}")
    for name in steps:
        print(f"{name:<14} {tokens / seconds[name]:>10.0f} {peak_memory(device, steps[name]):>10}")
    print(f"ratio ours / transformers: {seconds['transformers'] / seconds['ours']:.2f}x", flush=True)


def static_cache_bytes(cache: StaticCache) -> dict[str, int]:
    """Bytes held by the cache's layers, by kind: the MLA layers' latent slots, the KDA layers' states."""
    held = {}
    for layer in cache.layers:
        kind = "KDA states" if hasattr(layer, "recurrent_states") else "MLA latents"
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else (value,)
            for tensor in values:  # (a KDA layer keeps its states in dicts by state index)
                if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                    held[kind] = held.get(kind, 0) + tensor.numel() * tensor.element_size()
    return held


def bench_decoding(ours, theirs, size: dict, device: torch.device, dtype: torch.dtype, batches: list[int],
                   repeats: int) -> None:
    prompt, new_tokens = size["prompt"], size["new_tokens"]
    ours.eval()
    theirs.eval()
    print(f"\ndecoding, greedy, prompt {prompt}, {new_tokens} new tokens, {dtype}, {device}: ours with a static cache"
          f"{' (CUDA graph)' if device.type == 'cuda' else ''}, transformers with its default cache")
    print(f"{'batch':>5} {'ours tok/s':>11} {'theirs tok/s':>13} {'ratio':>6} | {'ours prefill':>12} "
          f"{'theirs prefill':>14} {'ratio':>6}")
    input_ids = None
    for batch in batches:
        input_ids = torch.randint(1, size["vocab"], (batch, prompt),
                                  generator=torch.Generator().manual_seed(batch)).to(device)
        try:  # what a user types: a new static cache per call (bound to the graph captured in the warm-up)
            a = measure(ours, input_ids, new_tokens, repeats, cache_implementation="static")
        except RuntimeError as error:  # a failed capture must not cost the rest of a GPU run: say so, go on eagerly
            if ours._graph_decoder is None or device.type != "cuda":
                raise
            print(f"CUDA-graph decoding failed ({str(error).splitlines()[0][:200]}); ours measured without it from "
                  f"here on", flush=True)
            ours.set_cuda_graph_decoding(False)
            a = measure(ours, input_ids, new_tokens, repeats, cache_implementation="static")
        b = measure(theirs, input_ids, new_tokens, repeats)
        print(f"{batch:>5} {a['decode_tok_s']:>11.1f} {b['decode_tok_s']:>13.1f} "
              f"{a['decode_tok_s'] / b['decode_tok_s']:>6.2f} | {a['prefill_tok_s']:>12.0f} "
              f"{b['prefill_tok_s']:>14.0f} {a['prefill_tok_s'] / b['prefill_tok_s']:>6.2f}", flush=True)
    mla = next(i for i, t in enumerate(ours.config.mixer_types) if t == "mla_attention")
    settings = layer_config(ours.config, mla)
    latent, full = cache_bytes_per_token(settings, dtype), full_kv_bytes_per_token(settings, dtype)
    print(f"MLA cache per token and row, one layer: {latent} B latent vs {full} B full keys and values of the same "
          f"heads ({full / latent:.1f}x smaller)")
    if input_ids is not None:  # a static cache as generate makes one for the last batch, filled by its prompt
        cache = StaticCache(config=ours.config, max_cache_len=prompt + new_tokens)
        with torch.no_grad():
            ours(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        held = static_cache_bytes(cache)
        parts = ", ".join(f"{kind} {count / 2**20:.2f} MiB" for kind, count in sorted(held.items()))
        print(f"ours' static cache (batch {batches[-1]}, {prompt + new_tokens} slots): "
              f"{sum(held.values()) / 2**20:.2f} MiB ({parts})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: gpu on CUDA, else tiny")
    parser.add_argument("--decode", type=int, nargs="*", default=[1, 16], help="decoding batch sizes (none: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[args.size or ("gpu" if device.type == "cuda" else "tiny")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    ours, theirs = build_pair(size, device)
    print(f"models: ours {parameters(ours)} params, transformers {parameters(theirs)} params, built and converted in "
          f"{time.perf_counter() - start:.1f} s; experts implementation ours {ours.config._experts_implementation}, "
          f"transformers {theirs.config._experts_implementation}; attention {ours.config._attn_implementation} / "
          f"{theirs.config._attn_implementation}")
    same_weights_line(ours, theirs, size, device)
    ours.to(dtype), theirs.to(dtype)
    if not args.skip_training:
        bench_training(ours, theirs, size, device, dtype, args.repeats)
    if args.decode:
        bench_decoding(ours, theirs, size, device, dtype, args.decode, args.repeats)


if __name__ == "__main__":
    main()
