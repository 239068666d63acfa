"""LoRA targets exported at the package top level (`lora_target_modules`, `lora_target_parameters`): they name exactly
what the config's model has (every linear projection of its mixers and MLPs, the routed experts' stacked weights),
README's peft snippet runs as written, and `hybrid-linear-finetune --lora` adapts the routed experts of a MoE model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from model_helpers import tiny_model, word_tokenizer
from safetensors.torch import load_file
from torch import nn

import hybrid_linear_models
from hybrid_linear_models import lora_target_modules, lora_target_parameters
from hybrid_linear_models.mixer_registry import MIXERS
from hybrid_linear_models.mlp_registry import MLPS

peft = pytest.importorskip("peft")

README = Path(__file__).resolve().parents[1] / "README.md"
EXPERT_WEIGHTS = ["experts.gate_up_proj", "experts.down_proj"]
LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"]


def _model(mlp: str, layers: list[str] = LAYERS):
    return tiny_model(layers, mlp_types=[mlp] * len(layers)).float()


def test_the_targets_are_exported_at_the_top_level():
    assert {"lora_target_modules", "lora_target_parameters"} <= set(hybrid_linear_models.__all__)


@pytest.mark.parametrize("mlp", list(MLPS))
def test_the_targets_name_what_the_model_has(mlp):
    model = _model(mlp)
    modules, parameters = lora_target_modules(model.config), lora_target_parameters(model.config)
    linear = {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert modules and set(modules) <= linear
    assert "lm_head" not in modules and "embed_tokens" not in modules
    # every projection a registration names, where the model has it as a linear layer, is a target
    registered = {name for registry in (MIXERS, MLPS) for spec in registry.values() for name in spec.lora_targets}
    assert set(modules) == registered & linear
    stacked = {".".join(name.split(".")[-2:]) for name, p in model.named_parameters() if p.ndim == 3
               and ".mlp." in name}
    assert set(parameters) == stacked
    assert (parameters == EXPERT_WEIGHTS) == (mlp != "dense"), parameters


def _readme_peft_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    snippets = [block for block in blocks if "get_peft_model" in block]
    assert len(snippets) == 1, "README should show one peft snippet"
    return snippets[0]


@pytest.mark.parametrize("mlp", ["dense", "sparse_moe", "kimi_moe"])
def test_the_readme_peft_snippet_runs_and_adapts_the_experts(mlp):
    model = _model(mlp)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(input_ids).logits
    namespace = {"model": model}
    exec(compile(_readme_peft_snippet(), "README.md", "exec"), namespace)  # noqa: S102 (the project's own README)
    adapted = namespace["model"]
    assert isinstance(adapted, peft.PeftModel)
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    adapted_projections = {name.split(".lora_")[0].rpartition(".")[2] for name in trainable}
    assert set(lora_target_modules(model.config)) <= adapted_projections
    assert any("experts" in name for name in trainable) == (mlp != "dense")
    with torch.no_grad():  # a fresh adapter (B = 0) leaves the model as it was; a trained one changes it
        torch.testing.assert_close(adapted(input_ids).logits, base, rtol=0, atol=0)
        for name, p in adapted.named_parameters():
            if "lora_B" in name and "experts" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        assert (adapted(input_ids).logits - base).abs().max() > 1e-4 or mlp == "dense"


@pytest.mark.slow
def test_finetune_lora_adapts_the_routed_experts(tmp_path, capsys):
    from hybrid_linear_cli.finetune import main

    folder = tmp_path / "model"
    words = ["the", "cat", "sat", "on", "mat"]
    _model("sparse_moe", ["gated_deltanet", "full_attention"]).save_pretrained(folder)
    word_tokenizer(words).save_pretrained(folder)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(words[i:] + words[:i])}) + "\n" for i in range(5)))
    status = main([str(folder), str(data), str(tmp_path / "adapter"), "--lora", "--lora_rank", "2", "--max_steps",
                   "1", "--per_device_train_batch_size", "2", "--save_strategy", "no"])
    assert status == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == sorted(EXPERT_WEIGHTS)
    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    # peft nests one wrapper per adapted parameter: two adapters (lora_A, lora_B) per expert weight and MoE layer
    expert_adapters = [name for name in weights if ".mlp.experts." in name and ".lora_A." in name]
    assert len(expert_adapters) == len(EXPERT_WEIGHTS) * 2, list(weights)
    assert "experts.gate_up_proj" in capsys.readouterr().out
