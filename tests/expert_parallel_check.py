"""Loads a sparse MoE test model with transformers' expert parallelism on the ranks of a torchrun launch
(`DistributedConfig(tp_size=n, ep_size=n)`: each rank holds num_experts / n whole experts, the rest of the model is
tensor parallel as under `tp_plan="auto"`) and compares it with the unsharded model, for each of transformers' token
dispatches (`ep_implementation`: "auto", "all_reduce", "all_to_all") and each experts implementation of the model
(mlp_sparse_moe.EXPERTS_IMPLEMENTATIONS): logits, greedy decoding, the gradient of every parameter after one backward,
and each MoE layer's experts alone (output and input gradients, on the same routed tokens). Every rank must hold
exactly its own experts: num_experts / n of them, the slice [rank * E / n, (rank + 1) * E / n) of the unsharded ones.
Rank 0 prints the largest differences, one line per dispatch.

    torchrun --nproc_per_node 2 tests/expert_parallel_check.py MODEL_DIR [--indivisible DIR] [--cuda]

--indivisible DIR: a model one of whose layers has a num_experts the world size does not divide; loading it must fail
with our ValueError (rank 0 prints it as `INDIVISIBLE <message>`).
--cuda: one GPU per rank over NCCL; otherwise CPUs over gloo. Everything else is the same code path.
"""

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

import hybrid_linear_models  # noqa: F401
from distributed_helpers import leave  # the script's folder is on sys.path
from hybrid_linear_models.mlp_sparse_moe import EXPERTS_IMPLEMENTATIONS
from tensor_parallel_check import HEAD_SPLIT, full

DISPATCHES = ("auto", "all_reduce", "all_to_all")


def load_expert_parallel(path: str, size: int, dispatch: str = "auto"):
    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=size, ep_size=size, ep_implementation=dispatch))


def assert_own_experts(reference, sharded, rank: int, size: int) -> None:
    """Each MoE layer holds num_experts / size whole experts, this rank's slice of the unsharded ones, bit for bit;
    the head-split projections hold half their rows, as under tensor parallelism."""
    for index, (layer, sharded_layer) in enumerate(zip(reference.model.layers, sharded.model.layers)):
        for name in HEAD_SPLIT[layer.layer_type]:
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


def model_differences(reference, sharded, device: torch.device) -> tuple[float, float]:
    """Logits (no_grad), greedy tokens (asserted equal), then every parameter's gradient after one backward."""
    input_ids = torch.randint(0, reference.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(device)
    with torch.no_grad():
        logits = (reference(input_ids).logits - sharded(input_ids).logits).abs().max().item()
    generated = [model.generate(input_ids[:, :12], max_new_tokens=8, do_sample=False) for model in (reference, sharded)]
    assert torch.equal(*generated), "greedy decoding under expert parallelism differs from the unsharded model"
    for model in (reference, sharded):
        model.zero_grad(set_to_none=True)
        model.train()
        model(input_ids, labels=input_ids).loss.backward()
        model.eval()
    sharded_params = dict(sharded.named_parameters())
    gradients = max(
        ((full(sharded_params[name].grad) - param.grad).abs().max() / param.grad.abs().max()).item()
        for name, param in reference.named_parameters()
    )
    return logits, gradients


def compare(path: str, device: torch.device, rank: int, size: int, dispatch: str) -> list[float]:
    """[logits, gradients, experts' outputs, experts' gradients]: the largest differences over the implementations."""
    reference = AutoModelForCausalLM.from_pretrained(path).to(device)
    sharded = load_expert_parallel(path, size, dispatch)
    assert sharded.device == device, (sharded.device, device)
    assert_own_experts(reference, sharded, rank, size)
    worst = [0.0] * 4
    for implementation in EXPERTS_IMPLEMENTATIONS:
        for model in (reference, sharded):
            model.set_experts_implementation(implementation)
        results = (*model_differences(reference, sharded, device), *experts_differences(reference, sharded, device))
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
    parser.add_argument("model")
    parser.add_argument("--indivisible")
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if args.cuda else "gloo")
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {dispatch: compare(args.model, device, rank, size, dispatch) for dispatch in DISPATCHES}
    message = indivisible_error(args.indivisible, size) if args.indivisible else None
    if rank == 0:
        for dispatch, differences in results.items():
            print(f"EP_MAX_DIFFERENCE {dispatch} " + " ".join(str(value) for value in differences))
        if message is not None:
            print(f"INDIVISIBLE {message}")
    torch.distributed.barrier()  # both ranks are done
    leave()


if __name__ == "__main__":
    main()
