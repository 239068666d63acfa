"""`--from fla`: tiny fla checkpoints (fla's tensor names and shapes, a config.json as fla 0.6.0's config classes write
it), converted, must give the logits of a reference forward written here from fla's math over fla's own parameter
layout: separate q/k/v projections and convolutions, the gate -exp(A_log) * softplus(a + dt_bias), beta =
sigmoid(b), a per-token delta-rule loop, the gated RMSNorm, KDA's low-rank f/g projections with g_proj's bias, and
fla's attention (head_dim = hidden_size // heads, full rotate-half rotary, window of `window_size` keys).

No fla import: the layout and config defaults are written from fla's source; tests/test_convert_fla_gpu.py checks
against fla's own model classes where fla and CUDA exist."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fuzz_strategies import FUZZ_SETTINGS, mutated
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.fla import read_fla
from hybrid_linear_models.conversion.name_maps import build_hf_rows
from hybrid_linear_models.conversion.pipeline import plan_conversion
from numerics import assert_close

# fla 0.6.0's config __init__ defaults (GatedDeltaNetConfig / KDAConfig), as its save_pretrained writes them
_COMMON = dict(attn_mode="chunk", hidden_size=2048, use_short_conv=True, allow_neg_eigval=False, conv_size=4,
               num_v_heads=None, max_position_embeddings=2048, hidden_ratio=4, intermediate_size=None,
               hidden_act="swish", norm_eps=1e-6, attn=None, use_cache=True, pad_token_id=None, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False, initializer_range=0.02, fuse_norm=True, fuse_swiglu=True,
               fuse_cross_entropy=True, use_l2warp=False, vocab_size=32000, attnres_block_size=None)
FLA_DEFAULTS = {
    "gated_deltanet": dict(_COMMON, expand_v=2.0, use_gate=True, head_dim=256, num_heads=6, num_hidden_layers=21,
                           fuse_linear_cross_entropy=False, output_gate_activation="swish"),
    "kda": dict(_COMMON, expand_v=1.0, safe_gate=False, lower_bound=None, head_dim=128, num_heads=16,
                num_hidden_layers=24),
}
ARCHITECTURES = {"gated_deltanet": "GatedDeltaNetForCausalLM", "kda": "KDAForCausalLM"}


def fla_config(model_type: str, **overrides) -> dict:
    """config.json as fla writes it: every __init__ field, the attn spec with parse_attention_config's defaults."""
    config = {**FLA_DEFAULTS[model_type], **overrides, "model_type": model_type,
              "architectures": [ARCHITECTURES[model_type]], "transformers_version": "4.57.1", "dtype": "float32"}
    specs = config["attn"] if isinstance(config["attn"], list) else [config["attn"]] if config["attn"] else []
    for spec in specs:
        spec.setdefault("num_kv_heads", spec["num_heads"])
        spec.setdefault("qkv_bias", False)
        spec.setdefault("window_size", None)
        spec.setdefault("rope_theta", 10000.0)
    return config


def _attention_layers(config: dict) -> dict[int, dict]:
    attn = config["attn"]
    specs = attn if isinstance(attn, list) else [attn] if attn else []
    return {layer: spec for spec in specs for layer in spec["layers"]}


def _intermediate(config: dict) -> int:
    if config["intermediate_size"] is not None:
        return config["intermediate_size"]
    size = int(config["hidden_size"] * (config["hidden_ratio"] or 4) * 2 / 3)
    return 256 * ((size + 255) // 256)


def fla_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """fla's parameter names and shapes (GatedDeltaNetForCausalLM / KDAForCausalLM state_dict)."""
    H, V, K = config["hidden_size"], config["vocab_size"], config["conv_size"]
    heads, dk = config["num_heads"], config["head_dim"]
    hv = config["num_v_heads"] or heads
    dv = int(dk * config["expand_v"])
    key_dim, value_dim, inter = heads * dk, hv * dv, _intermediate(config)
    shapes = {"model.embeddings.weight": (V, H)}
    attention = _attention_layers(config)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "attn_norm.weight"] = (H,)
        if i in attention:
            spec = attention[i]
            hd = H // spec["num_heads"]
            kv = spec["num_kv_heads"] * hd
            shapes.update({p + "attn.q_proj.weight": (H, H), p + "attn.k_proj.weight": (kv, H),
                           p + "attn.v_proj.weight": (kv, H), p + "attn.o_proj.weight": (H, H)})
            if spec["qkv_bias"]:  # fla's Attention: q/k/v biases with qkv_bias, never one on o_proj
                shapes.update({p + "attn.q_proj.bias": (H,), p + "attn.k_proj.bias": (kv,),
                               p + "attn.v_proj.bias": (kv,)})
        elif config["model_type"] == "gated_deltanet":
            shapes.update({
                p + "attn.q_proj.weight": (key_dim, H), p + "attn.k_proj.weight": (key_dim, H),
                p + "attn.v_proj.weight": (value_dim, H), p + "attn.a_proj.weight": (hv, H),
                p + "attn.b_proj.weight": (hv, H), p + "attn.A_log": (hv,), p + "attn.dt_bias": (hv,),
                p + "attn.q_conv1d.weight": (key_dim, 1, K), p + "attn.k_conv1d.weight": (key_dim, 1, K),
                p + "attn.v_conv1d.weight": (value_dim, 1, K), p + "attn.g_proj.weight": (value_dim, H),
                p + "attn.o_norm.weight": (dv,), p + "attn.o_proj.weight": (H, value_dim)})
        else:
            shapes.update({
                p + "attn.q_proj.weight": (key_dim, H), p + "attn.k_proj.weight": (key_dim, H),
                p + "attn.v_proj.weight": (value_dim, H), p + "attn.q_conv1d.weight": (key_dim, 1, K),
                p + "attn.k_conv1d.weight": (key_dim, 1, K), p + "attn.v_conv1d.weight": (value_dim, 1, K),
                p + "attn.f_proj.0.weight": (dv, H), p + "attn.f_proj.1.weight": (hv * dk, dv),
                p + "attn.b_proj.weight": (hv, H), p + "attn.A_log": (hv,), p + "attn.dt_bias": (hv * dk,),
                p + "attn.g_proj.0.weight": (dv, H), p + "attn.g_proj.1.weight": (value_dim, dv),
                p + "attn.g_proj.1.bias": (value_dim,), p + "attn.o_norm.weight": (dv,),
                p + "attn.o_proj.weight": (H, value_dim)})
        shapes.update({p + "mlp_norm.weight": (H,), p + "mlp.gate_proj.weight": (inter, H),
                       p + "mlp.up_proj.weight": (inter, H), p + "mlp.down_proj.weight": (H, inter)})
    shapes["model.norm.weight"] = (H,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def fla_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Distinct random values everywhere (norm weights, A_log, dt_bias and the gate bias too), so that a tensor
    mapped to the wrong place, or a convention read wrong, changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in fla_shapes(config).items():
        if name.endswith("A_log"):
            value = torch.rand(shape, generator=generator) * 2 - 1
        elif name.endswith("dt_bias") or name.endswith(".bias"):
            value = 0.5 * torch.randn(shape, generator=generator)
        elif "norm" in name:
            value = 1 + 0.1 * torch.randn(shape, generator=generator)
        elif "conv1d" in name:
            value = 0.4 * torch.randn(shape, generator=generator)
        else:
            value = 0.15 * torch.randn(shape, generator=generator)
        tensors[name] = value
    return tensors


def write_fla_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), {"format": "pt"})
    return path


# ------------------------------------------------------------------------------------------ fla's math, per token


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _l2(x):  # fla's in-kernel l2 norm: x / sqrt(sum x^2 + 1e-6)
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _short_conv(x, weight):
    """fla's ShortConvolution (nn.Conv1d, groups = channels, left padding K - 1) then silu; x [T, C]."""
    K = weight.shape[-1]
    padded = F.pad(x.t()[None], (K - 1, 0))
    return F.silu(F.conv1d(padded, weight, groups=x.shape[1])[0].t())


def _delta_rule(q, k, v, decay, beta):
    """Per-token loop: S <- decay * S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q. q, k [T, Hv, dk] (already
    expanded to value heads), v [T, Hv, dv], decay [T, Hv, dk] (GDN: one value per head, broadcast), beta [T, Hv]."""
    T, Hv, dk = k.shape
    state = torch.zeros(Hv, dk, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(T):
        state = state * decay[t][..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + torch.einsum("hk,hv->hkv", k[t], u)
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out)


def _gdn(x, w, config):
    heads, dk = config["num_heads"], config["head_dim"]
    hv = config["num_v_heads"] or heads
    dv = int(dk * config["expand_v"])
    T = x.shape[0]
    q = _short_conv(x @ w["q_proj.weight"].t(), w["q_conv1d.weight"]).view(T, heads, dk)
    k = _short_conv(x @ w["k_proj.weight"].t(), w["k_conv1d.weight"]).view(T, heads, dk)
    v = _short_conv(x @ w["v_proj.weight"].t(), w["v_conv1d.weight"]).view(T, hv, dv)
    group = hv // heads  # value head j reads key head j // group (fla's i_h = i_hv // (HV // H))
    q = (_l2(q) * dk**-0.5).repeat_interleave(group, dim=1)
    k = _l2(k).repeat_interleave(group, dim=1)
    g = -w["A_log"].exp() * F.softplus(x @ w["a_proj.weight"].t() + w["dt_bias"])
    beta = torch.sigmoid(x @ w["b_proj.weight"].t())
    o = _delta_rule(q, k, v, g.exp()[..., None].expand(T, hv, dk), beta)
    gate = (x @ w["g_proj.weight"].t()).view(T, hv, dv)
    act = torch.sigmoid(gate) if config["output_gate_activation"] == "sigmoid" else F.silu(gate)
    o = _rms(o, w["o_norm.weight"], config["norm_eps"]) * act
    return o.reshape(T, -1) @ w["o_proj.weight"].t()


def _kda(x, w, config):
    heads, dk = config["num_heads"], config["head_dim"]
    T = x.shape[0]
    q = _l2(_short_conv(x @ w["q_proj.weight"].t(), w["q_conv1d.weight"]).view(T, heads, dk)) * dk**-0.5
    k = _l2(_short_conv(x @ w["k_proj.weight"].t(), w["k_conv1d.weight"]).view(T, heads, dk))
    v = _short_conv(x @ w["v_proj.weight"].t(), w["v_conv1d.weight"]).view(T, heads, dk)
    f = (x @ w["f_proj.0.weight"].t() @ w["f_proj.1.weight"].t()).view(T, heads, dk)
    g = -w["A_log"].exp()[:, None] * F.softplus(f + w["dt_bias"].view(heads, dk))
    beta = torch.sigmoid(x @ w["b_proj.weight"].t())
    o = _delta_rule(q, k, v, g.exp(), beta)
    gate = (x @ w["g_proj.0.weight"].t() @ w["g_proj.1.weight"].t() + w["g_proj.1.bias"]).view(T, heads, dk)
    o = _rms(o, w["o_norm.weight"], config["norm_eps"]) * torch.sigmoid(gate)
    return o.reshape(T, -1) @ w["o_proj.weight"].t()


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _attention(x, w, spec, hidden_size):
    heads, kv_heads = spec["num_heads"], spec["num_kv_heads"]
    hd = hidden_size // heads
    T = x.shape[0]
    q, k, v = (F.linear(x, w[f"{n}_proj.weight"], w.get(f"{n}_proj.bias")) for n in "qkv")  # biases: qkv_bias
    q, k, v = q.view(T, heads, hd), k.view(T, kv_heads, hd), v.view(T, kv_heads, hd)
    # fla's RotaryEmbedding: inv_freq, positions and their product in float32 (as transformers' rotary embeddings do),
    # cos and sin of those float32 angles
    inv_freq = 1.0 / (spec["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None].double() for f in (torch.cos, torch.sin))
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    distance = torch.arange(T)[:, None] - torch.arange(T)[None]
    visible = distance >= 0
    if spec["window_size"] is not None:  # flash-attn window (window_size - 1, 0): the query and window_size - 1 keys
        visible &= distance < spec["window_size"]
    scores = scores.masked_fill(~visible, float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return o.reshape(T, -1) @ w["o_proj.weight"].t()


def reference_logits(config: dict, tensors: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """fla's forward for one sequence, float64, from its parameters as stored."""
    w = {name: tensor.double() for name, tensor in tensors.items()}
    eps, attention = config["norm_eps"], _attention_layers(config)
    x = w["model.embeddings.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        mixer = {name[len(p) + 5:]: tensor for name, tensor in w.items() if name.startswith(p + "attn.")}
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        if i in attention:
            x = x + _attention(h, mixer, attention[i], config["hidden_size"])
        elif config["model_type"] == "gated_deltanet":
            x = x + _gdn(h, mixer, config)
        else:
            x = x + _kda(h, mixer, config)
        h = _rms(x, w[p + "mlp_norm.weight"], eps)
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].t()) * (h @ w[p + "mlp.up_proj.weight"].t())) @ w[
            p + "mlp.down_proj.weight"].t()
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embeddings.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.t()


# ------------------------------------------------------------------------------------------------ the tests

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, norm_eps=1e-5)
GDN_CASES = {
    # 4 layers, attention at 1 (full) and 3 (a 5-key window), value heads = 2 x key heads, expand_v 1.5
    "gdn_attn_gva_expand": dict(TINY, num_hidden_layers=4, num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.5,
                                attn=[{"layers": [1], "num_heads": 4, "num_kv_heads": 2, "rope_theta": 500.0},
                                      {"layers": [3], "num_heads": 2, "window_size": 5}]),
    # no attention, value heads = key heads, fla's default expand_v 2, sigmoid output gate, tied embeddings,
    # intermediate size from hidden_ratio, and older fla's elementwise_affine key
    "gdn_tied_sigmoid": dict(TINY, num_hidden_layers=2, num_heads=2, head_dim=8, output_gate_activation="sigmoid",
                             elementwise_affine=True,
                             tie_word_embeddings=True, intermediate_size=None, hidden_ratio=2, conv_size=3),
    # q/k/v biases (qkv_bias) on the attention layer 0 only, none on layer 2's
    "gdn_qkv_bias": dict(TINY, num_hidden_layers=3, num_heads=2, head_dim=8,
                         attn=[{"layers": [0], "num_heads": 2, "qkv_bias": True}, {"layers": [2], "num_heads": 4}]),
    # 4 value heads per key head, one attention layer at 0
    "gdn_ratio4": dict(TINY, num_hidden_layers=3, num_heads=1, num_v_heads=4, head_dim=8, expand_v=0.5,
                       attn={"layers": [0], "num_heads": 2}),
}
KDA_CASES = {
    "kda_attn": dict(TINY, num_hidden_layers=3, num_heads=2, head_dim=8, attn={"layers": [2], "num_heads": 4,
                                                                             "num_kv_heads": 1, "window_size": 4}),
    "kda_only": dict(TINY, num_hidden_layers=2, num_heads=4, head_dim=4, conv_size=2),
}
CASES = {**{name: ("gated_deltanet", c) for name, c in GDN_CASES.items()},
         **{name: ("kda", c) for name, c in KDA_CASES.items()}}


def _convert(tmp_path: Path, model_type: str, overrides: dict, seed: int = 0):
    config = fla_config(model_type, **json.loads(json.dumps(overrides)))
    tensors = fla_tensors(config, seed)
    src = write_fla_checkpoint(tmp_path / "fla", config, tensors)
    convert_checkpoint(src, tmp_path / "hf", from_format="fla", to_format="hf")
    return config, tensors, tmp_path / "hf"


@pytest.mark.parametrize("case", list(CASES))
def test_converted_model_reproduces_flas_math(tmp_path, case):
    model_type, overrides = CASES[case]
    config, tensors, out = _convert(tmp_path, model_type, overrides)
    tokens = torch.randint(0, config["vocab_size"], (11,), generator=torch.Generator().manual_seed(1))
    model = HybridLinearForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(tokens[None]).logits[0]
    # Both sides in float64; they differ only in summation order (our chunked delta rule and fused projections against
    # a per-token loop over fla's separate ones), ~1e-15 relative per operation over a dozen layers of depth: 1e-10
    # leaves a wide margin, while any mapping or convention error (a swapped head, a missing bias, silu for sigmoid)
    # moves the logits by 1e-2 or more.
    assert_close(logits, reference_logits(config, tensors, tokens), 1e-10, case)


def test_mapping_is_a_permutation_of_flas_tensors(tmp_path):
    """Every converted tensor holds exactly the values of fla's tensors (no invented or dropped weight): the multiset
    of values is the same on both sides, and the embeddings and the KDA gate bias arrive unchanged."""
    for model_type, overrides in (CASES["gdn_attn_gva_expand"], CASES["kda_attn"]):
        config, tensors, out = _convert(tmp_path / model_type, model_type, overrides)
        converted = load_file(str(out / "model.safetensors"))
        flat = lambda ts: torch.sort(torch.cat([t.reshape(-1) for t in ts]))[0]  # noqa: E731
        assert torch.equal(flat(converted.values()), flat(tensors.values()))
        assert torch.equal(converted["model.embed_tokens.weight"], tensors["model.embeddings.weight"])
    assert torch.equal(converted["model.layers.0.linear_attn.g_b_proj.bias"],
                       tensors["model.layers.0.attn.g_proj.1.bias"])


def test_config_mapping(tmp_path):
    config, _, out = _convert(tmp_path, *CASES["gdn_attn_gva_expand"])
    hf = json.loads((out / "config.json").read_text())
    assert hf["mixer_types"] == ["gated_deltanet", "full_attention", "gated_deltanet", "sliding_attention"]
    assert hf["layer_types"] == ["linear_attention", "full_attention", "linear_attention", "sliding_attention"]
    assert (hf["gdn_num_key_heads"], hf["gdn_num_value_heads"], hf["gdn_key_head_dim"], hf["gdn_value_head_dim"]) == (
        2, 4, 8, 12)
    assert (hf["attention_output_gate"], hf["attention_qk_norm"], hf["zero_centered_norms"]) == (False, False, False)
    assert hf["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert hf["per_layer_config"]["3"]["num_attention_heads"] == 2 and hf["sliding_window"] == 5
    assert hf["rms_norm_eps"] == hf["gdn_norm_eps"] == 1e-5
    _, _, out = _convert(tmp_path / "kda", *CASES["kda_only"])
    hf = json.loads((out / "config.json").read_text())
    assert (hf["kda_gate_activation"], hf["kda_gate_bias"], hf["kda_conv_kernel_size"]) == ("sigmoid", True, 2)


# ------------------------------------------------------------------------------------------------ bad input


def _refusal(tmp_path: Path, model_type: str, overrides: dict, edit=None, config_edit=None) -> str:
    config = fla_config(model_type, **json.loads(json.dumps(overrides)))
    tensors = fla_tensors(config)
    if edit is not None:
        edit(tensors)
    if config_edit is not None:
        config_edit(config)
    src = write_fla_checkpoint(tmp_path / "fla", config, tensors)
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(src, tmp_path / "out", from_format="fla", to_format="hf")
    message = str(caught.value)
    assert "\n" not in message and len(message) < 700, message
    assert not (tmp_path / "out").exists()
    return message


GDN_SMALL = GDN_CASES["gdn_ratio4"]
UNSUPPORTED = [
    ("gated_deltanet", dict(use_short_conv=False), "use_short_conv = False"),
    ("gated_deltanet", dict(allow_neg_eigval=True), "allow_neg_eigval = True"),
    ("gated_deltanet", dict(use_gate=False), "use_gate = False"),
    ("gated_deltanet", dict(attnres_block_size=2), "attnres_block_size = 2"),
    ("gated_deltanet", dict(elementwise_affine=False), "elementwise_affine = False"),
    ("gated_deltanet", dict(hidden_act="powlu"), "hidden_act = 'powlu'"),
    ("gated_deltanet", dict(num_heads=2, num_v_heads=3), "num_v_heads = 3 is not a multiple of num_heads = 2"),
    ("gated_deltanet", dict(expand_v=0.3), "head_dim * expand_v = 8 * 0.3"),
    ("gated_deltanet", dict(attn={"layers": [0], "num_heads": 2, "qk_norm": True}), "attn.qk_norm = True"),
    ("gated_deltanet", dict(attn={"layers": [0], "num_heads": 3}), "attn.num_heads = 3 does not divide"),
    ("gated_deltanet", dict(attn={"layers": [5], "num_heads": 2}), "outside [0, num_hidden_layers=3)"),
    ("gated_deltanet", dict(attn=[{"layers": [0], "num_heads": 2}, {"layers": [0], "num_heads": 4}]),
     "layer 0 is placed twice"),
    ("gated_deltanet", dict(attn={"layers": [0], "num_heads": 2, "softcap": 30}), "attn.softcap not supported"),
    ("gated_deltanet", dict(rope_scaling={"type": "linear"}), "rope_scaling not supported"),
    ("gated_deltanet", dict(norm_eps=0.0), "norm_eps should be a positive number"),
    ("gated_deltanet", dict(num_hidden_layers=10**6), "num_hidden_layers is 1000000"),
    ("gated_deltanet", dict(hidden_size=10**12), "hidden_size is 1000000000000, more than"),
    ("gated_deltanet", dict(head_dim="8"), "head_dim should be an integer"),
    ("gated_deltanet", dict(expand_v=float("inf")), "config.json: expand_v is inf; JSON has no NaN or infinity"),
    ("kda", dict(num_v_heads=2), "num_v_heads = 2 is not supported"),
    ("kda", dict(expand_v=2.0), "expand_v = 2.0 is not supported"),
    ("kda", dict(safe_gate=True, lower_bound=-5.0), "safe_gate = True"),
    ("kda", dict(lower_bound=-5.0), "lower_bound = -5.0"),
]


@pytest.mark.parametrize("model_type, overrides, expected", UNSUPPORTED,
                         ids=[f"{m}-{next(iter(o))}-{i}" for i, (m, o, _) in enumerate(UNSUPPORTED)])
def test_unsupported_or_hostile_settings_are_refused_naming_them(tmp_path, model_type, overrides, expected):
    base = GDN_SMALL if model_type == "gated_deltanet" else dict(TINY, num_hidden_layers=3, num_heads=1, head_dim=8)
    # the tensors are those of the valid base config, so size checks meet real headers
    valid = fla_config(model_type, **json.loads(json.dumps(base)))
    tensors = fla_tensors(valid)
    config = {**valid, **overrides}
    src = write_fla_checkpoint(tmp_path / "fla", config, tensors)
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(src, tmp_path / "out", from_format="fla", to_format="hf")
    message = str(caught.value)
    assert expected in message and "\n" not in message and len(message) < 700, message
    assert not (tmp_path / "out").exists()


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    layer = "model.layers.1.attn."
    message = _refusal(tmp_path / "a", "gated_deltanet", GDN_SMALL, edit=lambda t: t.pop(layer + "a_proj.weight"))
    assert "missing tensor(s) model.layers.1.attn.a_proj.weight" in message
    message = _refusal(tmp_path / "b", "kda", KDA_CASES["kda_only"],
                       edit=lambda t: t.update({"model.layers.0.attn.o_proj.bias": torch.zeros(32)}))
    assert "model.layers.0.attn.o_proj.bias that its config does not account for" in message
    message = _refusal(tmp_path / "c", "kda", KDA_CASES["kda_only"],
                       edit=lambda t: t.pop("model.layers.1.attn.g_proj.1.bias"))
    assert "missing tensor(s) model.layers.1.attn.g_proj.1.bias" in message
    message = _refusal(tmp_path / "d", "gated_deltanet", GDN_SMALL,
                       edit=lambda t: t.update({layer + "v_conv1d.weight": torch.zeros(16, 1, 3)}))
    assert "model.layers.1.attn.v_conv1d.weight has shape [16, 1, 3]" in message
    message = _refusal(tmp_path / "e", "gated_deltanet", GDN_SMALL,
                       edit=lambda t: t.update({layer + "A_log": torch.zeros(4, dtype=torch.int32)}))
    assert "model.layers.1.attn.A_log' has dtype int32" in message


def test_other_model_types_and_files_are_refused(tmp_path):
    message = _refusal(tmp_path / "a", "gated_deltanet", GDN_SMALL,
                       config_edit=lambda c: c.update(model_type="qwen3_next"))
    assert "model_type 'qwen3_next'; --from fla reads fla's 'gated_deltanet' and 'kda'" in message
    config = fla_config("kda", **KDA_CASES["kda_only"])
    src = write_fla_checkpoint(tmp_path / "b", config, fla_tensors(config))
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated: its header promises more
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(src, tmp_path / "out", from_format="fla", to_format="hf")
    assert "model.safetensors" in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert not (tmp_path / "out").exists()
    (src / "config.json").write_text("{" * 100_000)
    with pytest.raises(ConversionError, match="nests deeper"):
        read_fla(src)


def test_float_widths_follow_flas_rounding():
    """expand_v 1.5 with head_dim 8 gives value heads of 12 (fla: int(head_dim * expand_v)), and a null
    intermediate_size is fla's GatedMLP rounding of 2/3 * hidden_ratio * hidden_size up to a multiple of 256."""
    from hybrid_linear_models.conversion.fla import fla_to_hybrid_config
    config = fla_to_hybrid_config(fla_config("gated_deltanet", **dict(GDN_CASES["gdn_attn_gva_expand"],
                                                                       intermediate_size=None, hidden_ratio=3)), "c")
    assert config.gdn_value_head_dim == 12
    assert config.intermediate_size == 256 * math.ceil(int(32 * 3 * 2 / 3) / 256) == 256


def test_kda_gate_bias_does_not_go_to_fast_llm(tmp_path):
    """Fast-LLM's KDA has no bias on its output gate: a converted fla KDA model is refused by --to fast_llm, naming
    the field, rather than written without its bias."""
    _, _, out = _convert(tmp_path, *CASES["kda_only"])
    with pytest.raises(ConversionError, match=r"layer 0 \(kimi_delta_attention\): kda_gate_bias=True"):
        convert_checkpoint(out, tmp_path / "fast_llm", from_format="hf", to_format="fast_llm")
    assert not (tmp_path / "fast_llm").exists()


# ------------------------------------------------------------------------------------------------ --to fla


@pytest.mark.parametrize("case", ["gdn_attn_gva_expand", "gdn_tied_sigmoid", "kda_attn", "gdn_qkv_bias"])
def test_round_trip_fla_hf_fla_is_bit_identical(tmp_path, case):
    """fla -> hf -> fla gives fla's tensors back byte for byte, under fla's names, and a config.json that reads as the
    same model; the written folder holds what fla's save_pretrained writes (config.json, safetensors)."""
    config, tensors, out = _convert(tmp_path, *CASES[case])
    back = tmp_path / "back"
    convert_checkpoint(out, back, from_format="hf", to_format="fla")
    assert sorted(p.name for p in back.iterdir()) == ["config.json", "model.safetensors"]
    written = load_file(str(back / "model.safetensors"))
    assert written.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name].view(torch.uint8),
                                                                   tensor.contiguous().view(torch.uint8)), name
    from hybrid_linear_models.conversion.fla import fla_to_hybrid_config
    again = json.loads((back / "config.json").read_text())
    assert fla_to_hybrid_config(again, "back").to_dict() == fla_to_hybrid_config(config, "src").to_dict()
    assert again["model_type"] == config["model_type"] and again["architectures"] == config["architectures"]


def test_models_fla_cannot_express_are_refused_naming_the_first_misfit(tmp_path):
    from model_helpers import tiny_model
    cases = [
        (dict(layer_types=["gated_deltanet", "kimi_delta_attention"]), "mixes gated_deltanet and kimi_delta_attention"),
        (dict(layer_types=["gated_deltanet", "full_attention"]), "zero_centered_norms=True"),
        (dict(layer_types=["kimi_delta_attention"], zero_centered_norms=False), "kda_gate_bias=False"),
        (dict(layer_types=["gated_deltanet", "full_attention"], zero_centered_norms=False, attention_output_gate=False,
              attention_qk_norm=False, num_attention_heads=4, head_dim=16,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         "layer 1 (full_attention): rope_parameters="),
        (dict(layer_types=["gated_deltanet", "gated_deltanet"], zero_centered_norms=False,
              per_layer_config={1: {"gdn_num_value_heads": 2}}), "layer 1 (gated_deltanet): gdn_num_value_heads=2"),
        # attention_bias alone (q/k/v) is fla's qkv_bias; an o_proj bias (attention_output_bias follows it) is not
        (dict(layer_types=["gated_deltanet", "full_attention"], zero_centered_norms=False, attention_output_gate=False,
              attention_qk_norm=False, num_attention_heads=4, head_dim=16, attention_bias=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}),
         "layer 1 (full_attention): attention_output_gate, attention_qk_norm and attention_output_bias must be False"),
        (dict(layer_types=["gated_deltanet", "gated_deltanet"], zero_centered_norms=False,
              mlp_types=["dense", "sparse_moe"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
         "layer 1 (gated_deltanet): mlp_types[1]='sparse_moe'"),
    ]
    for index, (overrides, expected) in enumerate(cases):
        src = tmp_path / f"hf{index}"
        tiny_model(**overrides).save_pretrained(src)
        with pytest.raises(ConversionError, match=re.escape(expected)):
            convert_checkpoint(src, tmp_path / f"fla{index}", from_format="hf", to_format="fla")
        assert not (tmp_path / f"fla{index}").exists()


def test_command_line_converts_fla_with_its_tokenizer_and_shards(tmp_path, capsys):
    """The front end: --from fla --to hf, sharded output (streamed, one file per shard), the one-line summary and
    the tokenizer files saved beside the fla checkpoint copied along; a bad checkpoint is one error line, exit 1."""
    from hybrid_linear_cli import convert as front_end
    from model_helpers import word_tokenizer

    model_type, overrides = CASES["kda_only"]
    config = fla_config(model_type, **overrides)
    src = write_fla_checkpoint(tmp_path / "fla", config, fla_tensors(config))
    word_tokenizer(["the", "cat", "sat"]).save_pretrained(src)
    code = front_end.main(["--from", "fla", "--to", "hf", str(src), str(tmp_path / "hf"), "--max-shard-size", "20kB"])
    printed = capsys.readouterr().out
    assert code == 0 and "from fla to hf" in printed and "No tokenizer" not in printed, printed
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    (src / "config.json").write_text(json.dumps({**config, "use_short_conv": "yes"}))
    code = front_end.main(["--from", "fla", "--to", "hf", str(src), str(tmp_path / "hf2")])
    error = capsys.readouterr().err
    assert code == 1 and error.count("\n") == 1 and "use_short_conv should be true or false" in error, error


def test_fla_output_matches_its_registration_and_force_replaces_it(tmp_path):
    """What --to fla writes (one file or shards) is what its catalogue entry declares, so --force can replace it;
    a folder holding anything else is left alone."""
    from hybrid_linear_models.conversion import FORMATS

    _, _, out = _convert(tmp_path, *CASES["gdn_ratio4"])
    layout = FORMATS["fla"].output
    dst = tmp_path / "dst"
    for shard in ("5GB", "2kB"):
        convert_checkpoint(out, dst, from_format="hf", to_format="fla", max_shard_size=shard, force=True)
        names = [p.name for p in dst.iterdir()]
        assert all(layout.writes(name) for name in names) and (dst / layout.marker).is_file(), names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1  # the sharded output replaced the single file
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="notes.txt"):
        convert_checkpoint(out, dst, from_format="hf", to_format="fla", force=True)
    assert (dst / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------------ fuzzing


@pytest.fixture(scope="module")
def fla_folder(tmp_path_factory):
    """A GDN checkpoint with attention layers (the richest config: attn specs, GVA, expand_v)."""
    config = fla_config("gated_deltanet", **json.loads(json.dumps(GDN_CASES["gdn_attn_gva_expand"])))
    return write_fla_checkpoint(tmp_path_factory.mktemp("fla") / "fla", config, fla_tensors(config)), config


@settings(FUZZ_SETTINGS, max_examples=40)  # a conversion plan per example: 40 keep this file's time small
@given(data=st.data())
def test_fuzz_fla_config_json(fla_folder, data):
    """A mutated config.json (a key dropped, a value replaced by a hostile one, a junk key): reading and planning
    either succeed or raise one ConversionError line, within the deadline; never another exception."""
    folder, config = fla_folder
    (folder / "config.json").write_text(json.dumps(data.draw(mutated(config))), encoding="utf-8")
    try:
        source = read_fla(folder)
        plan_conversion(source, build_hf_rows(source.config))
    except ConversionError as error:
        assert str(error) and "\n" not in str(error), str(error)
