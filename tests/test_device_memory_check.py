"""from_pretrained refuses, in one line and before transformers reads any weight, a device map that puts more weight
bytes on a GPU than it has free (device_memory_check). The CPU stands in for the GPU (`CHECKED_DEVICE_TYPES` plus
"cpu", the free memory stood in); the bytes are counted as the model will hold them (an FP8 folder's one-byte weights
and float32 scales), placed as transformers places them."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_model
from test_fp8_checkpoints import folders  # noqa: F401  (the module-scoped FP8 folders fixture)
from transformers.modeling_utils import PreTrainedModel

from hybrid_linear_models import HybridLinearForCausalLM, device_memory_check


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.fixture
def cpu_checked(monkeypatch):
    """The CPU checked as a GPU would be, with `free` bytes free (set the returned dict's "free")."""
    memory = {"free": 0, "asked": []}

    def free_bytes(device):
        memory["asked"].append(device)
        return memory["free"]

    monkeypatch.setattr(device_memory_check, "CHECKED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device_memory_check, "free_bytes", free_bytes)
    return memory


@pytest.fixture
def saved(tmp_path):
    """A saved tiny model, and the bytes of its parameters and buffers as from_pretrained builds it."""
    tiny_model(["linear_attention", "full_attention"]).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    return tmp_path / "model", _bytes(HybridLinearForCausalLM.from_pretrained(tmp_path / "model"))


def test_a_model_larger_than_the_free_memory_is_refused_before_any_weight_is_read(saved, cpu_checked, monkeypatch):
    folder, size = saved
    cpu_checked["free"] = size - 1
    entered = []
    monkeypatch.setattr(PreTrainedModel, "_load_pretrained_model", staticmethod(lambda *a, **k: entered.append(1)))
    refusal = r"^The model's weights need [\d.]+ MiB on cpu, which has [\d.]+ MiB free: "
    with pytest.raises(ValueError, match=refusal) as error:
        HybridLinearForCausalLM.from_pretrained(folder, device_map="cpu")
    assert "\n" not in str(error.value) and 'device_map="auto"' in str(error.value)
    assert entered == []  # (transformers' loader, which reads the weights, never ran)


def test_a_model_that_fits_loads(saved, cpu_checked):
    folder, size = saved
    cpu_checked["free"] = size
    model = HybridLinearForCausalLM.from_pretrained(folder, device_map="cpu")
    assert _bytes(model) == size and cpu_checked["asked"] == [torch.device("cpu")]


def test_fp8_weights_count_one_byte_and_their_scales_four(folders, cpu_checked):  # noqa: F811
    model = HybridLinearForCausalLM.from_pretrained(folders / "hf", dtype=torch.bfloat16)
    size = _bytes(model)
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    cpu_checked["free"] = size - 1
    with pytest.raises(ValueError, match="weights need"):
        HybridLinearForCausalLM.from_pretrained(folders / "hf", dtype=torch.bfloat16, device_map="cpu")
    cpu_checked["free"] = size
    HybridLinearForCausalLM.from_pretrained(folders / "hf", dtype=torch.bfloat16, device_map="cpu")


def test_weights_are_counted_on_the_devices_the_map_places_them(monkeypatch):
    monkeypatch.setattr(device_memory_check, "CHECKED_DEVICE_TYPES", ("cuda",))
    model = tiny_model(["linear_attention", "full_attention"])
    layer = _bytes(model.model.layers[1])
    by_device = device_memory_check.weight_bytes_by_device(
        model, {"model.layers.1": "cuda:1", "model.layers.0": "disk", "lm_head": "cpu", "": 0})
    assert by_device[torch.device("cuda", 1)] == layer
    assert by_device[torch.device("cuda", 0)] == (_bytes(model) - layer - _bytes(model.model.layers[0])
                                                  - _bytes(model.lm_head))
    assert set(by_device) == {torch.device("cuda", 0), torch.device("cuda", 1)}  # (the CPU and the disk unchecked)


def test_one_gpu_named_two_ways_is_counted_once(monkeypatch):
    """"cuda" (the current device) and 0 in one map are one GPU: its bytes are summed, not checked apart."""
    monkeypatch.setattr(device_memory_check, "CHECKED_DEVICE_TYPES", ("cuda",))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model = tiny_model(["linear_attention", "full_attention"])
    by_device = device_memory_check.weight_bytes_by_device(model, {"model.layers.1": "cuda", "": 0})
    assert by_device == {torch.device("cuda", 0): _bytes(model)}


def test_an_fp8_model_is_not_told_to_load_an_fp8_checkpoint(folders, cpu_checked):  # noqa: F811
    cpu_checked["free"] = 1
    with pytest.raises(ValueError, match="weights need") as error:
        HybridLinearForCausalLM.from_pretrained(folders / "hf", dtype=torch.bfloat16, device_map="cpu")
    assert "FP8" not in str(error.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_load_is_checked_against_its_free_memory(saved, monkeypatch):
    """On a real GPU: the free memory read is the device's (positive, at most its size, and what torch's allocator
    holds unused counts as free); a model that fits loads there; one the device cannot hold is refused by name."""
    folder, size = saved
    device = torch.device("cuda", torch.cuda.current_device())
    free = device_memory_check.free_bytes(device)
    assert 0 < free <= torch.cuda.get_device_properties(device).total_memory
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    del block  # (kept in torch's reserve: still free for a new allocation)
    assert device_memory_check.free_bytes(device) >= free - 2**20
    model = HybridLinearForCausalLM.from_pretrained(folder, device_map="cuda")
    assert {tensor.device.type for tensor in model.state_dict().values()} == {"cuda"}
    monkeypatch.setattr(device_memory_check, "free_bytes", lambda device: size - 1)
    with pytest.raises(ValueError, match=r"need [\d.]+ MiB on cuda(:\d+)?, which has"):
        HybridLinearForCausalLM.from_pretrained(folder, device_map="cuda")
