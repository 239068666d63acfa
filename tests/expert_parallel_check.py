"""Loads a sparse MoE test model with transformers' expert parallelism on the ranks of a torchrun launch (each rank
holds num_experts / n whole experts) and compares it with the unsharded model. The runs (RUNS): the rest of the model
tensor parallel as under `tp_plan="auto"` (`DistributedConfig(tp_size=n, ep_size=n)`), once per token dispatch of
transformers (`ep_implementation`: "auto", "all_reduce", "all_to_all"), and sharded by FSDP2 with each rank holding
its own rows of the batch (`DistributedConfig(fsdp_size=n, ep_size=n)`). Each run, for each experts implementation of
the model (mlp_sparse_moe.EXPERTS_IMPLEMENTATIONS): logits, greedy decoding, the gradient of every parameter after one
backward, and each MoE layer's experts alone (outputs and input gradients, on the same routed tokens). Every rank must
hold exactly its own experts: num_experts / n of them, the slice [rank * E / n, (rank + 1) * E / n) of the unsharded
ones. Rank 0 prints the largest differences, one line per run.

    python tests/expert_parallel_check.py --save-models DIR     (DIR/moe, the checked model; DIR/odd, --indivisible's)
    torchrun --nproc_per_node 2 tests/expert_parallel_check.py MODEL_DIR [--indivisible DIR] [--cuda] [--runs RUN ...]

--indivisible DIR: a model one of whose layers has a num_experts the world size does not divide; loading it must fail
with our ValueError (rank 0 prints it as `INDIVISIBLE <message>`).
--cuda: one GPU per rank over NCCL (TF32 off: float32 products); otherwise CPUs over gloo. Everything else is the same
code path. Rank 0 ends with `EP_CHECK PASS` or `EP_CHECK FAIL <what>` (the bounds below).
"""

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

import hybrid_linear_models  # noqa: F401
from distributed_helpers import leave  # the script's folder is on sys.path
from hybrid_linear_models.mlp_sparse_moe import EXPERTS_IMPLEMENTATIONS
from model_helpers import tiny_model
from tensor_parallel_check import HEAD_SPLIT, full

# Bounds, float32 (relative to the largest magnitude, but logits absolute, as tensor_parallel_check.py's).
# The experts alone (each MoE layer's experts on the same routed tokens): the all-reduce dispatch computes each expert's
# rows as the unsharded model and splits only the sum over a token's k experts between the ranks (measured on the CPU:
# 0); the all-to-all dispatch applies the routing weights after down_proj and sums in another order (measured 3e-7):
# a few float32 ulps either way, where a wrong sentinel (a skipped route computed, another rank's expert, an unwritten
# row) is an O(1) error.
EXPERTS_BOUND = 1e-6
# The whole model: its non-expert parts are tensor parallel (the dense plan), whose row-parallel sums over 2 ranks round
# differently: tensor_parallel_check.py's bound. Measured on the CPU: 4.5e-5 (logits), 3.1e-5 (relative gradients; the
# same model under tensor parallelism alone: 3.0e-5 and 3.3e-5). Under FSDP2 each rank runs its own rows, whose
# per-rank GEMM shapes and the averaging of the gradients over the ranks round differently too: 1.8e-5 and 1.8e-5.
MODEL_BOUND = 1e-4

# the checked model: sparse MoE layers of 4 experts beside a dense one, with attention, GDN and KDA (head dims of 16,
# which fla's kernels would take too); the indivisible one: its layer 2 has 3 experts, which 2 ranks cannot split
LAYERS = ["full_attention", "gated_deltanet", "kimi_delta_attention", "full_attention"]
MOE = dict(mlp_types=["sparse_moe", "dense", "sparse_moe", "sparse_moe"], num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=24, gdn_value_head_dim=16)


def save_models(folder: str) -> tuple[str, str]:
    """Writes the checked model to folder/moe and the indivisible one to folder/odd; returns their paths."""
    model, odd = os.path.join(folder, "moe"), os.path.join(folder, "odd")
    tiny_model(LAYERS, **MOE).save_pretrained(model)
    tiny_model(LAYERS, **MOE, per_layer_config={2: {"num_experts": 3}}).save_pretrained(odd)
    return model, odd


def failures(differences: list[float]) -> list[str]:
    """What exceeds its bound in one run's [logits, gradients, experts' outputs, experts' gradients]."""
    bounds = (MODEL_BOUND, MODEL_BOUND, EXPERTS_BOUND, EXPERTS_BOUND)
    names = ("logits", "gradients", "experts' outputs", "experts' gradients")
    return [f"{name} {value:.3g} > {bound:g}" for name, value, bound in zip(names, differences, bounds)
            if not value <= bound]


# The runs: name -> the DistributedConfig sizes and token dispatch. "tp-*": tp_size = ep_size = ranks, the non-expert
# parts tensor parallel and every rank holding the same batch (each dispatch in turn); "fsdp-auto": fsdp_size = ep_size
# = ranks, the non-expert parts sharded by FSDP2 and each rank holding its own rows of the batch ("auto" then
# exchanges the tokens all-to-all; "all_reduce" needs a shared batch).
RUNS = {
    "tp-auto": ("tp_size", "auto"), "tp-all_reduce": ("tp_size", "all_reduce"),
    "tp-all_to_all": ("tp_size", "all_to_all"), "fsdp-auto": ("fsdp_size", "auto"),
}


def load_expert_parallel(path: str, size: int, run: str = "tp-auto"):
    layout, dispatch = RUNS[run]
    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(**{layout: size}, ep_size=size, ep_implementation=dispatch))


def assert_own_experts(reference, sharded, rank: int, size: int, tensor_parallel: bool) -> None:
    """Each MoE layer holds num_experts / size whole experts, this rank's slice of the unsharded ones, bit for bit;
    under tensor parallelism the head-split projections hold their share of the rows."""
    for index, (layer, sharded_layer) in enumerate(zip(reference.model.layers, sharded.model.layers)):
        for name in HEAD_SPLIT[layer.mixer_type] if tensor_parallel else ():
            weight = sharded_layer.get_submodule(name).weight
            assert weight.to_local().shape[0] * size == full(weight).shape[0], (index, name, weight.to_local().shape)
        if not hasattr(layer.mlp, "experts"):
            continue
        experts, local = layer.mlp.experts, sharded_layer.mlp.experts
        count = experts.num_experts // size
        assert local.num_experts == count and local._is_expert_parallel, (index, local.num_experts)
        for name in ("gate_up_proj", "down_proj"):
            whole, shard = getattr(experts, name), getattr(local, name).to_local()
            assert shard.shape == (count, *whole.shape[1:]), (index, name, shard.shape, whole.shape)
            assert torch.equal(shard, whole[rank * count:(rank + 1) * count]), (index, name, "not this rank's experts")


def experts_differences(reference, sharded, device: torch.device) -> tuple[float, float]:
    """Each MoE layer's experts alone, on the same tokens routed by the unsharded router: the largest difference of
    the outputs (no_grad) and of the input and routing-weight gradients (relative to the largest gradient)."""
    outputs = gradients = 0.0
    generator = torch.Generator().manual_seed(1)
    for layer, sharded_layer in zip(reference.model.layers, sharded.model.layers):
        if not hasattr(layer.mlp, "experts"):
            continue
        x = torch.randn(24, reference.config.hidden_size, generator=generator).to(device)
        _, weights, index = layer.mlp.gate(x)
        results = []
        for experts in (layer.mlp.experts, sharded_layer.mlp.experts):
            with torch.no_grad():
                output = experts(x, index, weights)
            inputs, routing = x.clone().requires_grad_(), weights.detach().clone().requires_grad_()
            experts(inputs, index, routing).pow(2).sum().backward()
            results.append((output, inputs.grad, routing.grad))
        (output, x_grad, w_grad), (sharded_output, sharded_x_grad, sharded_w_grad) = results
        outputs = max(outputs, ((sharded_output - output).abs().max() / output.abs().max()).item())
        gradients = max(gradients, ((sharded_x_grad - x_grad).abs().max() / x_grad.abs().max()).item(),
                        ((sharded_w_grad - w_grad).abs().max() / w_grad.abs().max()).item())
    return outputs, gradients


def model_differences(reference, sharded, device: torch.device, rows: slice) -> tuple[float, float]:
    """Logits (no_grad) and greedy tokens (asserted equal) of this rank's `rows` of the batch, then every parameter's
    gradient after one backward of the loss of those rows (the reference: of the whole batch; rows of equal length,
    so the ranks' mean losses average to its mean, as FSDP averages the gradients)."""
    input_ids = torch.randint(0, reference.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(device)
    mine = input_ids[rows]
    # the gradients cleared first, as a training step does: FSDP2 keeps its root's parameters (norm, lm_head)
    # unsharded after a forward without gradients, and zero_grad would then miss the sharded ones (their gradients
    # would accumulate)
    for model in (reference, sharded):
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = (reference(mine).logits - sharded(mine).logits).abs().max().item()
    # min_new_tokens: no early stop, so the ranks run the same number of steps (their collectives pair up)
    generated = [model.generate(mine[:, :12], max_new_tokens=6, min_new_tokens=6, do_sample=False)
                 for model in (reference, sharded)]
    assert torch.equal(*generated), "greedy decoding under expert parallelism differs from the unsharded model"
    for model, batch in ((reference, input_ids), (sharded, mine)):
        model.train()
        model(batch, labels=batch).loss.backward()
        model.eval()
    sharded_params = dict(sharded.named_parameters())
    gradients = max(
        ((full(sharded_params[name].grad) - param.grad).abs().max() / param.grad.abs().max()).item()
        for name, param in reference.named_parameters()
    )
    return logits, gradients


def compare(path: str, device: torch.device, rank: int, size: int, run: str) -> list[float]:
    """[logits, gradients, experts' outputs, experts' gradients]: the largest differences over the implementations."""
    reference = AutoModelForCausalLM.from_pretrained(path).to(device)
    sharded = load_expert_parallel(path, size, run)
    assert sharded.device == device, (sharded.device, device)
    tensor_parallel = RUNS[run][0] == "tp_size"
    assert_own_experts(reference, sharded, rank, size, tensor_parallel)
    rows = slice(None) if tensor_parallel else slice(rank * 4 // size, (rank + 1) * 4 // size)
    worst = [0.0] * 4
    for implementation in EXPERTS_IMPLEMENTATIONS:
        for model in (reference, sharded):
            model.set_experts_implementation(implementation)
        results = (*model_differences(reference, sharded, device, rows),
                   *experts_differences(reference, sharded, device))
        worst = [max(a, b) for a, b in zip(worst, results)]
    return worst


def indivisible_error(path: str, size: int) -> str:
    try:
        load_expert_parallel(path, size)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{path}: a num_experts the expert-parallel size does not divide loaded without an error")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("--indivisible")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--save-models", metavar="DIR")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="default: all")
    args = parser.parse_args()
    if args.save_models:
        print(*save_models(args.save_models))
        return
    if args.cuda:  # float32 products, as on the CPU (cuDNN's convolutions default to TF32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if args.cuda else "gloo")
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {run: compare(args.model, device, rank, size, run) for run in args.runs}
    message = indivisible_error(args.indivisible, size) if args.indivisible else None
    if rank == 0:
        for run, differences in results.items():
            print(f"EP_MAX_DIFFERENCE {run} " + " ".join(str(value) for value in differences))
        if message is not None:
            print(f"INDIVISIBLE {message}")
        problems = [f"{run}: {problem}" for run, differences in results.items()
                    for problem in failures(differences)]
        print("EP_CHECK " + ("FAIL " + "; ".join(problems) if problems else "PASS"))
    torch.distributed.barrier()  # both ranks are done
    leave()


if __name__ == "__main__":
    main()
