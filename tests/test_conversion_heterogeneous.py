"""Fast-LLM pattern decoders whose blocks differ (issue 14), on checkpoints laid out as Fast-LLM writes them.

The metadata is the real fixture's (hybrid_attn_gdn_kda, written by Fast-LLM) with blocks added in Fast-LLM's own
config shape: a sliding-window block with fewer KV groups, other rotary theta and attention biases; a second, narrower
GDN block with another conv size, norm epsilon, MLP size and MLP biases; a KDA block with a gelu MLP. The tensors are
random, with the shapes of Fast-LLM's parameter definitions written out here (not taken from the converter), in the
`fast_llm` layout (`{name}/weights`, state index, metadata in the safetensors header) and in the `distributed` layout
(one flat buffer; each stage padded to 32 elements; inside a stage, Fast-LLM's definition order stably sorted by
(weight decay, weight decay == tensor-parallel), fast_llm/engine/multi_stage/stage_base.py).

The logits reference is composed layer by layer from homogeneous one-block models: each block alone, as a
`decoder.type: fixed` Fast-LLM checkpoint with the same weights, converted by the homogeneous path that the real
fixtures pin against Fast-LLM's own logits.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hybrid_linear_models  # noqa: F401
from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda"
HIDDEN, VOCAB = 64, 384
PATTERN = ["attn", "sliding", "gdn", "kda", "gdn_narrow", "sliding"]


def _blocks() -> dict:
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
        bias = mixer.get("add_linear_biases", True)
        mqa_split = mixer["head_groups"] > 1
        params += [("mixer.query.weight", (q, h), True, True)] + ([("mixer.query.bias", (q,), False, True)] if bias
                                                                   else [])
        params += [("mixer.key_value.weight", (kv, h), True, mqa_split)] + (
            [("mixer.key_value.bias", (kv,), False, mqa_split)] if bias else [])
        params += [("mixer.dense.weight", (h, q), True, True)] + ([("mixer.dense.bias", (h,), False, False)] if bias
                                                                   else [])
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


@pytest.fixture(scope="module")
def heterogeneous(tmp_path_factory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("heterogeneous")
    blocks = _blocks()
    decoder = {"type": "pattern", "blocks": blocks, "pattern": PATTERN, "num_blocks": len(PATTERN)}
    tensors = write_fast_llm_checkpoint(root, blocks, PATTERN, decoder)
    convert_checkpoint(root / "fast_llm", root / "hf", from_format="fast_llm", to_format="hf")
    return root, blocks, tensors


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_blocks_that_differ_become_defaults_plus_per_layer_overrides(heterogeneous):
    root, _, _ = heterogeneous
    model = HybridLinearForCausalLM.from_pretrained(root / "hf")
    config = model.config
    assert config.layer_types == ["full_attention", "sliding_attention", "gated_deltanet", "kimi_delta_attention",
                                  "gated_deltanet", "sliding_attention"]
    layers = config.per_layer_config
    assert [layers[i].num_key_value_heads for i in (0, 1, 5)] == [2, 1, 1]
    assert layers[1].sliding_window == 3 and layers[1].attention_bias and not layers[0].attention_bias
    assert layers[1].rope_parameters["rope_theta"] == 500.0 and layers[0].rope_parameters["rope_theta"] == 10000.0
    assert (layers[2].gdn_num_value_heads, layers[4].gdn_num_value_heads) == (4, 2)
    assert (layers[4].gdn_value_head_dim, layers[4].gdn_conv_kernel_size, layers[4].gdn_norm_eps) == (24, 3, 1e-6)
    assert [layers[i].intermediate_size for i in range(6)] == [48, 32, 48, 48, 80, 32]
    assert layers[4].mlp_bias and not layers[2].mlp_bias and layers[3].hidden_act == "gelu_pytorch_tanh"
    assert (layers[4].rms_norm_eps, layers[2].rms_norm_eps) == (1e-6, 1e-5)
    # the converted tensors are exactly the model's own parameters, names and shapes
    stored = _hf_tensors(root / "hf")
    assert {k: tuple(v.shape) for k, v in stored.items()} == {k: tuple(v.shape) for k, v in
                                                             model.state_dict().items()}


def _one_block_model(root: Path, blocks: dict, name: str, index: int, tensors: dict) -> HybridLinearForCausalLM:
    """Block `index` alone, as a `fixed` one-block Fast-LLM checkpoint with its weights, converted and loaded."""
    prefix = f"decoder.{index}."
    alone = {k.replace(prefix, "decoder.0.", 1): v for k, v in tensors.items()
             if k.startswith(prefix) or not k.startswith("decoder.")}
    folder = root / f"alone_{index}"
    write_fast_llm_checkpoint(folder, blocks, [name], {"type": "fixed", "block": blocks[name], "num_blocks": 1},
                              alone)
    convert_checkpoint(folder / "fast_llm", folder / "hf", from_format="fast_llm", to_format="hf")
    return HybridLinearForCausalLM.from_pretrained(folder / "hf", torch_dtype=torch.float32).eval()


def test_logits_equal_a_composition_of_homogeneous_one_block_models(heterogeneous, tmp_path):
    root, blocks, tensors = heterogeneous
    model = HybridLinearForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32).eval()
    input_ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    alone = [_one_block_model(tmp_path, blocks, name, i, tensors) for i, name in enumerate(PATTERN)]
    with torch.no_grad():
        logits = model(input_ids).logits
        hidden = alone[0].model.embed_tokens(input_ids)
        for one in alone:
            one.model.norm = torch.nn.Identity()  # the block's output itself
            hidden = one.model(inputs_embeds=hidden).last_hidden_state
        reference = model.lm_head(model.model.norm(hidden))
    # float32, the same kernels on the same shapes layer by layer (measured: 0.0); 1e-4 is the bound
    assert (logits - reference).abs().max().item() <= 1e-4
    assert logits.abs().max().item() > 0.1  # not trivially zero


def test_distributed_reads_the_same_tensors_as_fast_llm(heterogeneous, tmp_path):
    root, _, _ = heterogeneous
    convert_checkpoint(root / "distributed", tmp_path / "hf", from_format="fast_llm_distributed", to_format="hf")
    from_distributed, from_fast_llm = _hf_tensors(tmp_path / "hf"), _hf_tensors(root / "hf")
    assert from_distributed.keys() == from_fast_llm.keys()
    for name, tensor in from_fast_llm.items():
        assert torch.equal(from_distributed[name], tensor), name


def test_the_distributed_order_is_pinned(heterogeneous, tmp_path):
    """Negative control: a buffer laid out in plain definition order (no sort) reads as other tensors, so the
    comparison above really pins Fast-LLM's order for blocks of different shapes."""
    root, blocks, tensors = heterogeneous
    decoder = {"type": "pattern", "blocks": blocks, "pattern": PATTERN, "num_blocks": len(PATTERN)}
    write_fast_llm_checkpoint(tmp_path / "unsorted", blocks, PATTERN, decoder, tensors, sort_stages=False)
    convert_checkpoint(tmp_path / "unsorted" / "distributed", tmp_path / "hf", from_format="fast_llm_distributed",
                       to_format="hf")
    wrong, right = _hf_tensors(tmp_path / "hf"), _hf_tensors(root / "hf")
    assert not torch.equal(wrong["model.layers.4.linear_attn.dt_bias"], right["model.layers.4.linear_attn.dt_bias"])


def test_round_trips_are_bit_exact(heterogeneous, tmp_path):
    root, _, tensors = heterogeneous
    back = convert_checkpoint(root / "hf", tmp_path / "fast_llm", from_format="hf", to_format="fast_llm").destination
    stored = {}
    for file in Path(back).glob("*.safetensors"):
        with safe_open(file, "pt") as opened:
            stored.update({key.removesuffix("/weights"): opened.get_tensor(key) for key in opened.keys()})
    assert stored.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(stored[name], tensor), name
    metadata = yaml.safe_load((Path(back) / "metadata.yaml").read_text())
    decoder = metadata["config"]["base_model"]["decoder"]
    assert len(decoder["blocks"]) == 5 and len(decoder["pattern"]) == 6  # one block per distinct layer setting
    again = convert_checkpoint(back, tmp_path / "hf", from_format="fast_llm", to_format="hf").destination
    first, second = _hf_tensors(root / "hf"), _hf_tensors(Path(again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    a = HybridLinearForCausalLM.from_pretrained(root / "hf").config.to_dict()
    b = HybridLinearForCausalLM.from_pretrained(again).config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        a.pop(key, None), b.pop(key, None)
    assert a == b


@pytest.mark.parametrize("edit, fragments", [
    (lambda blocks: blocks["sliding"]["mixer"].setdefault("dense_layer", {}).update(bias={"enabled": False}),
     ("blocks.sliding.mixer mixes linear layers with and without biases", "dense_layer")),
    (lambda blocks: blocks["gdn_narrow"]["mixer"].update(value_heads=3),
     ("gdn_narrow", "value_heads")),
])
def test_what_is_refused_names_the_block_and_the_field(tmp_path, edit, fragments):
    blocks = _blocks()
    edit(blocks)
    decoder = {"type": "pattern", "blocks": blocks, "pattern": PATTERN, "num_blocks": len(PATTERN)}
    write_fast_llm_checkpoint(tmp_path / "src", _blocks(), PATTERN, decoder)  # tensors of the unedited blocks
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(tmp_path / "src" / "fast_llm", tmp_path / "dst", from_format="fast_llm", to_format="hf")
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)
