"""What the torchrun test scripts and their tests share."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
SUBPROCESS_TIMEOUT = 900  # ends a hang only: two ranks importing torch on a loaded 2-core machine take minutes


def run_script(script: str, *args, ranks: int = 1, env: dict | None = None) -> str:
    """The stdout of the test script `script` (in tests/) run with `args` in a subprocess, on one process or on 2
    torchrun ranks (`ranks=2`: gloo on CPUs), with `env` or this checkout's package; asserts that it succeeded."""
    command = [*(TORCHRUN if ranks == 2 else [sys.executable]), script, *map(str, args)]
    if env is None:  # this checkout's package, whatever is installed
        path = os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=TESTS,
                            check=False, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def reported(out: str, key: str) -> list[str]:
    """The fields after `key` on the first line of a script's output that starts with it ("MAX_DIFFERENCE 1e-5 2e-5":
    ["1e-5", "2e-5"])."""
    return next(line for line in out.splitlines() if line.startswith(key + " ")).split()[1:]


def leave() -> None:
    """Exits at once. Destroying gloo/DDP objects (when a script's locals go, or at interpreter shutdown) sometimes
    hangs, about 1 run in 10 here; the work is done and flushed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# A heterogeneous model for the distributed tests: two GDN blocks of different head counts, a sliding block with its
# own heads, head dim, window and theta (no output gate, no q/k norm), a full block (Qwen3-Next's gated attention with
# q/k norms), KDA with other heads and conv size, MLP widths and biases that differ. Every head count divides by 2, so
# under tensor parallelism each layer splits its own heads over 2 ranks.
HETEROGENEOUS_TYPES = ["gated_deltanet", "sliding_attention", "gated_deltanet", "full_attention",
                       "kimi_delta_attention"]
HETEROGENEOUS = {
    0: {"gdn_num_key_heads": 2, "gdn_num_value_heads": 2, "gdn_value_head_dim": 16, "intermediate_size": 48},
    1: {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3,
        "rope_parameters": {"rope_theta": 500.0}, "attention_output_gate": False, "attention_qk_norm": False},
    2: {"gdn_num_key_heads": 4, "gdn_num_value_heads": 8, "gdn_key_head_dim": 8},
    4: {"kda_num_heads": 4, "kda_head_dim": 8, "kda_conv_kernel_size": 3, "mlp_bias": True},
}
