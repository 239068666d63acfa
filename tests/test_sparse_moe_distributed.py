"""Sparse MoE layers on 2 ranks (gloo on the CPU; benchmarks/two_gpu_finetune.sh and two_gpu_moe_parallel.sh run the
same scripts over NCCL): FSDP2 training reproduces one process of the same global batch, transformers'
tensor-parallel plan (experts split along their width, partial outputs summed by "moe_tp_experts") and its
expert-parallel plan (each rank holding num_experts / 2 whole experts, DistributedConfig(tp_size=2, ep_size=2))
reproduce the unsharded model."""

from __future__ import annotations

import copy
import functools
import json
import os

import pytest
import torch

from expert_parallel_check import EXPERTS_BOUND, MODEL_BOUND, RUNS, save_models
from hybrid_linear_models.mlp_sparse_moe import EXPERTS_IMPLEMENTATIONS, check_expert_parallel_size
from distributed_helpers import reported, run_script
from model_helpers import replay_graphs_eagerly, tiny_config, tiny_model
from numerics import assert_close

MOE = dict(mlp_types=["sparse_moe", "dense", "sparse_moe", "sparse_moe"], num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=24)


def _losses(*args, ranks: int = 1) -> list[float]:
    line = next(line for line in run_script(*args, ranks=ranks).splitlines() if line.startswith("LOSSES "))
    return json.loads(line.removeprefix("LOSSES "))


@pytest.mark.slow  # two torchrun ranks
def test_fsdp2_training_of_a_moe_model_matches_one_process():
    single = _losses("distributed_parity.py", "--batch", "8", "--moe")
    sharded = _losses("distributed_parity.py", "--batch", "4", "--moe", "--fsdp", ranks=2)
    assert len(single) == len(sharded) == 6
    # float32: the first step's loss is the same mean of the same per-token losses, summed in another order (two
    # ranks' means of 4 documents averaged, against one mean of 8): equal up to a few roundings of a float32 sum
    # (measured: identical on one machine, 1 ulp apart on another); steps 2-3 (whose losses follow the updates of
    # every parameter, the sharded 3-D experts included) differ only by the order of the gradient sums over ranks
    # (~1e-7). Later steps are not compared: top-k routing is discontinuous, so once Adam (lr 3e-3) has grown those
    # 1e-7 differences, a token near a tie between two experts may switch expert in one run and not the other
    # (measured: DDP and FSDP2 agree bit for bit with each other and drift from one process by 1.4e-4 at step 4)
    ulp = torch.finfo(torch.float32).eps * abs(single[0])
    assert abs(sharded[0] - single[0]) <= 4 * ulp
    torch.testing.assert_close(torch.tensor(sharded[:3]), torch.tensor(single[:3]), rtol=1e-5, atol=1e-5)
    assert single[2] < single[0]


@pytest.mark.slow  # two torchrun ranks
def test_tensor_parallel_plan_shards_the_experts(tmp_path):
    tiny_model(["full_attention", "gated_deltanet", "kimi_delta_attention", "full_attention"], **MOE).save_pretrained(
        tmp_path)
    out = run_script("tensor_parallel_check.py", tmp_path, ranks=2)  # asserts the experts' halves, greedy tokens
    logits, gradients = (float(x) for x in reported(out, "MAX_DIFFERENCE"))
    # float32; the experts' and MLPs' row-parallel sums are split over 2 ranks (measured 2.3e-5 / 5.2e-5)
    assert logits <= 1e-4 and gradients <= 1e-4


# ------------------------------------------------------------------------------------------------ expert parallelism

def _rank_experts(experts: torch.nn.Module, rank: int, ranks: int) -> torch.nn.Module:
    """What transformers' "grouped_gemm" style leaves on `rank`: experts [rank * E / ranks, (rank + 1) * E / ranks)
    as plain tensors, num_experts = E / ranks, the expert-parallel flag set; the model config (the implementation)
    shared."""
    local = copy.copy(experts)
    local._parameters = dict(experts._parameters)
    count = experts.num_experts // ranks
    for name in ("gate_up_proj", "down_proj"):
        whole = getattr(experts, name)
        local._parameters[name] = torch.nn.Parameter(whole.detach()[rank * count:(rank + 1) * count].clone())
    local.num_experts, local._is_expert_parallel = count, True
    return local


@functools.cache
def _one_moe_layer(device: str) -> torch.nn.Module:
    """A model of one sparse MoE layer of 4 experts on `device`, built once (each test sets its experts
    implementation)."""
    return tiny_model(["full_attention"], mlp_types=["sparse_moe"], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=0).to(device)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
@pytest.mark.parametrize("routing", ["spread", "all_on_rank_0"])
def test_experts_split_over_ranks_sum_to_the_whole(implementation, routing, device):
    # transformers' all-reduce dispatch (AllReduceEP), written out for 2 ranks in one process: each rank gets every
    # token with the routes to the other rank's experts given the sentinel local id E / 2 and weight 0; the ranks'
    # outputs are summed, as are their gradients of the shared inputs. Reference: the unsharded experts.
    # "all_on_rank_0": rank 1 receives sentinels only (empty groups; every row is skipped by its grouped GEMMs). On
    # CUDA the rows the grouped GEMMs skip are left unwritten (garbage, NaN at times), which the sentinel must mask.
    model = _one_moe_layer(device)
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    tokens, k, count = 13, 2, 2
    x = torch.randn(tokens, 64, generator=generator).to(device)
    pool = count if routing == "all_on_rank_0" else 4
    index = torch.stack([torch.randperm(pool, generator=generator)[:k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, k, generator=generator).to(device)

    def run(module, index, weights):
        inputs, routing_weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        output = module(inputs, index, routing_weights)
        (output * torch.linspace(-1, 1, output.numel(), device=device).view_as(output)).sum().backward()
        return output.detach(), inputs.grad, routing_weights.grad, [module.gate_up_proj.grad, module.down_proj.grad]

    whole = run(experts, index, weights)
    parts = []
    for rank in range(2):
        off_rank = index // count != rank
        local_index = torch.where(off_rank, count, index % count)
        part = run(_rank_experts(experts, rank, 2), local_index, weights.masked_fill(off_rank, 0.0))
        # a route to the other rank's experts contributes nothing here, not even to its routing weight's gradient
        assert torch.isfinite(part[2]).all() and not part[2][off_rank].any(), (implementation, rank)
        parts.append(part)
    # float32: each rank computes its experts' rows as the whole does; the sum over a token's k experts is split
    # between the ranks and completed by the all-reduce, another summation order: a few ulps (~1e-7 relative), where
    # a wrong sentinel (a skipped route computed, a foreign expert's rows, a garbage row) is an O(1) error. On CUDA,
    # cuBLAS picks its GEMM kernels (and their order of summation over the 64 / 16 products) by the row count, which
    # differs between a rank and the whole: ~1e-6 there, hence 1e-5
    tolerance = 1e-6 if device == "cpu" else 1e-5
    for position, what in ((0, "output"), (1, "input gradient"), (2, "routing-weight gradient")):
        assert_close(parts[0][position] + parts[1][position], whole[position], tolerance, f"{implementation}: {what}")
    for name, rank_grads, whole_grad in zip(("gate_up_proj", "down_proj"), zip(parts[0][3], parts[1][3]), whole[3]):
        assert_close(torch.cat(rank_grads), whole_grad, tolerance, f"{implementation}: {name} gradient")


def test_expert_parallel_size_must_divide_num_experts():
    config = tiny_config(["full_attention", "gated_deltanet"], mlp_types=["sparse_moe", "sparse_moe"], num_experts=4,
                         num_experts_per_tok=2, per_layer_config={1: {"num_experts": 6}})
    check_expert_parallel_size(config, 2)  # 4 and 6 experts: 2 and 3 per rank
    check_expert_parallel_size(config, 1)
    with pytest.raises(ValueError) as error:
        check_expert_parallel_size(config, 4)
    message = str(error.value)
    assert "\n" not in message and "layer 1's num_experts" in message and "num_experts=6" in message, message
    assert "ep_size=4" in message and "per_layer_config[1].num_experts" in message, message
    # the plan's patterns shard every `experts` module by name, Kimi's MoE layers' too: checked alike
    kimi = tiny_config(["full_attention", "gated_deltanet"], mlp_types=["dense", "kimi_moe"], num_experts=6,
                       num_experts_per_tok=2)
    with pytest.raises(ValueError, match="layer 1's num_experts"):
        check_expert_parallel_size(kimi, 4)


@pytest.mark.parametrize("sizes, dispatch, captured", [
    ({"tp_size": 2}, "auto", True), ({"tp_size": 2}, "all_reduce", True), ({"tp_size": 2}, "all_to_all", False),
    ({"fsdp_size": 2}, "auto", False),  # different batches per rank: "auto" exchanges tokens all-to-all
])
def test_graph_decoding_captures_only_host_sync_free_expert_dispatches(monkeypatch, sizes, dispatch, captured):
    # CUDA-graph decoding (stood in on the CPU) captures the step when the expert-parallel dispatch is the all-reduce
    # one, and otherwise decodes eagerly: the all-to-all reads its split sizes on the host, which capture refuses.
    # The distributed config is only recorded here (transformers records it so on a sharded model), no ranks run.
    from transformers import DistributedConfig

    graphs = replay_graphs_eagerly(monkeypatch)
    model = tiny_model(["gated_deltanet", "full_attention"], mlp_types=["sparse_moe", "dense"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=0)
    model.config.distributed_config = DistributedConfig(**sizes, ep_size=2, ep_implementation=dispatch)
    with torch.no_grad():
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert bool(graphs) == captured, (sizes, dispatch, len(graphs))


def check_expert_parallel_plan(folder, runs, cuda: bool = False, env=None) -> None:
    """expert_parallel_check.py's `runs` on 2 ranks (gloo CPUs, or NCCL GPUs with `cuda`), its results asserted
    against the bounds it declares (their reasons are there)."""
    model, odd = save_models(str(folder))
    # expert_parallel_check.py asserts each rank's experts and the greedy tokens
    out = run_script("expert_parallel_check.py", model, "--indivisible", odd, "--runs", *runs,
                     *(["--cuda"] if cuda else []), ranks=2, env=env)
    differences = {line.split()[1]: [float(x) for x in line.split()[2:]]
                   for line in out.splitlines() if line.startswith("EP_MAX_DIFFERENCE ")}
    assert set(differences) == set(runs), out
    for run, (logits, gradients, experts, experts_gradients) in differences.items():
        assert experts <= EXPERTS_BOUND and experts_gradients <= EXPERTS_BOUND, (run, experts, experts_gradients)
        assert logits <= MODEL_BOUND and gradients <= MODEL_BOUND, (run, logits, gradients)
    assert "EP_CHECK PASS" in out, out
    message = next(line for line in out.splitlines() if line.startswith("INDIVISIBLE ")).removeprefix("INDIVISIBLE ")
    assert "layer 2's num_experts" in message and "num_experts=3" in message and "ep_size=2" in message, message


@pytest.mark.slow  # two torchrun ranks
def test_expert_parallel_plan_holds_each_ranks_experts(tmp_path):
    # "tp-all_to_all" (the all-to-all dispatch at inference, the tensor-parallel ranks sharing the batch) is left to
    # the GPU check and to two_gpu_moe_parallel.sh's gloo dry run (tests/test_benchmarks_run.py) for time: "tp-auto"
    # trains through it and "fsdp-auto" also decodes through it
    check_expert_parallel_plan(tmp_path, ["tp-auto", "tp-all_reduce", "fsdp-auto"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_expert_parallel_plan_on_two_gpus(tmp_path):
    # the same check over NCCL, on this package's float32 torch kernels: fla hidden by a stub that fails to import
    # (benchmarks/two_gpu_moe_parallel.sh does the same, and runs the tensor-parallel check of this model too), TF32
    # off in cuBLAS and cuDNN
    stub = tmp_path / "no_fla" / "fla"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("fla hidden by the expert-parallel check")\n')
    path = os.pathsep.join([str(stub.parent), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            os.environ.get("PYTHONPATH", "")])
    check_expert_parallel_plan(tmp_path, list(RUNS), cuda=True, env={**os.environ, "PYTHONPATH": path,
                                                         "NVIDIA_TF32_OVERRIDE": "0"})
