"""Errors users see: each names the flag or the request to change."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad engine configuration or checkpoint; the message names the flag to change."""


class RequestError(ValueError):
    """A bad request; the message names the request. The engine stays usable."""


class EngineDeadError(RuntimeError):
    """A rank died or stopped answering; the engine must be shut down."""


class TransferError(RuntimeError):
    """A KV transfer to a decode worker failed or timed out; the message names the request. The engine keeps
    serving and the request's KV stays cached until released."""


# How a rank process reports an error to the engine: the kind travels with the message, and the engine
# raises the same class (anything else is a rank fault: the engine shuts down).
WIRE_KINDS: dict[type[Exception], str] = {ConfigError: "config_error", RequestError: "request_error",
                                          TransferError: "transfer_error"}
FAULT, DEAD = "error", "dead"


def wire_kind(error: BaseException) -> str:
    """The kind a rank reports ``error`` as."""
    return next((kind for cls, kind in WIRE_KINDS.items() if isinstance(error, cls)), FAULT)
