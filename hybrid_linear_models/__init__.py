"""Hybrid linear-attention language models (softmax attention + Gated DeltaNet + Kimi Delta Attention) for
Hugging Face transformers. Importing the package registers the classes with the Auto classes; it never imports
triton or flash-linear-attention (those load on first use with CUDA tensors)."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .configuration_hybrid_linear import HybridLinearConfig
from .lora import lora_target_modules, lora_target_parameters
from .modeling_hybrid_linear import HybridLinearForCausalLM, HybridLinearModel, HybridLinearPreTrainedModel
from .tokenizer_loading import HybridLinearTokenizer

AutoConfig.register(HybridLinearConfig.model_type, HybridLinearConfig, exist_ok=True)
AutoModel.register(HybridLinearConfig, HybridLinearModel, exist_ok=True)
AutoModelForCausalLM.register(HybridLinearConfig, HybridLinearForCausalLM, exist_ok=True)
# used only for folders whose tokenizer_config.json names no class: a clear error where the folder has no tokenizer
AutoTokenizer.register(HybridLinearConfig, HybridLinearTokenizer, exist_ok=True)
# save_pretrained / push_to_hub ship the sources with an `auto_map`, so that `from_pretrained(...,
# trust_remote_code=True)` works where this package is not installed. The model classes declare their Auto class
# themselves (modeling_hybrid_linear.AUTO_MAP), so that models loaded as remote code save loadable folders too.
HybridLinearConfig.register_for_auto_class()

__version__ = "0.1.0"
__all__ = [
    "HybridLinearConfig",
    "HybridLinearForCausalLM",
    "HybridLinearModel",
    "HybridLinearPreTrainedModel",
    "lora_target_modules",
    "lora_target_parameters",
]
