#!/usr/bin/env bash
# The sparse MoE model's tensor- and expert-parallel checks on 2 GPUs of one host (NCCL), each against the unsharded
# model on one GPU, in float32 on this package's torch kernels (fla hidden by a stub that fails to import; TF32 off):
#   tests/tensor_parallel_check.py  tp_plan="auto": every expert split along its width over the 2 GPUs
#   tests/expert_parallel_check.py  2 whole experts of 4 per GPU, the rest tensor parallel (DistributedConfig(tp_size=2,
#                                   ep_size=2), each token dispatch) or FSDP2-sharded with a batch per GPU (fsdp_size=2,
#                                   ep_size=2), every experts implementation; and a model whose num_experts 2 does not
#                                   divide, refused
# the scripts tests/test_sparse_moe_distributed.py runs on 2 gloo CPU ranks, with --cuda. Prints the largest
# differences and a verdict per check (the bounds are the gloo test's: expert_parallel_check.py gives their reasons).
#   usage: [GLOO=1] bash benchmarks/two_gpu_moe_parallel.sh [WORKDIR]     (GLOO=1: 2 CPU ranks instead, a dry run;
#   its expert-parallel check runs "tp-all_to_all" alone, the run tests/test_sparse_moe_distributed.py leaves out)
set -uo pipefail
work=${1:-/tmp/two-gpu-moe}
mkdir -p "$work/no_fla/fla"
echo 'raise ImportError("fla hidden by two_gpu_moe_parallel.sh")' > "$work/no_fla/fla/__init__.py"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/tests"
export PYTHONPATH="$work/no_fla:$root${PYTHONPATH:+:$PYTHONPATH}" NVIDIA_TF32_OVERRIDE=0
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
      torch.cuda.device_count(), 'GPUs')"
python3 expert_parallel_check.py --save-models "$work" > /dev/null 2>&1 || { echo "could not write the test models"; exit 1; }
torchrun=(python3 -m torch.distributed.run --nproc_per_node 2 --standalone)
device=(--cuda); [ -n "${GLOO:-}" ] && device=()
runs=(); [ -n "${GLOO:-}" ] && runs=(--runs tp-all_to_all)

echo "== tensor parallelism of the MoE model (tests/tensor_parallel_check.py --cuda): max |logits diff|, max relative gradient diff"
"${torchrun[@]}" tensor_parallel_check.py "$work/moe" "${device[@]}" > "$work/tp.log" 2>&1
if grep MAX_DIFFERENCE "$work/tp.log"; then
  python3 -c "
import sys
logits, gradients = (float(x) for x in open('$work/tp.log').read().split('MAX_DIFFERENCE ')[1].split()[:2])
print('TP_CHECK', 'PASS' if logits <= 1e-4 and gradients <= 1e-4 else 'FAIL (bound 1e-4)')"
else
  echo "TP_CHECK FAIL: the run failed"; grep -v "Warning\|warn" "$work/tp.log" | tail -25
fi

echo "== expert parallelism (tests/expert_parallel_check.py --cuda): per run, max |logits diff|, max relative"
echo "   gradient diff, then the experts alone: max relative output diff, max relative gradient diff"
"${torchrun[@]}" expert_parallel_check.py "$work/moe" --indivisible "$work/odd" "${device[@]}" "${runs[@]}" \
  > "$work/ep.log" 2>&1
if grep -E "^(EP_MAX_DIFFERENCE|INDIVISIBLE|EP_CHECK)" "$work/ep.log"; then :; else
  echo "EP_CHECK FAIL: the run failed"; grep -v "Warning\|warn" "$work/ep.log" | tail -25
fi
