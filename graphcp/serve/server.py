"""``graphcp serve``: an HTTP front for the engine that SGLang's router takes for a prefill worker.

HTTP threads parse bodies and wait; one batcher thread drains what they queued into ``prefill``
calls of up to ``--max-batch-requests`` requests, so requests from several clients share a forward.
A request with a ``bootstrap_room`` is answered once its KV transfer to the decode concluded (the
engine picks its first token as SGLang's prefill does and releases its pages then); one without is
answered with its first token and released at once.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from graphcp.batch import Request
from graphcp.engine import Engine
from graphcp.errors import ConfigError, RequestError
from graphcp.pd.sglang.control import WAIT_TIMEOUT_S
from graphcp.pd.sglang.sampling import FirstToken, SamplingParams, first_token
from graphcp.pd.sglang.wire import SGLANG_VERSION
from graphcp.serve.requests import Item, parse_body

log = logging.getLogger("graphcp")


@dataclass
class Pending:
    item: Item
    done: threading.Event = field(default_factory=threading.Event)
    first: FirstToken | None = None
    error: str | None = None
    rejected: bool = False  # the engine refused the request itself (a 400, not a 500)


class PrefillServer:
    def __init__(
        self,
        engine: Engine,
        host: str,
        port: int,
        tokenizer=None,
        tokenizer_path: str | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.tokenizer_path = engine, tokenizer, tokenizer_path
        self.pending: queue.Queue[Pending] = queue.Queue()
        self.live: set[str] = set()
        self.dead: str | None = None  # why the engine stopped serving (health turns 503)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        handler = type("Handler", (_Handler,), {"app": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot listen ({e})") from e
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._batcher = threading.Thread(
            target=self._batch_loop, name="graphcp-batcher", daemon=True
        )
        self._batcher.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._batcher.join(timeout=10)

    # -- the batcher -----------------------------------------------------------------------------
    def _batch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self.pending.get(timeout=0.2)]
            except queue.Empty:
                continue
            while len(batch) < self.engine.args.max_batch_requests:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            try:
                self._prefill(batch)
            except RequestError:
                for one in batch:  # one bad request must not fail the others
                    self._prefill_alone(one)
            except Exception as e:
                self.dead = f"{type(e).__name__}: {e}"
                for one in batch:
                    one.error = f"{type(e).__name__}: {e}"
                    one.done.set()

    def _prefill_alone(self, one: Pending) -> None:
        try:
            self._prefill([one])
        except Exception as e:
            one.error = str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
            one.rejected = isinstance(e, RequestError)
            one.done.set()

    def _prefill(self, batch: list[Pending]) -> None:
        requests = [
            Request(p.item.rid, p.item.input_ids, p.item.bootstrap_room, p.item.sampling_params)
            for p in batch
        ]
        out = self.engine.prefill(requests)
        for i, p in enumerate(batch):
            if p.item.bootstrap_room is None:  # no decode waits: the token here, the pages freed
                params = SamplingParams.parse(p.item.rid, p.item.sampling_params)
                p.first = first_token(out.logits[i], params, len(p.item.input_ids) - 1)
                self.engine.release(p.item.rid)
            p.done.set()

    # -- one HTTP body ---------------------------------------------------------------------------
    def generate(self, body: object, chat: bool = False) -> tuple[int, object]:
        try:
            items, batched = parse_body(
                body, self.tokenizer, self.engine.args.disaggregation_bootstrap_port, chat
            )
        except RequestError as e:
            return 400, {"error": {"message": str(e)}}
        with self._lock:
            taken = [i.rid for i in items if i.rid in self.live]
            if taken or len({i.rid for i in items}) != len(items):
                return 400, {
                    "error": {
                        "message": f"rid {taken[0] if taken else items[0].rid!r} is in flight"
                    }
                }
            self.live.update(i.rid for i in items)
        try:
            pending = [Pending(item) for item in items]
            for p in pending:
                self.pending.put(p)
            results = [self._result(p) for p in pending]
        finally:
            with self._lock:
                self.live.difference_update(i.rid for i in items)
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            return (400 if all(p.rejected for p in pending) else 500), {
                "error": {"message": "; ".join(errors)}
            }
        if chat:
            return 200, self._chat_reply(pending[0], results[0])
        replies = [self._reply(p, first) for p, first in zip(pending, results)]
        return 200, replies if batched else replies[0]

    def _result(self, p: Pending) -> FirstToken | str:
        """The first token, or why the request failed (its prefill, or its transfer)."""
        p.done.wait()
        if p.error:
            return p.error
        if p.item.bootstrap_room is None:
            return p.first
        deadline = time.monotonic() + WAIT_TIMEOUT_S + 30
        while time.monotonic() < deadline:
            status = self.engine.transfer_status(p.item.rid)
            if status["state"] == "success":
                tops = status["top_logprobs"]
                return FirstToken(
                    status["first_token"],
                    status["logprob"],
                    [t for _, t in tops],
                    [lp for lp, _ in tops],
                )
            if status["state"] == "failed":
                return f"request {p.item.rid!r}: KV transfer failed: {status['reason']}"
            time.sleep(0.005)
        return f"request {p.item.rid!r}: KV transfer did not conclude"

    def _reply(self, p: Pending, first: FirstToken) -> dict:
        item = p.item
        meta = {
            "id": item.rid,
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": 1,
            "cached_tokens": 0,
        }
        if item.bootstrap_room is not None:
            meta["bootstrap_room"] = item.bootstrap_room
        if item.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[first.logprob, first.token, None]]
            if item.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [[lp, t, None] for lp, t in zip(first.top_logprobs, first.top_ids)][
                        : item.top_logprobs_num
                    ]
                ]
        text = self.tokenizer.decode([first.token]) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": [first.token], "meta_info": meta}

    def _chat_reply(self, p: Pending, first: FirstToken) -> dict:
        reply = self._reply(p, first)
        return {
            "id": p.item.rid,
            "object": "chat.completion",
            "model": self.engine.args.model_path,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply["text"]},
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(p.item.input_ids),
                "completion_tokens": 1,
                "total_tokens": len(p.item.input_ids) + 1,
            },
        }

    def info(self, path: str) -> tuple[int, object] | None:
        args = self.engine.args
        if path in ("/health", "/health_generate"):
            return (200, "OK") if self.dead is None else (503, self.dead)
        if path in ("/get_model_info", "/model_info"):
            return 200, {
                "model_path": args.model_path,
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        if path in ("/get_server_info", "/server_info"):
            return 200, {
                **{
                    k: v
                    for k, v in args.to_dict().items()
                    if isinstance(v, (int, float, str, type(None)))
                },
                "disaggregation_mode": args.disaggregation_mode,
                "version": f"graphcp (SGLang {SGLANG_VERSION} PD protocol)",
                "max_total_num_tokens": self.engine.stats()["kv_tokens_total"],
            }
        if path == "/v1/models":
            return 200, {
                "object": "list",
                "data": [{"id": args.model_path, "object": "model", "owned_by": "graphcp"}],
            }
        return None


class _Handler(BaseHTTPRequestHandler):
    app: PrefillServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # health checks every few seconds
        pass

    def _reply(self, code: int, body: object) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header(
            "Content-Type", "text/plain" if isinstance(body, str) else "application/json"
        )
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        answer = self.app.info(self.path.split("?")[0])
        self._reply(*(answer or (404, {"error": {"message": f"no route {self.path}"}})))

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        try:
            body = json.loads(
                self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null"
            )
        except ValueError as e:
            self._reply(400, {"error": {"message": f"the body is not JSON: {e}"}})
            return
        if path == "/generate":
            self._reply(*self.app.generate(body))
        elif path == "/v1/chat/completions":
            self._reply(*self.app.generate(body, chat=True))
        else:
            self._reply(404, {"error": {"message": f"no route {path}"}})
