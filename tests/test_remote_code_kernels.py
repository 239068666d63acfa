"""This package's Triton kernels (`*_triton.py`) travel with a saved folder, and a folder loaded with
`trust_remote_code=True` where the package is not installed resolves them from its own dynamic-module folder: on a
CPU machine without triton each kernel is reported unavailable for the same reason as in the package (triton is
missing, not the kernel module); on a GPU (`gpu` test) the folder takes the same kernels as the package and decodes
the same tokens.

One subprocess (the package blocked, `model_helpers.WITHOUT_THE_PACKAGE_PRELUDE`) loads the folder and reports, for
every kernel loader of the remote `triton_loading`, what it resolved to."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from model_helpers import WITHOUT_THE_PACKAGE_PRELUDE, run_without_the_package, tiny_model
from transformers.dynamic_module_utils import get_relative_import_files

import hybrid_linear_models
from hybrid_linear_models import triton_loading
from hybrid_linear_models.modeling_hybrid_linear import HybridLinearForCausalLM  # noqa: F401  (imports every loader)

PACKAGE_DIR = Path(hybrid_linear_models.__file__).parent
KERNEL_MODULES = sorted(path.name for path in PACKAGE_DIR.glob("*_triton.py"))
PROMPT = [[3, 5, 7, 2, 11, 4, 9, 1]]
NEW_TOKENS = 12

_REPORT_KERNELS = WITHOUT_THE_PACKAGE_PRELUDE + textwrap.dedent("""

    import torch
    from transformers import AutoModelForCausalLM

    job = json.loads(Path(sys.argv[1]).read_text())
    device = job["device"]
    model = AutoModelForCausalLM.from_pretrained(job["folder"], trust_remote_code=True,
                                                 dtype=getattr(torch, job["dtype"])).to(device).eval()
    package = type(model).__module__.rpartition(".")[0]
    loading = sys.modules[package + ".triton_loading"]
    report = {"package": package, "loaders": {}, "tokens": None,
              "package_imported": any(m.split(".")[0] == "hybrid_linear_models" for m in sys.modules)}
    if job["generate"]:
        with torch.no_grad():
            output = model.generate(torch.tensor(job["prompt"], device=device), max_new_tokens=job["new_tokens"],
                                    min_new_tokens=job["new_tokens"], do_sample=False, pad_token_id=0,
                                    cache_implementation="static")
        report["tokens"] = output.tolist()
    for loader in loading.KERNEL_LOADERS:
        kernel = loader()
        name = loader.__module__.rpartition(".")[2] + "." + loader.__qualname__
        error = loading.UNAVAILABLE.get(loader.__module__ + "." + loader.__qualname__)
        while error is not None and (error.__cause__ or error.__context__) is not None:
            error = error.__cause__ or error.__context__
        report["loaders"][name] = {
            # a loader returns one kernel or a tuple of them (a verify round and its restore)
            "kernel": None if kernel is None else [[k.__module__, k.__name__] for k in
                                                   (kernel if isinstance(kernel, tuple) else (kernel,))],
            "missing": None if error is None else getattr(error, "name", None),
        }
    Path(job["report"]).write_text(json.dumps(report))
""")


def _root_cause(error: BaseException | None) -> BaseException | None:
    while error is not None and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def _package_report() -> dict:
    """What this process's package resolves, in the subprocess's terms."""
    loaders = {}
    for loader in triton_loading.KERNEL_LOADERS:
        kernel = loader()
        name = loader.__module__.rpartition(".")[2] + "." + loader.__qualname__
        error = _root_cause(triton_loading.UNAVAILABLE.get(f"{loader.__module__}.{loader.__qualname__}"))
        kernels = kernel if isinstance(kernel, tuple) else (kernel,)
        loaders[name] = {"kernel": None if kernel is None else [[k.__module__, k.__name__] for k in kernels],
                         "missing": None if error is None else getattr(error, "name", None)}
    return loaders


def _remote_report(tmp_path: Path, folder: Path, device: str, dtype: str, generate: bool) -> dict:
    job = {"folder": str(folder), "device": device, "dtype": dtype, "generate": generate, "prompt": PROMPT,
           "new_tokens": NEW_TOKENS, "report": str(tmp_path / "report.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "run.py").write_text(_REPORT_KERNELS)
    run_without_the_package(tmp_path / "run.py", tmp_path / "job.json", cwd=tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["package_imported"]
    return report


def test_the_package_has_kernel_modules_and_a_loader_for_each():
    assert KERNEL_MODULES, "no *_triton.py module found"
    assert len(triton_loading.KERNEL_LOADERS) >= 4  # the GEMV, both decoding norms, the attention step


def test_a_saved_folder_ships_every_kernel_module(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    shipped = {path.name for path in tmp_path.glob("*.py")}
    assert set(KERNEL_MODULES) <= shipped
    # transformers' remote-code loader copies into its module cache what it reaches through `from .x import` lines
    reached = {Path(path).name for path in get_relative_import_files(tmp_path / "modeling_hybrid_linear.py")}
    assert set(KERNEL_MODULES) <= reached


@pytest.mark.slow
def test_remote_code_resolves_the_kernel_modules_without_the_package(tmp_path):
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    report = _remote_report(tmp_path, folder, "cpu", "float32", generate=False)
    assert report["package"].startswith("transformers_modules.")
    package = _package_report()
    assert report["loaders"].keys() == package.keys()
    for name, remote in report["loaders"].items():
        # the same outcome as the package; a kernel that is unavailable lacks triton (or a driver), never its module
        assert (remote["kernel"] is None) == (package[name]["kernel"] is None), name
        assert remote["missing"] == package[name]["missing"], name
        if remote["kernel"] is None:
            assert remote["missing"] is None or remote["missing"].split(".")[0] == "triton", (name, remote)
        else:
            assert all(module.startswith(report["package"] + ".") for module, _ in remote["kernel"]), (name, remote)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_remote_folder_takes_the_package_kernels(tmp_path):
    """On a GPU with triton: every kernel loader of the remote folder returns the kernel of the same name from the
    folder's own modules, and a static-cache greedy decode gives the package's tokens."""
    folder = tmp_path / "model"
    model = tiny_model()
    model.save_pretrained(folder)
    report = _remote_report(tmp_path, folder, "cuda", "bfloat16", generate=True)
    package = _package_report()
    assert all(entry["kernel"] is not None for entry in package.values()), package
    assert report["loaders"].keys() == package.keys()
    for name, remote in report["loaders"].items():
        assert remote["kernel"] is not None, (name, remote)
        assert len(remote["kernel"]) == len(package[name]["kernel"]), (name, remote)
        for (module, kernel), (package_module, package_kernel) in zip(remote["kernel"], package[name]["kernel"]):
            assert module.startswith(report["package"] + "."), (name, remote)
            assert module.rpartition(".")[2] == package_module.rpartition(".")[2]
            assert kernel == package_kernel
    model = HybridLinearForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()  # as loaded there
    with torch.no_grad():
        tokens = model.generate(torch.tensor(PROMPT, device="cuda"), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                cache_implementation="static")
    assert report["tokens"] == tokens.tolist()
