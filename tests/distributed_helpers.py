"""What the torchrun test scripts and their tests share."""

import os
import sys


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
