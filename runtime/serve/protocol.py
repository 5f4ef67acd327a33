"""The OpenAI request bodies the server takes, checked field by field, and the response objects it sends.

A field the server cannot honour (``n`` > 1, logprobs, penalties, tools, ...) is a 400 naming it, never ignored:
a client that asks for it would get something else than it asked for. vLLM's extensions ``top_k``,
``stop_token_ids`` and ``ignore_eos`` are taken too.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from runtime.engine import SamplingParams


class APIError(Exception):
    """An error response: HTTP status, OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """What a completion or chat request asks the engine for: token ids, one prompt per choice."""
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    chat: bool = False


#: fields taken, with their JSON types (a bool is not a number here)
COMMON = {"model": (str,), "max_tokens": (int, type(None)), "temperature": (int, float, type(None)),
          "top_p": (int, float, type(None)), "top_k": (int, type(None)), "seed": (int, type(None)),
          "stop": (str, list, type(None)), "stream": (bool, type(None)), "stream_options": (dict, type(None)),
          "stop_token_ids": (list, type(None)), "ignore_eos": (bool, type(None)), "user": (str, type(None))}
COMPLETION = {**COMMON, "prompt": (str, list)}
CHAT = {**COMMON, "messages": (list,), "max_completion_tokens": (int, type(None))}
#: fields taken only at the value that means "off" (anything else is a 400 naming them)
OFF = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
       "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None, "tool_choice": None,
       "functions": None, "function_call": None, "parallel_tool_calls": None,
       "response_format": None}  # {"type": "text"}, the default, is taken too
ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_text(body, "")
    return body


def _check_text(value, where: str) -> None:
    """Every string of the body is text a tokenizer can take: JSON's \\u escapes can spell a lone UTF-16 surrogate,
    which is no character (and which a tokenizer rejects with a TypeError)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            field = where.split(".")[0].split("[")[0] or None
            raise APIError(f"{where or 'a string'} is not valid Unicode text (character {e.start}: a lone UTF-16 "
                           "surrogate escape)", field) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


def _check_fields(body: dict, allowed: dict) -> None:
    for name, value in body.items():
        if name in OFF:
            off = OFF[name]
            # a bool is no number here: logprobs 0 asks for the sampled token's logprob, not for none
            same = value == off and isinstance(value, bool) == isinstance(off, bool)
            if value is not None and not same and not (off is None and (value is False or value in ({}, []))) \
                    and not (name == "response_format" and value == {"type": "text"}):
                raise APIError(f"'{name}' is not supported by this server (only {json.dumps(off)})", name)
            continue
        if name not in allowed:
            raise APIError(f"unknown or unsupported field '{name}'", name)
        types = allowed[name]
        if isinstance(value, bool) and bool not in types:
            types = ()
        if not isinstance(value, types):
            names = {str: "a string", int: "an integer", float: "a number", list: "an array", dict: "an object",
                     bool: "a boolean", type(None): "null"}
            kinds = [t for t in allowed[name] if not (t is int and float in allowed[name])]
            want = " or ".join(names[t] for t in kinds)
            raise APIError(f"'{name}' must be {want}, got {json.dumps(value)[:80]}", name)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or an array of up to 4 non-empty strings", "stop")
    return stop


def _params(body: dict, max_tokens: int | None) -> SamplingParams:
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not 0 <= temperature <= 2:
        raise APIError(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_k = body.get("top_k") or 0
    top_k = 0 if top_k == -1 else top_k
    top_p = 1.0 if body.get("top_p") is None else body["top_p"]
    kwargs = dict(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                  seed=body.get("seed"), stop_token_ids=tuple(body.get("stop_token_ids") or ()),
                  ignore_eos=bool(body.get("ignore_eos")))
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        message = str(e).removeprefix("SamplingParams: ")
        raise APIError(message, message.split(" ")[0]) from None


def _stream_options(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if options and not body.get("stream"):
        raise APIError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    unknown = set(options) - {"include_usage"}
    if unknown:
        raise APIError(f"unknown stream_options field '{sorted(unknown)[0]}'", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError("'stream_options.include_usage' must be a boolean", "stream_options")
    return include


def _max_tokens(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if value < 1:
        raise APIError(f"'{name}' must be >= 1, got {value}", name)
    return value


def completion_request(body: dict, tokenizer) -> Request:
    _check_fields(body, COMPLETION)
    if "prompt" not in body:
        raise APIError("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt and all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                        for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise APIError("'prompt' must be a string, an array of strings, an array of token ids or an array of arrays "
                       "of token ids (none empty)", "prompt")
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise APIError("this model has no tokenizer: give the prompt as token ids", "prompt")
    prompts = [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else p for p in prompts]
    params = _params(body, _max_tokens(body, "max_tokens", 16))
    stop = _stop(body)
    if stop and tokenizer is None:
        raise APIError("'stop' strings need a tokenizer to read the text and this model has none: use "
                       "'stop_token_ids'", "stop")
    return Request(prompts, params, bool(body.get("stream")), _stream_options(body), stop)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:  # only an assistant turn may come without text (one that called a tool)
        if message["role"] != "assistant":
            raise APIError(f"messages[{i}] ({message['role']}) has no 'content'", "messages")
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                               "supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"messages[{i}].content must be a string or an array of text parts", "messages")


def chat_request(body: dict, tokenizer, max_model_len: int | None) -> Request:
    _check_fields(body, CHAT)
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError("this model's tokenizer has no chat template: use /v1/completions")
    messages = body.get("messages")
    if not messages:
        raise APIError("'messages' is required and must not be empty", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(f"messages[{i}] must be an object with a role of {', '.join(ROLES)}", "messages")
        turns.append({"role": m["role"], "content": _content(m, i)})
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001  (a template that refuses these messages)
        raise APIError(f"the chat template refused these messages: {' '.join(str(e).split())}", "messages") from None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise APIError("the chat template made an empty prompt", "messages")
    asked, legacy = _max_tokens(body, "max_completion_tokens", None), _max_tokens(body, "max_tokens", None)
    asked = legacy if asked is None else asked  # max_completion_tokens first, as OpenAI; both are checked
    if max_model_len and len(ids) >= max_model_len:
        raise APIError(f"the messages make a prompt of {len(ids)} tokens (chat template applied); the model's maximum "
                       f"length is {max_model_len} tokens, prompt and output together: send shorter messages",
                       "messages")
    if asked is None:  # as OpenAI: up to the model's length (16 tokens where the config gives none)
        asked = max_model_len - len(ids) if max_model_len else 16
    return Request([ids], _params(body, asked), bool(body.get("stream")), _stream_options(body), _stop(body), True)


# -- responses ---------------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, choices: list[tuple[str, str]], use: dict, chat: bool) -> dict:
    """The whole response; ``choices``: (text, finish_reason) per prompt."""
    if chat:
        items = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None} for i, (text, reason) in enumerate(choices)]
    else:
        items = [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                 for i, (text, reason) in enumerate(choices)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": items, "usage": use}


def chunk(rid: str, model: str, index: int, text: str | None, reason: str | None, chat: bool,
          role: bool = False) -> dict:
    """One streamed piece of choice ``index``: new text and, on its last chunk, the finish reason."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, use: dict, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": use}

