"""Fast-LLM checkpoints laid out as Fast-LLM writes them, for tests: a pattern decoder of blocks that differ
in the `fast_llm` format (`{name}/weights`, state index, metadata repeated in the safetensors header) and the
`distributed` format (one flat buffer; each stage padded to 32 elements; inside a stage, Fast-LLM's definition order
stably sorted by (weight decay, weight decay == tensor-parallel), fast_llm/engine/multi_stage/stage_base.py).

The metadata is the real fixture's (hybrid_attn_gdn_kda, written by Fast-LLM) with blocks added in Fast-LLM's own
config shape; the parameter shapes and flags are written out here from Fast-LLM's layer definitions, not taken from
the converter.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

FIXTURE = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda"
HIDDEN, VOCAB = 64, 384
PATTERN = ["attn", "sliding", "gdn", "kda", "gdn_narrow", "sliding"]


def heterogeneous_blocks() -> dict:
    fixture = yaml.safe_load((FIXTURE / "fast_llm" / "metadata.yaml").read_text())
    blocks = fixture["config"]["base_model"]["decoder"]["blocks"]
    sliding = copy.deepcopy(blocks["attn"])
    sliding["mixer"].update(head_groups=1, window_size=3, add_linear_biases=True)
    sliding["mixer"]["rotary"]["theta"] = 500.0
    sliding["mlp"]["intermediate_size"] = 32
    narrow = copy.deepcopy(blocks["gdn"])
    narrow["mixer"].update(key_heads=2, value_heads=2, key_head_dim=8, value_head_dim=24)
    narrow["mixer"]["convolution_layer"] = {"kernel_size": 3}
    narrow["mixer"]["normalization"]["epsilon"] = 1e-6
    narrow["mlp"].update(intermediate_size=80, add_linear_biases=True)
    narrow["normalization"]["epsilon"] = 1e-6
    blocks["kda"]["mlp"]["activation"] = "gelu"
    return {**blocks, "sliding": sliding, "gdn_narrow": narrow}


def _base_model(blocks: dict, decoder: dict) -> dict:
    base = yaml.safe_load((FIXTURE / "fast_llm" / "metadata.yaml").read_text())["config"]["base_model"]
    base["decoder"] = decoder
    return base


# Fast-LLM's parameters of each block type, in definition order: (name, shape, weight decay, tensor-parallel).
def _block_parameters(block: dict) -> list[tuple[str, tuple[int, ...], bool, bool]]:
    mixer, mlp, h = block["mixer"], block["mlp"], HIDDEN
    params = [("norm_1.weight", (h,), False, False), ("norm_2.weight", (h,), False, False)]
    if mixer["type"] == "attention":
        q, kv = mixer["heads"] * mixer["head_size"], 2 * mixer["head_groups"] * mixer["head_size"]
        mqa_split = mixer["head_groups"] > 1
        # each layer's bias.enabled, else add_linear_biases (default true); key_value follows key_layer's config
        # (fast_llm/layers/attention/attention.py)
        bias = {name: mixer.get(f"{name}_layer", {}).get("bias", {}).get("enabled") for name in ("query", "key",
                                                                                                   "dense")}
        bias = {name: mixer.get("add_linear_biases", True) if on is None else on for name, on in bias.items()}
        params += [("mixer.query.weight", (q, h), True, True)] + (
            [("mixer.query.bias", (q,), False, True)] if bias["query"] else [])
        params += [("mixer.key_value.weight", (kv, h), True, mqa_split)] + (
            [("mixer.key_value.bias", (kv,), False, mqa_split)] if bias["key"] else [])
        params += [("mixer.dense.weight", (h, q), True, True)] + (
            [("mixer.dense.bias", (h,), False, False)] if bias["dense"] else [])
    elif mixer["type"] == "gdn":
        hk, hv, dk, dv = mixer["key_heads"], mixer["value_heads"], mixer["key_head_dim"], mixer["value_head_dim"]
        k = mixer.get("convolution_layer", {}).get("kernel_size", 4)
        params += [("mixer.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, h), True, True),
                   ("mixer.in_proj_ba.weight", (2 * hv, h), True, True),
                   ("mixer.convolution.weight", (2 * hk * dk + hv * dv, 1, k), True, True),
                   ("mixer.out_proj.weight", (h, hv * dv), True, True),
                   ("mixer.dt_bias", (hv,), False, True), ("mixer.A_log", (hv,), False, True),
                   ("mixer.norm.weight", (dv,), False, False)]
    else:
        heads, d = mixer["heads"], mixer["head_dim"]
        p, k = heads * d, mixer.get("convolution_layer", {}).get("kernel_size", 4)
        params += [(f"mixer.{n}_proj.weight", (p, h), True, True) for n in "qkv"]
        params += [(f"mixer.{n}_conv.weight", (p, 1, k), True, True) for n in "qkv"]
        params += [("mixer.f_a_proj.weight", (d, h), True, False), ("mixer.f_b_proj.weight", (p, d), True, True),
                   ("mixer.g_a_proj.weight", (d, h), True, False), ("mixer.g_b_proj.weight", (p, d), True, True),
                   ("mixer.beta_proj.weight", (heads, h), True, True), ("mixer.o_proj.weight", (h, p), True, True),
                   ("mixer.dt_bias", (p,), False, True), ("mixer.A_log", (heads,), False, True),
                   ("mixer.norm.weight", (d,), False, False)]
    i, bias = mlp["intermediate_size"], mlp.get("add_linear_biases", True)
    if mlp.get("type") == "moe":  # MLPBase: layer_1 (experts x [gate | up]), layer_2 (transposed); then the router
        experts = mlp.get("experts", 2)
        return params + [("mlp.layer_1.weight", (experts * 2 * i, h), True, True),
                         ("mlp.layer_2.weight", (experts * i, h), True, True),
                         ("mlp.router.weight", (experts, h), True, False)]
    params += [("mlp.layer_1.weight", (2 * i, h), True, True)] + ([("mlp.layer_1.bias", (2 * i,), False, True)]
                                                                  if bias else [])
    params += [("mlp.layer_2.weight", (i, h), True, True)] + ([("mlp.layer_2.bias", (h,), False, False)]
                                                              if bias else [])
    return params


def _value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if name.endswith("norm_1.weight") or name.endswith("norm_2.weight") or "norm" in name:
        return 1.0 + 0.1 * noise
    if name.endswith("A_log"):
        return 0.3 * noise
    if name.endswith("dt_bias"):
        return 1.0 + 0.3 * noise
    return noise * (0.3 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.05)


def _stages(blocks: dict, pattern: list[str], sort: bool = True) -> list[list[str]]:
    """Fast-LLM's stages of a single-rank model, each in buffer order (`sort=False`: definition order, wrong)."""
    def order(params):  # stable sort by (weight decay, weight decay == tensor-parallel)
        return [p[0] for p in (sorted(params, key=lambda p: (p[2], p[2] == p[3])) if sort else params)]

    stages = [["embeddings.word_embeddings_weight"]]
    for index, name in enumerate(pattern):
        stages.append([f"decoder.{index}.{p}" for p in order(_block_parameters(blocks[name]))])
    stages.append(["head.final_norm.weight", "head.output_weights"])
    return stages


def write_fast_llm_checkpoint(root: Path, blocks: dict, pattern: list[str], decoder: dict,
                              tensors: dict[str, torch.Tensor] | None = None, seed: int = 0,
                              sort_stages: bool = True) -> dict:
    """`fast_llm` and `distributed` folders under `root` as Fast-LLM writes them; returns the tensors."""
    generator = torch.Generator().manual_seed(seed)
    if tensors is None:
        tensors = {"embeddings.word_embeddings_weight": 0.5 * torch.randn(VOCAB, HIDDEN, generator=generator)}
        for index, name in enumerate(pattern):
            for param, shape, _, _ in _block_parameters(blocks[name]):
                tensors[f"decoder.{index}.{param}"] = _value(param, shape, generator)
        tensors["head.final_norm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN, generator=generator)
        tensors["head.output_weights"] = torch.randn(VOCAB, HIDDEN, generator=generator) / math.sqrt(HIDDEN)
    fixture = yaml.safe_load((FIXTURE / "fast_llm" / "metadata.yaml").read_text())
    fixture["config"]["base_model"] = _base_model(blocks, decoder)
    header = {key: value if isinstance(value, str) else yaml.safe_dump(value)
              for key, value in {**fixture, "metadata": {}}.items()}
    (root / "fast_llm").mkdir(parents=True)
    save_file({f"{k}/weights": v.contiguous() for k, v in tensors.items()}, root / "fast_llm" / "model_0.safetensors",
              metadata=header)
    fixture["metadata"] = {"state_index": {f"{k}/weights": "model_0.safetensors" for k in sorted(tensors)}}
    (root / "fast_llm" / "metadata.yaml").write_text(yaml.safe_dump(fixture))

    distributed = yaml.safe_load((FIXTURE / "distributed" / "metadata.yaml").read_text())
    distributed["config"]["base_model"] = fixture["config"]["base_model"]
    pieces = []
    for stage in _stages(blocks, pattern, sort_stages):
        flat = torch.cat([tensors[name].flatten() for name in stage])
        pieces += [flat, torch.zeros(-len(flat) % 32)]
    (root / "distributed").mkdir()
    save_file({"weights_shard": torch.cat(pieces)}, root / "distributed" / "rank_0.safetensors",
              metadata={key: value if isinstance(value, str) else yaml.safe_dump(value)
                        for key, value in distributed.items()})
    (root / "distributed" / "metadata.yaml").write_text(yaml.safe_dump(distributed))
    return tensors


__all__ = ["FIXTURE", "HIDDEN", "VOCAB", "PATTERN", "heterogeneous_blocks", "write_fast_llm_checkpoint"]


def pattern_decoder(blocks: dict, pattern: list[str]) -> dict:
    """Fast-LLM's `decoder` config for the named `blocks` laid out as `pattern` (one block per layer)."""
    return {"type": "pattern", "blocks": blocks, "pattern": pattern, "num_blocks": len(pattern)}


def converted_pattern_checkpoint(root: Path, blocks: dict, pattern: list[str]) -> dict:
    """A pattern decoder's `fast_llm` and `distributed` folders under `root` (write_fast_llm_checkpoint) and the
    `fast_llm` one converted to `root / "hf"`; returns the Fast-LLM tensors."""
    from hybrid_linear_models.conversion import convert_checkpoint

    tensors = write_fast_llm_checkpoint(root, blocks, pattern, pattern_decoder(blocks, pattern))
    convert_checkpoint(root / "fast_llm", root / "hf", from_format="fast_llm", to_format="hf")
    return tensors
