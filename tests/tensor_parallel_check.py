"""Loads test models with transformers' tensor parallelism (`tp_plan="auto"`) on the ranks of a torchrun launch and
compares each with the unsharded model: logits, greedy decoding (each rank caching its own heads), then the gradient
of every parameter after one backward. Every layer's head-split projections must hold half of their rows on each of
2 ranks (each layer by its own head counts: a heterogeneous model's layers differ).
Rank 0 prints the largest differences, one line per model.

    torchrun --nproc_per_node 2 tests/tensor_parallel_check.py MODEL_DIR [MODEL_DIR ...] [--indivisible DIR] [--cuda]

--indivisible DIR: a model one of whose layers has a head count the tensor-parallel size does not divide; its first
forward must fail with our ValueError (rank 0 prints it as `INDIVISIBLE <message>`).
--cuda: one GPU per rank over NCCL (fla's kernels need head dims of at least 16); otherwise CPUs over gloo.
"""

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

import hybrid_linear_models  # noqa: F401
from distributed_helpers import leave  # the script's folder is on sys.path

# per layer type, the projections split by heads (colwise: each rank holds its heads' rows); "a|b": whichever the
# layer has
HEAD_SPLIT = {
    "full_attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "sliding_attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gated_deltanet": ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"),
    "kimi_delta_attention": ("linear_attn.q_proj", "linear_attn.k_proj", "linear_attn.v_proj", "linear_attn.b_proj"),
    # the query projection a layer has (full rank or the LoRA's second half), and the latent's expansion
    "mla_attention": ("self_attn.q_proj|self_attn.q_b_proj", "self_attn.kv_b_proj"),
}


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def compare(path: str, device: torch.device, size: int) -> tuple[float, float]:
    reference = AutoModelForCausalLM.from_pretrained(path).to(device)
    sharded = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    assert sharded.device == device, (sharded.device, device)
    for index, layer in enumerate(sharded.model.layers):
        for names in HEAD_SPLIT[layer.mixer_type]:
            name = next(name for name in names.split("|") if _has(layer, name))
            weight = layer.get_submodule(name).weight
            assert weight.to_local().shape[0] * size == full(weight).shape[0], (index, name, weight.to_local().shape)
        if hasattr(layer.mlp, "experts"):  # sparse MoE layers: every expert split along its width
            experts = layer.mlp.experts
            assert experts.gate_up_proj.to_local().shape[1] * size == full(experts.gate_up_proj).shape[1]
            assert experts.down_proj.to_local().shape[2] * size == full(experts.down_proj).shape[2]

    input_ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits = (reference(input_ids).logits - sharded(input_ids).logits).abs().max().item()
    generated = [model.generate(input_ids[:, :12], max_new_tokens=8, do_sample=False) for model in (reference, sharded)]
    assert torch.equal(*generated), "greedy decoding with per-rank caches differs from the unsharded model"
    for model in (reference, sharded):
        model.train()
        model(input_ids, labels=input_ids).loss.backward()
    sharded_params = dict(sharded.named_parameters())
    gradients = max(
        ((full(sharded_params[name].grad) - param.grad).abs().max() / param.grad.abs().max()).item()
        for name, param in reference.named_parameters()
    )
    return logits, gradients


def indivisible_error(path: str, device: torch.device) -> str:
    sharded = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    try:
        with torch.no_grad():
            sharded(torch.tensor([[1, 2, 3]], device=device))
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{path}: a head count the tensor-parallel size does not divide ran without an error")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--indivisible")
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if args.cuda else "gloo")
    size = torch.distributed.get_world_size()
    results = [compare(path, device, size) for path in args.models]
    message = indivisible_error(args.indivisible, device) if args.indivisible else None
    if torch.distributed.get_rank() == 0:
        for logits, gradients in results:
            print(f"MAX_DIFFERENCE {logits} {gradients}")
        if message is not None:
            print(f"INDIVISIBLE {message}")
    torch.distributed.barrier()  # both ranks are done
    leave()


if __name__ == "__main__":
    main()
