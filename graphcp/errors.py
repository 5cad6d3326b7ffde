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
