"""What a user of the wheel meets first, run from an install made WITHOUT `-e` (a fresh venv, outside the checkout):

- the package and its command line import from site-packages (a package left out of the wheel fails here);
- one conversion through `hybrid-linear-convert` of every format: the Fast-LLM fixtures (fast_llm,
  fast_llm_distributed, apriel2) to hf, and hf to and from each peer format (qwen3_next, kimi_linear, fla, apriel2,
  fast_llm), each peer's source a tiny model that format can hold;
- the model card (package data) in the hf output, and one greedy generation from the converted folder.

    python .ci/installed_smoke.py FIXTURES WORKDIR   # FIXTURES: shared/fixtures/fast_llm
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path


def check_installed_copy() -> None:
    import hybrid_linear_cli
    import hybrid_linear_models

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for module in (hybrid_linear_models, hybrid_linear_cli):
        where = Path(module.__file__).resolve()
        assert site in where.parents, f"{module.__name__} comes from {where}, not from the installed wheel in {site}"


def convert(*argv: str) -> None:
    from hybrid_linear_cli.convert import main

    status = main([*argv, "--quiet"])
    assert status == 0, f"hybrid-linear-convert {' '.join(argv)} failed with status {status}"
    print(f"converted: {' '.join(argv[:4])}", flush=True)


def peer_models(work: Path) -> dict[str, Path]:
    """A saved model (hf) that each peer format can hold."""
    import torch
    from transformers.utils import logging

    from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM

    logging.disable_progress_bar()  # tiny models: the bars would outnumber the results
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=16, gdn_value_head_dim=8,
                kda_num_heads=2, kda_head_dim=16, rms_norm_eps=1e-5)
    full_rotary = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    settings = {
        "qwen3_next": dict(layer_types=["gated_deltanet", "full_attention"],
                           rope_parameters={**full_rotary, "partial_rotary_factor": 0.5}),
        "kimi_linear": dict(layer_types=["kimi_delta_attention"] * 2, zero_centered_norms=False),
        "fla": dict(layer_types=["gated_deltanet", "full_attention"], zero_centered_norms=False,
                    attention_output_gate=False, attention_qk_norm=False, attention_output_bias=False,
                    rope_parameters=full_rotary),
    }
    folders = {}
    for name, overrides in settings.items():
        torch.manual_seed(0)
        folders[name] = work / f"ours-for-{name}"
        HybridLinearForCausalLM(HybridLinearConfig(**base, **overrides)).save_pretrained(folders[name])
    return folders


def generate(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.arange(3, 11).unsqueeze(0)
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert output.shape == (1, 16), output.shape
    print(f"generated from {folder.name}: {output[0, 8:].tolist()}", flush=True)


def main() -> None:
    fixtures, work = Path(sys.argv[1]).resolve() / "hybrid_attn_gdn_kda", Path(sys.argv[2]).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    check_installed_copy()
    subprocess.run(["hybrid-linear-convert", "--help"], check=True, stdout=subprocess.DEVNULL)  # the console script

    hf = work / "hf"
    convert("--from", "fast_llm", "--to", "hf", str(fixtures / "fast_llm"), str(hf))
    assert (hf / "README.md").is_file(), "the model card template was not installed"
    convert("--from", "fast_llm_distributed", "--to", "hf", str(fixtures / "distributed"), str(work / "hf-dist"))
    convert("--from", "apriel2", "--to", "hf", str(fixtures / "apriel2_text"), str(work / "hf-apriel2"))
    convert("--from", "hf", "--to", "fast_llm", str(hf), str(work / "fast_llm"))
    convert("--from", "hf", "--to", "apriel2", str(hf), str(work / "apriel2"))
    for peer, source in peer_models(work).items():
        convert("--from", "hf", "--to", peer, str(source), str(work / peer))
        convert("--from", peer, "--to", "hf", str(work / peer), str(work / f"hf-from-{peer}"))
    generate(hf)


if __name__ == "__main__":
    main()
