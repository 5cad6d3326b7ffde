"""The gpt-oss family (``GptOssForCausalLM``): sliding-window and full attention layers with
attention sinks, a biased top-k router and clamped-SwiGLU experts, held in MXFP4 as released."""
from graphcp.models.family import Family
from graphcp.models.gpt_oss.config import ARCHITECTURES, HF_DEFAULTS, read_config
from graphcp.models.gpt_oss.model import GptOssForCausalLM

FAMILY = Family("gpt_oss", ARCHITECTURES, read_config, GptOssForCausalLM, HF_DEFAULTS)
