"""``graphcp serve [engine flags] --host H --port P [--tokenizer-path T]``: a prefill worker for
SGLang's router (with ``--disaggregation-mode prefill --disaggregation-bootstrap-port N``)."""

from __future__ import annotations

import os
import signal
import threading

from graphcp.engine import Engine
from graphcp.errors import ConfigError
from graphcp.serve.server import PrefillServer
from graphcp.tools.cli import engine_args, engine_parser


def build(argv: list[str]) -> PrefillServer:
    """The engine and its server, listening (``serve_forever`` serves)."""
    parser = engine_parser(
        "graphcp serve", "HTTP prefill worker (SGLang router compatible)", cp_default=1
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--tokenizer-path",
        default=None,
        help="HF tokenizer for 'text' and chat bodies (default: the checkpoint dir)",
    )
    ns = parser.parse_args(argv)
    args = engine_args(ns)
    tokenizer_path = ns.tokenizer_path or (
        args.model_path if os.path.isdir(args.model_path) else None
    )
    tokenizer = _tokenizer(tokenizer_path)
    engine = Engine(args)
    try:
        return PrefillServer(engine, ns.host, ns.port, tokenizer, tokenizer_path)
    except BaseException:
        engine.close()
        raise


def _tokenizer(path: str | None):
    """The checkpoint's tokenizer (chat template included); None where it has none."""
    if path is None:
        return None
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")) and not os.path.isfile(
        os.path.join(path, "tokenizer.json")
    ):
        if os.path.isdir(path):
            return None
        raise ConfigError(f"--tokenizer-path {path!r} is not a tokenizer directory")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def run(argv: list[str]) -> int:
    server = build(argv)
    print(f"graphcp serve: listening on port {server.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stop.wait()
    server.close()
    server.engine.close()
    return 0
