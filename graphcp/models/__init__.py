"""Models: plain modules that read the forward context; they know nothing of CP or graphs."""
from graphcp.models.config import ModelConfig
from graphcp.models.llama import CausalLM
from graphcp.models.loader import load_model, read_model_config

__all__ = ["ModelConfig", "CausalLM", "load_model", "read_model_config"]
