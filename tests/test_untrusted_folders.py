"""No code of an untrusted folder runs: a folder may carry Python files and a config.json whose `auto_map` names
them. The converter reads only config files and safetensors (never imports or copies a folder's modules; the
modeling sources it ships are this package's own), and with the package imported `from_pretrained` builds this
package's classes: transformers runs a folder's code only with `trust_remote_code=True`."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import convert_checkpoint

SRC = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "fast_llm"


def test_no_code_of_an_untrusted_folder_runs(tmp_path):
    folder = convert_checkpoint(SRC, tmp_path / "untrusted", from_format="fast_llm", to_format="hf").destination
    ran = tmp_path / "ran"
    for module in ("modeling_hybrid_linear", "configuration_hybrid_linear", "evil"):  # shadowing ours, and its own
        (folder / f"{module}.py").write_text(f"open({str(ran)!r}, 'w').close()\nclass Evil:\n    pass\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.Evil", "AutoModelForCausalLM": "evil.Evil"}
    (folder / "config.json").write_text(json.dumps(config))

    out = convert_checkpoint(folder, tmp_path / "out", from_format="hf", to_format="hf").destination
    assert not (out / "evil.py").exists()
    assert (out / "modeling_hybrid_linear.py").read_text() != (folder / "modeling_hybrid_linear.py").read_text()
    assert type(HybridLinearForCausalLM.from_pretrained(folder)).__name__ == "HybridLinearForCausalLM"
    assert type(AutoModelForCausalLM.from_pretrained(folder)).__name__ == "HybridLinearForCausalLM"
    assert type(AutoConfig.from_pretrained(folder)).__name__ == "HybridLinearConfig"
    assert not ran.exists()
