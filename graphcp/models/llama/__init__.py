"""The llama family: Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE (dense GQA attention with RoPE, a
dense or MoE FFN per layer)."""
from graphcp.models.family import Family
from graphcp.models.llama.config import ARCHITECTURES, HF_DEFAULTS, read_config
from graphcp.models.llama.model import LlamaForCausalLM

FAMILY = Family("llama", ARCHITECTURES, read_config, LlamaForCausalLM, HF_DEFAULTS)
