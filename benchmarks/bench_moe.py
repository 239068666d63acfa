"""Sparse MoE speed, ours vs transformers' Qwen3-Next and Kimi-Linear with the same weights, side by side in one run.

Two measurements, forward + backward (the training step), float32 on CPU, bfloat16 on CUDA:
1. the MoE block alone (router + experts + shared expert) for every experts implementation, ours
   (`HybridLinearSparseMoeBlock`) and transformers' `Qwen3NextSparseMoeBlock` with the same weights; ours
   (`HybridLinearKimiMoeBlock`, "kimi_moe") and transformers' `KimiLinearMoE` likewise; the routing
   overhead (router + permutation + un-permutation, without the expert GEMMs) as a share of the step;
2. the whole model: `HybridLinearForCausalLM` against `Qwen3NextForCausalLM` (GDN + gated attention, MoE MLPs) with
   the same weights copied by name, each with its default experts implementation and with transformers' eager.
Prints tokens/s, the ratios against transformers' eager experts, and peak memory on CUDA.

    python benchmarks/bench_moe.py                    # CPU, the small config (2 threads unless --threads)
    python benchmarks/bench_moe.py --size gpu         # CUDA: a ~1B-active model (16 layers, 64 experts top-8)
    python benchmarks/bench_moe.py --skip-model       # the blocks only
    python benchmarks/bench_moe.py --blocks kimi_moe  # Kimi-Linear's block only (--n-group 4: grouped routing)
    python benchmarks/bench_moe.py --cpu-time         # CPU shared with other work: 1 thread, CPU time
    python benchmarks/bench_moe.py --decode 1 16      # and greedy decoding of the whole models, batch 1 and 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import KimiLinearConfig, Qwen3NextConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import synchronize, timed  # noqa: E402

from hybrid_linear_models import experts_grouped_gather  # noqa: E402
from hybrid_linear_models.mlp_sparse_moe import EXPERTS_IMPLEMENTATIONS, HybridLinearSparseMoeBlock  # noqa: E402

# MoE shapes: Qwen3-Next's ratios (many narrow experts, top-8 or 10, a shared expert as wide as one expert)
SIZES = {
    "cpu": dict(hidden=256, experts=64, top_k=8, expert_width=64, shared_width=64, batch=2, seq=1024,
                layers=4, vocab=4096),
    "cpu128": dict(hidden=256, experts=128, top_k=8, expert_width=64, shared_width=64, batch=2, seq=1024,
                   layers=4, vocab=4096),
    # a ~1B-active model: 16 layers 3:1 GDN:attention, 64 experts top-8, Qwen3-Next's mixer shapes (GDN 16
    # key / 32 value heads of 128, attention 16 heads / 2 KV heads of 256: the shapes of bench_generation's GDN model,
    # so fla's tuning is shared)
    "gpu": dict(hidden=2048, experts=64, top_k=8, expert_width=512, shared_width=512, batch=4, seq=4096,
                layers=16, vocab=32000, heads=16, kv_heads=2, head_dim=256, gdn_key_heads=16, gdn_value_heads=32,
                gdn_dim=128),
    "tiny": dict(hidden=64, experts=8, top_k=2, expert_width=32, shared_width=32, batch=2, seq=64,
                 layers=4, vocab=256),
}


# The clock: wall time, except on a CPU shared with other work (--cpu-time), where the process's CPU time (one thread)
# counts the work of the step and not the time other processes held the cores.
CLOCK = {"clock": time.perf_counter}


def fastest_of(steps: dict, device: torch.device, repeats: int, warmup: int = 1) -> dict:
    """Seconds of each `steps[name]()` (forward + backward): the fastest of `repeats` runs, the candidates taken in
    turn (round robin) so that a load from other processes falls on them alike; the minimum is the least disturbed
    figure of a step that does the same work every time."""
    times = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            _, seconds = timed(step, device, CLOCK["clock"])
            if i >= warmup:
                times[name].append(seconds)
    return {name: min(values) for name, values in times.items()}


def peak_memory(device: torch.device, step) -> str:
    if device.type != "cuda":
        return "-"
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"


def moe_config(size: dict, implementation: str) -> Qwen3NextConfig:
    config = Qwen3NextConfig(hidden_size=size["hidden"], num_experts=size["experts"],
                             num_experts_per_tok=size["top_k"], moe_intermediate_size=size["expert_width"],
                             shared_expert_intermediate_size=size["shared_width"], norm_topk_prob=True)
    config._experts_implementation = implementation
    return config


def expert_gemms_step(block: HybridLinearSparseMoeBlock, x: torch.Tensor):
    """The expert GEMMs alone, fwd+bwd, on token rows already grouped by expert (the routing of `x` computed once,
    outside the step): gate_up grouped GEMM, activation and routing weight, down grouped GEMM."""
    with torch.no_grad():
        flat_x = x.reshape(-1, x.shape[-1])
        _, weights, experts = block.gate(flat_x)
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True)[1]
        counts = torch.bincount(flat, minlength=block.experts.num_experts)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = flat_x[order // experts.shape[1]].detach().requires_grad_()
        row_weights = weights.reshape(-1, 1)[order].to(x.dtype)
        grad = torch.randn_like(rows)  # a given output gradient: no loss over the k-fold rows in the timing
    linear = experts_grouped_gather._grouped_linear

    def step():
        projected = linear(rows, block.experts.gate_up_proj, offsets)
        linear(block.experts._apply_gate(projected) * row_weights, block.experts.down_proj, offsets).backward(grad)
    return step


def shared_expert_step(block: nn.Module, x: torch.Tensor):
    """The shared expert and its gate alone, fwd+bwd (Qwen3-Next's block); Kimi's block: its ungated shared
    experts."""
    grad = torch.randn_like(x).reshape(-1, x.shape[-1])

    def step():
        flat_x = x.reshape(-1, x.shape[-1])
        if hasattr(block, "shared_experts"):
            block.shared_experts(flat_x).backward(grad)
        else:
            (torch.sigmoid(block.shared_expert_gate(flat_x)) * block.shared_expert(flat_x)).backward(grad)
    return step


def bench_block(size: dict, device: torch.device, dtype: torch.dtype, repeats: int) -> None:
    torch.manual_seed(0)
    reference = Qwen3NextSparseMoeBlock(moe_config(size, "eager")).to(device, dtype)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.02)
    title = (f"MoE block (Qwen3-Next's), fwd+bwd, {size['batch'] * size['seq']} tokens, {size['experts']} experts "
             f"top-{size['top_k']}, hidden {size['hidden']}, expert width {size['expert_width']}, shared "
             f"{size['shared_width']}, {dtype}, {device}")
    compare_blocks(title, size, device, dtype, repeats, reference.state_dict(),
                   ours=lambda implementation: HybridLinearSparseMoeBlock(moe_config(size, implementation)),
                   theirs=lambda implementation: Qwen3NextSparseMoeBlock(moe_config(size, implementation)))


def kimi_configs(size: dict, implementation: str, n_group: int):
    """(ours, transformers' KimiLinearConfig) of a Kimi-Linear MoE block of `size`: sigmoid routing with the released
    model's scaling factor, one shared expert as wide as an expert, `n_group` groups (top half kept)."""
    from hybrid_linear_models import HybridLinearConfig

    routing = dict(n_group=n_group, topk_group=max(1, n_group // 2), routed_scaling_factor=2.446, norm_topk_prob=True,
                   num_experts_per_tok=size["top_k"], moe_intermediate_size=size["expert_width"], n_shared_experts=1)
    theirs = KimiLinearConfig(hidden_size=size["hidden"], num_local_experts=size["experts"], **routing)
    ours = HybridLinearConfig(hidden_size=size["hidden"], layer_types=["gated_deltanet"], mlp_types=["kimi_moe"],
                              num_experts=size["experts"], **routing)
    for config in (theirs, ours):
        config._experts_implementation = implementation
    return ours, theirs


def bench_kimi_block(size: dict, device: torch.device, dtype: torch.dtype, repeats: int, n_group: int) -> None:
    from hybrid_linear_models.mlp_kimi_moe import HybridLinearKimiMoeBlock

    torch.manual_seed(0)
    reference = KimiLinearMoE(kimi_configs(size, "eager", n_group)[1]).to(device, dtype)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.02)
    reference.gate.e_score_correction_bias.normal_(0, 0.01)
    title = (f"MoE block (Kimi-Linear's: sigmoid router, bias-corrected choice, {n_group} group(s)), fwd+bwd, "
             f"{size['batch'] * size['seq']} tokens, {size['experts']} experts top-{size['top_k']}, hidden "
             f"{size['hidden']}, expert width {size['expert_width']}, 1 shared expert, {dtype}, {device}")
    compare_blocks(title, size, device, dtype, repeats, reference.state_dict(),
                   ours=lambda implementation: HybridLinearKimiMoeBlock(kimi_configs(size, implementation, n_group)[0],
                                                                        0),
                   theirs=lambda implementation: KimiLinearMoE(kimi_configs(size, implementation, n_group)[1]))


def compare_blocks(title: str, size: dict, device: torch.device, dtype: torch.dtype, repeats: int, state: dict,
                   ours, theirs) -> None:
    """Ours (`ours(implementation)`) and transformers' block (`theirs(implementation)`), `state` loaded into both,
    for every experts implementation, in one timed round robin; a table of tokens/s and ratios against transformers'
    eager experts and against transformers' same implementation, and the routing's share of our default's step."""
    tokens = size["batch"] * size["seq"]
    x = torch.randn(size["batch"], size["seq"], size["hidden"], device=device, dtype=dtype, requires_grad=True)
    print(f"\n{title}")
    steps, blocks = {}, {}
    for implementation in EXPERTS_IMPLEMENTATIONS:
        gathered_bytes = tokens * size["top_k"] * 3 * size["hidden"] * size["expert_width"] * x.element_size()
        if implementation == "batched_mm" and gathered_bytes > 2**28:
            continue  # it gathers one expert matrix per (token, expert) pair: GiBs, which would slow the next steps
        blocks["ours", implementation] = ours(implementation).to(device, dtype)
        if implementation != "grouped_mm_gather":  # registered in transformers' table, theirs would run ours
            blocks["theirs", implementation] = theirs(implementation).to(device, dtype)
    for block in blocks.values():
        block.load_state_dict(state)  # (float32 router tensors are cast to the block's dtype, both sides alike)
    for key, block in blocks.items():
        def step(block=block):
            block(x).float().square().mean().backward()
        steps[key] = step
    default = ("ours", EXPERTS_IMPLEMENTATIONS[0])
    steps["expert GEMMs"] = expert_gemms_step(blocks[default], x)
    if getattr(blocks[default], "shared_expert", None) is not None or getattr(
            blocks[default], "shared_experts", None) is not None:
        steps["shared expert"] = shared_expert_step(blocks[default], x)
    seconds = fastest_of(steps, device, repeats)
    print(f"{'implementation':<20} {'ours tok/s':>12} {'transformers tok/s':>19} {'ours / tf eager':>16} "
          f"{'ours / tf same':>15} {'peak ours':>10}")
    for implementation in EXPERTS_IMPLEMENTATIONS:
        if ("ours", implementation) not in seconds:
            print(f"{implementation:<20} skipped (would gather > 256 MiB of expert matrices, one per (token, expert))")
            continue
        ours_s, theirs_s = seconds["ours", implementation], seconds.get(("theirs", implementation))
        print(f"{implementation:<20} {tokens / ours_s:>12.0f} "
              f"{(f'{tokens / theirs_s:.0f}' if theirs_s else '-'):>19} "
              f"{seconds['theirs', 'eager'] / ours_s:>15.2f}x "
              f"{(f'{theirs_s / ours_s:.2f}x' if theirs_s else '-'):>15} "
              f"{peak_memory(device, steps['ours', implementation]):>10}")
    # routing = the block's step less its expert GEMMs and its shared expert, each timed alone in the same run
    routing = seconds[default] - seconds["expert GEMMs"] - seconds.get("shared expert", 0.0)
    print(f"{default[1]} step {seconds[default] * 1e3:.2f} ms: expert GEMMs {seconds['expert GEMMs'] * 1e3:.2f} ms, "
          f"shared expert {seconds.get('shared expert', 0.0) * 1e3:.2f} ms, routing (router + permutation + "
          f"un-permutation, fwd+bwd, the rest) {routing * 1e3:.2f} ms = {100 * routing / seconds[default]:.0f}% "
          f"of the step")


def model_pair(size: dict):
    """Ours and transformers' Qwen3-Next: GDN layers and one gated attention layer in four, every MLP sparse MoE."""
    from hybrid_linear_models import HybridLinearConfig

    layers = size["layers"]
    types = ["full_attention" if (i + 1) % 4 == 0 else "gated_deltanet" for i in range(layers)]
    heads = size.get("heads", max(2, size["hidden"] // 256))
    common = dict(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["expert_width"],
                  num_attention_heads=heads, num_key_value_heads=size.get("kv_heads", max(1, heads // 4)),
                  head_dim=size.get("head_dim", 64), rms_norm_eps=1e-6,
                  num_experts=size["experts"], num_experts_per_tok=size["top_k"],
                  moe_intermediate_size=size["expert_width"], shared_expert_intermediate_size=size["shared_width"],
                  norm_topk_prob=True)
    gdn = dict(key_heads=size.get("gdn_key_heads", heads), value_heads=size.get("gdn_value_heads", 2 * heads),
               dim=size.get("gdn_dim", 64))
    ours = HybridLinearConfig(**common, layer_types=types, mlp_types=["sparse_moe"] * layers,
                              gdn_num_key_heads=gdn["key_heads"], gdn_num_value_heads=gdn["value_heads"],
                              gdn_key_head_dim=gdn["dim"], gdn_value_head_dim=gdn["dim"])
    theirs = Qwen3NextConfig(
        **common, num_hidden_layers=layers,
        layer_types=["linear_attention" if t == "gated_deltanet" else t for t in types],
        linear_num_key_heads=gdn["key_heads"], linear_num_value_heads=gdn["value_heads"],
        linear_key_head_dim=gdn["dim"], linear_value_head_dim=gdn["dim"], decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=dict(ours.rope_parameters))
    return ours, theirs


def bench_model(size: dict, device: torch.device, dtype: torch.dtype, repeats: int) -> None:
    from transformers import Qwen3NextForCausalLM

    from hybrid_linear_models import HybridLinearForCausalLM

    ours_config, theirs_config = model_pair(size)
    torch.manual_seed(0)
    theirs = Qwen3NextForCausalLM(theirs_config).to(device, dtype)
    ours = HybridLinearForCausalLM(ours_config).to(device, dtype)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=False)
    if missing or unexpected:
        raise SystemExit(f"names differ: missing {missing[:4]}, unexpected {unexpected[:4]}")
    tokens = size["batch"] * size["seq"]
    input_ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)
    print(f"\nWhole model, fwd+bwd, {size['layers']} layers (GDN, 1 in 4 gated attention), every MLP MoE, "
          f"{tokens} tokens, {dtype}, {device}")
    print(f"{'model':<28} {'experts':<18} {'tok/s':>10} {'/ tf eager':>11} {'peak':>10}")
    rows = [("Qwen3NextForCausalLM", theirs, "eager"), ("Qwen3NextForCausalLM", theirs, "grouped_mm"),
            ("HybridLinearForCausalLM", ours, "eager"), ("HybridLinearForCausalLM", ours, "grouped_mm"),
            ("HybridLinearForCausalLM", ours, EXPERTS_IMPLEMENTATIONS[0])]
    steps = {}
    for name, model, implementation in rows:
        def step(model=model, implementation=implementation):
            model.set_experts_implementation(implementation)
            model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        steps[name, implementation] = step
    seconds = fastest_of(steps, device, repeats)
    reference = seconds["Qwen3NextForCausalLM", "eager"]
    for (name, implementation), value in seconds.items():
        print(f"{name:<28} {implementation:<18} {tokens / value:>10.0f} {reference / value:>10.2f}x "
              f"{peak_memory(device, steps[name, implementation]):>10}")
    return ours, theirs


def bench_decode(ours, theirs, device: torch.device, batches: list[int], prompt: int, new_tokens: int,
                 repeats: int) -> None:
    """Greedy decoding of the same model pair: ours with a static cache (one-token steps replayed from a captured
    CUDA graph on CUDA, experts through the graph-safe grouped_mm_gather), transformers with its default cache and
    its default experts implementation (and eager experts)."""
    from bench_generation import measure

    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
        model.eval()
    ours.set_experts_implementation(EXPERTS_IMPLEMENTATIONS[0])
    print(f"\nDecoding, prompt {prompt}, {new_tokens} new tokens, greedy, {next(ours.parameters()).dtype}, {device}")
    print(f"{'batch':>5} {'ours tok/s':>11} {'tf grouped_mm':>14} {'tf eager':>9} {'ours/grouped':>13} "
          f"{'ours/eager':>11}")
    for batch in batches:
        input_ids = torch.randint(1, ours.config.vocab_size, (batch, prompt),
                                  generator=torch.Generator().manual_seed(batch)).to(device)
        # what a user types: a new static cache per call (bound to the graph captured in the warm-up on CUDA)
        a = measure(ours, input_ids, new_tokens, repeats, cache_implementation="static")["decode_tok_s"]
        theirs.set_experts_implementation("grouped_mm")
        b = measure(theirs, input_ids, new_tokens, repeats)["decode_tok_s"]
        theirs.set_experts_implementation("eager")
        c = measure(theirs, input_ids, new_tokens, repeats)["decode_tok_s"]
        print(f"{batch:>5} {a:>11.1f} {b:>14.1f} {c:>9.1f} {a / b:>12.2f}x {a / c:>10.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: gpu on CUDA, else cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-model", action="store_true", help="the MoE block only")
    parser.add_argument("--decode", type=int, nargs="*", default=[], metavar="BATCH",
                        help="also time greedy decoding of the whole models at these batch sizes (e.g. 1 16)")
    parser.add_argument("--prompt", type=int, default=512, help="decoding: prompt length")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoding: new tokens")
    parser.add_argument("--blocks", choices=("all", "qwen3_next", "kimi_moe"), default="all",
                        help="which MoE blocks to compare: Qwen3-Next's sparse MoE, Kimi-Linear's, or both")
    parser.add_argument("--n-group", type=int, default=1,
                        help="kimi_moe: expert groups (Kimi-Linear's release: 1); the top half are kept per token")
    parser.add_argument("--cpu-time", action="store_true",
                        help="CPU: time by the process's CPU time on one thread (a machine shared with other work)")
    args = parser.parse_args()
    if args.cpu_time:
        args.threads, CLOCK["clock"] = 1, time.process_time
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[args.size or ("gpu" if device.type == "cuda" else "cpu")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.blocks in ("all", "qwen3_next"):
        bench_block(size, device, dtype, args.repeats)
    if args.blocks in ("all", "kimi_moe"):
        bench_kimi_block(size, device, dtype, args.repeats, args.n_group)
    if not args.skip_model and args.blocks != "kimi_moe":
        ours, theirs = bench_model(size, device, dtype, args.repeats)
        if args.decode:
            bench_decode(ours, theirs, device, args.decode, args.prompt, args.new_tokens, max(1, args.repeats // 2))


if __name__ == "__main__":
    main()
