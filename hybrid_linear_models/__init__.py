"""Hybrid linear-attention language models (softmax attention + Gated DeltaNet + Kimi Delta Attention) for
Hugging Face transformers. Importing the package registers the classes with the Auto classes; it never imports
triton or flash-linear-attention (those load on first use with CUDA tensors)."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_hybrid_linear import HybridLinearConfig
from .modeling_hybrid_linear import HybridLinearForCausalLM, HybridLinearModel, HybridLinearPreTrainedModel

AutoConfig.register(HybridLinearConfig.model_type, HybridLinearConfig, exist_ok=True)
AutoModel.register(HybridLinearConfig, HybridLinearModel, exist_ok=True)
AutoModelForCausalLM.register(HybridLinearConfig, HybridLinearForCausalLM, exist_ok=True)
# save_pretrained / push_to_hub then ship the modeling sources with an `auto_map`, so that
# `from_pretrained(..., trust_remote_code=True)` works where this package is not installed.
HybridLinearConfig.register_for_auto_class()
HybridLinearModel.register_for_auto_class("AutoModel")
HybridLinearForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__version__ = "0.1.0"
__all__ = ["HybridLinearConfig", "HybridLinearModel", "HybridLinearForCausalLM", "HybridLinearPreTrainedModel"]
