"""graphcp: context-parallel prefill replayed as breakable CUDA graphs."""
from graphcp.batch import PrefillOutput, Request
from graphcp.config import EngineArgs
from graphcp.engine import Engine
from graphcp.errors import ConfigError, EngineDeadError, RequestError, TransferError
from graphcp.checkpoint.tokenizer import tokenizer

__all__ = ["EngineArgs", "Engine", "Request", "PrefillOutput", "ConfigError", "RequestError", "EngineDeadError",
           "TransferError", "tokenizer"]
__version__ = "0.1.0"
