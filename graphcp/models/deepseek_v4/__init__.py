"""DeepSeek V4 (``DeepseekV4ForCausalLM``): sliding, compressed-sparse and heavily-compressed
attention with sinks, hyper-connections, hash-routed and scored MoE with clamped SwiGLU experts;
DeepSeek's own tensor names read as transformers names."""
from graphcp.models.deepseek_v4.config import ARCHITECTURES, check_flags, read_config
from graphcp.models.deepseek_v4.model import DeepseekV4ForCausalLM
from graphcp.models.deepseek_v4.names import RenamedReader
from graphcp.models.family import Family

FAMILY = Family("deepseek_v4", ARCHITECTURES, read_config, DeepseekV4ForCausalLM,
                check_flags=check_flags, rename_tensors=RenamedReader)
