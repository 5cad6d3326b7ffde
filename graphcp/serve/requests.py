"""SGLang's request bodies, as a prefill worker behind SGLang's router receives them: ``/generate``
(``GenerateReqInput``: ``text`` or ``input_ids``, one or a batch, ``sampling_params``, ``rid``,
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``, ``return_logprob``,
``top_logprobs_num``) and ``/v1/chat/completions`` (``messages`` through the checkpoint's chat
template). Text is tokenized as SGLang's tokenizer manager does, so the decode, which tokenizes the
same body itself, gets the same ids."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from graphcp.errors import RequestError
from graphcp.pd.sglang.sampling import SamplingParams

_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "sampling_seed",
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "logit_bias",
    "json_schema",
    "regex",
    "ebnf",
)


@dataclass
class Item:
    """One request of a body: what the engine prefills and what the reply reports."""

    rid: str
    input_ids: list[int]
    bootstrap_room: int | None
    sampling_params: dict
    return_logprob: bool
    top_logprobs_num: int


def _per_item(body: dict, key: str, n: int, default: object) -> list:
    """A field that is one value for every request of a batch, or a list of one per request."""
    value = body.get(key, default)
    if isinstance(value, list) and key != "stop":
        if len(value) != n:
            raise RequestError(f"{key!r} has {len(value)} entries for a batch of {n} requests")
        return value
    return [value] * n


def _prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    """Each request's ids, and whether the body was a batch."""
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        return (ids if batched else [ids]), batched
    text = body.get("text")
    if text is None:
        raise RequestError("the body needs 'text' or 'input_ids' (SGLang's GenerateReqInput)")
    if tokenizer is None:
        raise RequestError(
            "'text' needs a tokenizer: start graphcp serve with --tokenizer-path, or send input_ids"
        )
    batched = isinstance(text, list)
    return [list(tokenizer(t)["input_ids"]) for t in (text if batched else [text])], batched


def chat_ids(body: dict, tokenizer) -> list[int]:
    """``messages`` through the checkpoint's chat template with the generation prompt, as SGLang's
    OpenAI-compatible chat endpoint renders them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "'messages' needs the checkpoint's chat template (tokenizer_config.json)"
        )
    ids = tokenizer.apply_chat_template(
        body["messages"],
        tokenize=True,
        add_generation_prompt=True,
        **(body.get("chat_template_kwargs") or {}),
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def parse_body(
    body: object,
    tokenizer,
    bootstrap_port: int | None,
    chat: bool = False,
) -> tuple[list[Item], bool]:
    """The requests of one body, and whether to answer with a list; RequestError names the field."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    if chat:
        if not isinstance(body.get("messages"), list):
            raise RequestError("a chat completion needs 'messages'")
        prompts, batched = [chat_ids(body, tokenizer)], False
        body = {
            **body,
            "sampling_params": {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None},
        }
    else:
        prompts, batched = _prompts(body, tokenizer)
    if body.get("stream"):
        raise RequestError(
            "'stream' is not served by graphcp's prefill worker (the decode streams)"
        )
    n = len(prompts)
    start = _per_item(body, "logprob_start_len", n, None)
    if any(s not in (None, -1) for s in start):
        raise RequestError(
            "'logprob_start_len': graphcp computes logits at each prompt's last token only, "
            "so prompt-token logprobs are not returned (leave it unset or -1)"
        )
    ports = _per_item(body, "bootstrap_port", n, None)
    if bootstrap_port is not None and any(p not in (None, bootstrap_port) for p in ports):
        raise RequestError(
            f"'bootstrap_port' {ports[0]} is not this worker's ({bootstrap_port}): the router's "
            f"--prefill entry names another bootstrap port"
        )
    rids = _per_item(body, "rid", n, None)
    rooms = _per_item(body, "bootstrap_room", n, None)
    params = _per_item(body, "sampling_params", n, None)
    logprob = _per_item(body, "return_logprob", n, False)
    top = _per_item(body, "top_logprobs_num", n, 0)
    items = []
    for i, ids in enumerate(prompts):
        rid = str(rids[i]) if rids[i] is not None else uuid.uuid4().hex
        if params[i] is not None and not isinstance(params[i], dict):
            raise RequestError(f"request {rid!r}: 'sampling_params' must be an object")
        SamplingParams.parse(rid, params[i])  # a bad value is a 400 before any prefill
        items.append(
            Item(rid, ids, rooms[i], dict(params[i] or {}), bool(logprob[i]), int(top[i] or 0))
        )
    return items, batched
