"""A no-grad forward at a prompt length the process has not seen compiles and tunes no Triton kernel (on a GPU; skipped
elsewhere).

fla's forward norms of narrow rows are compiled and autotuned again for every new bucket of row counts (their NB
constexpr, an autotuning key: `inference_norm`), seconds a bucket. Here a GDN and a KDA model run forwards at a few
lengths, then at new, much longer ones (new buckets for fla's norms); the Triton cache folder (`TRITON_CACHE_DIR`, fresh for the run, with
`TRITON_CACHE_AUTOTUNING=1` so that each tuning writes a record) gains no compiled kernel and no tuning record during
the later forwards. Each model runs in a subprocess of its own (a fresh process and cache, as a user's first prompt
of a new length meets them): this file is also that subprocess's script,

    python tests/test_prompt_lengths_compile_nothing.py {gdn|kda} LENGTH ... [--fla-norms]

which prints one JSON line per forward: the length, the kernels compiled and the tuning records written during it.
`--fla-norms` turns this package's norm kernels off (fla's then run), which shows what the test guards against.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Forwards before: short prompts, and long ones that run the GDN/KDA layers in chunks of tokens with the state carried
# between them (chunked_recurrence; fla's kernels then take an initial state, an autotuning key of theirs: tuned once),
# at lengths whose pieces are multiples of 16 and not (the residue is part of fla's convolution's specialisation).
WARM_LENGTHS = (3000, 3008, 20000, 20001)
NEW_LENGTHS = (70001, 140000)  # (the norms' rows: 70001 x heads; fla's NB buckets of these differ from the above)
LAYERS = {"gdn": ["gated_deltanet", "full_attention"], "kda": ["kimi_delta_attention", "full_attention"]}


def _cache_entries(folder: Path) -> tuple[set[str], set[str]]:
    """(the compiled kernels, the tuning records) in a Triton cache folder, by name (a kernel's folder holds
    `<kernel name>.json` beside its binaries)."""
    kernels = set()
    for entry in folder.iterdir() if folder.is_dir() else ():
        names = [p.stem for p in entry.glob("*.json") if not p.name.startswith("__grp__")]
        if entry.is_dir() and not any(p.name.endswith(".autotune.json") for p in entry.iterdir()):
            kernels.add(f"{entry.name[:8]}:{','.join(sorted(names))}")
    tunings = {str(p.relative_to(folder)) for p in folder.rglob("*.autotune.json")} if folder.is_dir() else set()
    return kernels, tunings


def _run(model_kind: str, lengths: list[int], fla_norms: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from model_helpers import tiny_model

    from hybrid_linear_models import inference_norm

    if fla_norms:
        for switch in ("NORM_DEVICE_TYPES", "GATED_NORM_DEVICE_TYPES", "L2_NORM_DEVICE_TYPES"):
            setattr(inference_norm, switch, ())
    folder = Path(os.environ["TRITON_CACHE_DIR"])
    model = tiny_model(LAYERS[model_kind]).to("cuda", torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        input_ids = torch.randint(1, model.config.vocab_size, (1, length), generator=generator).cuda()
        kernels, tunings = _cache_entries(folder)
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        new_kernels, new_tunings = _cache_entries(folder)
        print(json.dumps({"length": length, "compiled": sorted(new_kernels - kernels),
                          "tuned": sorted(new_tunings - tunings)}), flush=True)


def forwards_in_a_fresh_process(model_kind: str, lengths: tuple[int, ...], cache: Path,
                                fla_norms: bool = False) -> list[dict]:
    """Runs this file as a script (a fresh process, a fresh Triton cache in `cache`): one record per forward."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_CACHE_AUTOTUNING": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, model_kind, *map(str, lengths), *(["--fla-norms"] if fla_norms else [])]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.gpu
@pytest.mark.slow  # (about 150 s a model on an H200, most of it fla's first compilations and tuning)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA (and fla, triton)")
@pytest.mark.parametrize("model_kind", sorted(LAYERS))
def test_a_forward_at_a_new_prompt_length_compiles_and_tunes_nothing(model_kind, tmp_path):
    from hybrid_linear_models import fla_backend

    if fla_backend.fla_kernels() is None:
        pytest.skip("needs fla")
    records = forwards_in_a_fresh_process(model_kind, WARM_LENGTHS + NEW_LENGTHS, tmp_path / "triton")
    assert [record["length"] for record in records] == list(WARM_LENGTHS + NEW_LENGTHS)
    assert records[0]["compiled"]  # (the count sees compilations: the first forward compiles the model's kernels)
    for record in records[len(WARM_LENGTHS):]:
        assert record["compiled"] == [] and record["tuned"] == [], record


if __name__ == "__main__":
    arguments = sys.argv[1:]
    _run(arguments[0], [int(a) for a in arguments[1:] if a != "--fla-norms"], "--fla-norms" in arguments)
