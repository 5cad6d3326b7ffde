"""graphcp: context-parallel prefill replayed as breakable CUDA graphs."""
from graphcp.batch import PrefillOutput, Request
from graphcp.checkpoint.tokenizer import tokenizer
from graphcp.config import EngineArgs
from graphcp.engine import Engine
from graphcp.errors import ConfigError, EngineDeadError, RequestError, TransferError

__all__ = ["EngineArgs", "Engine", "Request", "PrefillOutput", "ConfigError", "RequestError", "EngineDeadError",
           "TransferError", "tokenizer"]
__version__ = "0.1.0"
