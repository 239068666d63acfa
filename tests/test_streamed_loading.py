"""from_pretrained reads a folder's shards into buffers of their own where every weight goes to an accelerator
(streamed_loading), instead of keeping every shard memory-mapped until the last weight.

The CPU stands in for the accelerator (`STREAMED_DEVICE_TYPES` plus "cpu"): the loaded weights are the mapped load's
bit for bit (a bf16 and an FP8 folder, sharded), and the host's peak resident memory over a load that converts the
weights (bf16 shards into a float32 model: the mapped pages are all touched) stays within one shard of the loaded
model's own, where the mapped load holds the whole folder's pages on top (measured here too, so the test tells the
two apart). Which loads stream is decided by the device map (`streams`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_helpers import SUBPROCESS_TIMEOUT, tiny_model
from test_fp8_checkpoints import folders  # noqa: F401  (the module-scoped FP8 folders fixture)

from hybrid_linear_models import HybridLinearForCausalLM, streamed_loading

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20

# loads a folder (argv[1]) in a fresh process as a float32 model on the CPU, streamed or mapped (argv[2]), and prints
# its resident memory before, after and at the peak of the load (MiB; Linux's VmRSS / VmHWM)
MEASURE = """
import json, sys
from pathlib import Path
import torch
from hybrid_linear_models import HybridLinearForCausalLM, streamed_loading

def resident(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) / 1024

if sys.argv[2] == "streamed":
    streamed_loading.STREAMED_DEVICE_TYPES += ("cpu",)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
before = resident("VmRSS")
model = HybridLinearForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, device_map="cpu")
print(json.dumps({"before": before, "after": resident("VmRSS"), "peak": resident("VmHWM")}))
"""


@pytest.fixture
def streamed_on_cpu(monkeypatch):
    monkeypatch.setattr(streamed_loading, "STREAMED_DEVICE_TYPES", (*streamed_loading.STREAMED_DEVICE_TYPES, "cpu"))


def _sharded_folder(path: Path, hidden: int = 64, layers: int = 4, shard: str = "40KB") -> Path:
    model = tiny_model(["linear_attention", "full_attention"] * (layers // 2), hidden_size=hidden,
                       intermediate_size=2 * hidden).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size=shard)
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def _loaded(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = HybridLinearForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu")
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streamed_load_gives_the_mapped_load_bit_for_bit(tmp_path, dtype, monkeypatch):
    folder = _sharded_folder(tmp_path / "model")
    mapped = _loaded(folder, dtype)
    read = []
    real = streamed_loading.read_shards

    def counted(files):
        read.append(len(files))
        return real(files)

    monkeypatch.setattr(streamed_loading, "STREAMED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(streamed_loading, "read_shards", counted)
    _assert_same(_loaded(folder, dtype), mapped)
    assert read == [len(list(folder.glob("*.safetensors")))]  # (the streamed path ran, over every shard)


def test_streamed_fp8_load_gives_the_mapped_load_bit_for_bit(folders, streamed_on_cpu, tmp_path):  # noqa: F811
    sharded = tmp_path / "fp8-sharded"
    HybridLinearForCausalLM.from_pretrained(folders / "hf", dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    streamed = _loaded(sharded, torch.float32)
    assert any(tensor.dtype == torch.float8_e4m3fn for tensor in streamed.values())
    streamed_loading.STREAMED_DEVICE_TYPES = ("cuda",)  # (this test's monkeypatch restores it)
    _assert_same(streamed, _loaded(sharded, torch.float32))


def _resident_over_load(folder: Path, way: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(folder), way], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's VmHWM")
def test_streamed_load_holds_the_model_not_the_folder(tmp_path):
    """bf16 shards of at most 4 MB, some 26 MiB in all, loaded as float32: a mapped load's peak holds the model and
    every shard's touched pages; a streamed one the model and the weights in flight (a few tensors of at most 1 MiB
    here)."""
    folder = _sharded_folder(tmp_path / "model", hidden=512, layers=8, shard="4MB")
    shards = [file.stat().st_size / MIB for file in folder.glob("*.safetensors")]
    streamed, mapped = _resident_over_load(folder, "streamed"), _resident_over_load(folder, "mapped")
    for measured in (streamed, mapped):
        assert measured["after"] - measured["before"] > 1.5 * sum(shards)  # (the float32 model, twice the bf16 bytes)
    assert streamed["peak"] - streamed["after"] <= max(shards), (streamed, shards)
    assert mapped["peak"] - mapped["after"] >= 0.5 * sum(shards), (mapped, shards)  # (the case the test tells apart)


def _config(device_map, disable_mmap: bool = False) -> SimpleNamespace:
    return SimpleNamespace(device_map=device_map, disable_mmap=disable_mmap)


@pytest.mark.parametrize(("device_map", "streamed"), [
    ({"": "cuda"}, True), ({"": 0}, True), ({"model": "cuda:0", "lm_head": torch.device("cuda", 1)}, True),
    ({"": "cpu"}, False), ({"model": "cuda", "lm_head": "cpu"}, False), ({"model": "cuda", "lm_head": "disk"}, False),
    ({"": "no_such_device"}, False), (None, False)])
def test_a_load_streams_where_every_weight_goes_to_an_accelerator(device_map, streamed):
    assert streamed_loading.streams(None, ["a.safetensors", "b.safetensors"], _config(device_map)) is streamed


def test_given_state_dicts_bin_files_and_disabled_memory_maps_load_as_transformers_does():
    cuda = {"": "cuda"}
    assert not streamed_loading.streams({"w": torch.zeros(1)}, ["a.safetensors"], _config(cuda))
    assert not streamed_loading.streams(None, ["pytorch_model.bin"], _config(cuda))
    assert not streamed_loading.streams(None, ["a.safetensors"], _config(cuda, disable_mmap=True))
    assert not streamed_loading.streams(None, [], _config(cuda))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_load_streams_and_gives_the_mapped_load_bit_for_bit(tmp_path, monkeypatch):
    """device_map="cuda" takes the streamed path (every shard read once) and lands the mapped load's bits."""
    folder = _sharded_folder(tmp_path / "model")
    read = []
    real = streamed_loading.read_shards

    def counted(files):
        read.append(len(files))
        return real(files)

    monkeypatch.setattr(streamed_loading, "read_shards", counted)
    streamed = HybridLinearForCausalLM.from_pretrained(folder, device_map="cuda").state_dict()
    assert read == [len(list(folder.glob("*.safetensors")))]
    assert all(tensor.device.type == "cuda" for tensor in streamed.values())
    monkeypatch.setattr(streamed_loading, "STREAMED_DEVICE_TYPES", ())
    mapped = HybridLinearForCausalLM.from_pretrained(folder, device_map="cuda").state_dict()
    assert read == [len(list(folder.glob("*.safetensors")))]  # (the mapped load read no shard of ours)
    _assert_same(streamed, mapped)


def test_whole_reads_give_safetensors_tensors_for_every_dtype(tmp_path):
    """`slice[...]` of a read shard (one preadv into the tensor's storage) equals safetensors' tensor, dtype and shape
    included, for every dtype a checkpoint holds (an empty and a 0-d tensor among them); partial reads, shapes and
    dtypes stay safetensors'."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=generator)
    tensors = {str(dtype): values.to(dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                                         torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
                                                         torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
    tensors.update(empty=torch.zeros(0, 3), scalar=torch.tensor(2.5))
    save_file(tensors, tmp_path / "a.safetensors")
    with streamed_loading.read_shards([str(tmp_path / "a.safetensors")]) as slices:
        assert slices.keys() == tensors.keys()
        for name, tensor in tensors.items():
            for whole in (slices[name][...], slices[name][:]):
                assert whole.dtype == tensor.dtype and whole.shape == tensor.shape, name
                assert torch.equal(whole.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
        assert torch.equal(slices["torch.float32"][1:3], tensors["torch.float32"][1:3])
        assert slices["torch.bfloat16"].get_shape() == [6, 5] and slices["torch.bfloat16"].get_dtype() == "BF16"


def test_a_truncated_shard_is_refused_by_its_read(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    save_file({"w": torch.ones(64, 64)}, path)
    whole = path.read_bytes()
    with streamed_loading.read_shards([str(path)]) as slices:
        path.write_bytes(whole[:-100])  # (cut after opening: safetensors checks the size when it opens)
        with pytest.raises(OSError, match="100 bytes of a tensor are missing"):
            slices["w"][...]
