"""``hybrid serve``: the OpenAI-compatible server, driven by the official ``openai`` client against a server on
127.0.0.1 (tiny zoo llama with its character tokenizer). Tokens are compared with the engine run in this process;
streaming, concurrent clients, a client that disconnects mid-stream, stop strings, bad requests (a JSON 4xx, never a
500) and a step that fails (a JSON 500)."""
import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from runtime.engine import Engine, SamplingParams  # noqa: E402
from runtime.serve import server as serve_app  # noqa: E402

MODEL = "llama"
PROMPTS = ["Hello", "The quick brown fox", "a"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The app under uvicorn in a thread of this process (the test can look at its engine)."""

    def __init__(self, engine: Engine):
        self.engine, self.port = engine, free_port()
        self.server = serve_app(engine, MODEL, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server():
    s = Server(Engine.from_pretrained(MODEL, compile=None, max_num_seqs=32))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def alone():
    """Greedy tokens of a prompt on an engine nothing else touches."""
    engine = Engine.from_pretrained(MODEL, compile=None)

    def run(ids, max_tokens, **kw):
        return engine.generate([ids], SamplingParams(max_tokens=max_tokens, **kw))[0].token_ids
    run.tokenizer = engine.tokenizer
    return run


def ids_of(alone, text):
    return list(alone.tokenizer(text)["input_ids"])


def idle(engine, seconds=20.0):
    """Wait until the engine has nothing left (requests end on the loop's thread)."""
    deadline = time.time() + seconds
    while engine.has_unfinished():
        assert time.time() < deadline, "requests still running on the server"
        time.sleep(0.02)
    if engine.blocks is not None:
        assert engine.blocks.num_free == engine.blocks.num_blocks - 1


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().models.retrieve("other")
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completions_are_the_engines_tokens(server, alone):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=7, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, PROMPTS):
        want = alone(ids_of(alone, p), 7)
        assert c.token_ids == want and c.text == alone.tokenizer.decode(want, skip_special_tokens=True)
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(len(ids_of(alone, p)) for p in PROMPTS) and r.usage.completion_tokens == 21
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [40, 41]], max_tokens=4, temperature=0)
    assert [c.token_ids for c in r.choices] == [alone([5, 6, 7], 4), alone([40, 41], 4)]
    seeded = [client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0.9, seed=3)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    idle(server.engine)


def test_streaming_completion_and_chat(server, alone):
    client = server.client()
    pieces, ids, reasons = [], [], []
    for ch in client.completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0, stream=True):
        pieces.append(ch.choices[0].text)
        ids += ch.choices[0].token_ids
        reasons.append(ch.choices[0].finish_reason)
    want = alone(ids_of(alone, "Hello"), 9)
    assert ids == want and "".join(pieces) == alone.tokenizer.decode(want, skip_special_tokens=True)
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None} and len(pieces) >= 2
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = ids_of(alone, alone.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    want = alone(prompt, 6)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.content == alone.tokenizer.decode(want, skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    idle(server.engine)


def test_stop_strings_end_the_text_and_the_request(server, alone):
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0).choices[0].text
    stop = full[5:7]
    assert len(stop) == 2 and stop not in full[:6]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0, stop=[stop, "\x01"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:full.index(stop)], "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=20, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text
    idle(server.engine)


def test_a_stop_string_ends_its_choice_once_among_several_prompts(server, alone):
    """Several prompts in one call, two of them stopped by a stop string while the third runs on: a stopped choice
    gets no token the engine made before it heard the abort, and one finish (a single chunk when streaming)."""
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0)
    stop = full.choices[0].text[5:7]
    one = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0, stop=stop)
    prompts = ["Hello", "The quick brown fox", "Hello"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, temperature=0, stop=stop)
    for i in (0, 2):
        assert (r.choices[i].text, r.choices[i].finish_reason) == (one.choices[0].text, "stop")
        assert r.choices[i].token_ids == one.choices[0].token_ids
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    ends, ids = {}, {}
    for ch in client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, temperature=0, stop=stop,
                                        stream=True):
        c = ch.choices[0]
        ids.setdefault(c.index, []).extend(c.token_ids)
        if c.finish_reason is not None:
            ends[c.index] = ends.get(c.index, 0) + 1
    assert ends == {0: 1, 1: 1, 2: 1}
    assert [ids[i] for i in range(3)] == [c.token_ids for c in r.choices]
    idle(server.engine)


def test_many_concurrent_streaming_clients_get_the_engines_tokens(server, alone):
    prompts = [[8 + (i * 7) % 200, 9 + i % 90, 10 + (i * 13) % 150][: 1 + i % 3] for i in range(256)]
    want = [alone(p, 6) for p in prompts]

    async def one(client, p):
        ids = []
        async for ch in await client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                                        stream=True):
            ids += ch.choices[0].token_ids
        return ids

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=300)))
        return await asyncio.gather(*(one(client, p) for p in prompts))
    got = asyncio.run(main())
    assert got == want
    idle(server.engine)


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    engine = server.engine
    before = engine.stats["decode_tokens"]
    body = dict(model=MODEL, prompt="Hello", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in first)
    idle(engine)
    assert engine.stats["decode_tokens"] - before < 150  # it stopped well before its 200 tokens
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert len(r.choices[0].token_ids) == 3


@pytest.mark.parametrize("path, body, status, match", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", {"prompt": "hi", "temprature": 0}, 400, "unknown or unsupported field 'temprature'"),
    ("/v1/completions", {"prompt": "hi", "temperature": 5}, 400, r"'temperature' must be in \[0, 2\]"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400,
     "'temperature' must be a number or null, got \"hot\""),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6}, 400, "exceeds the model's maximum length"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p must be"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "'n' is not supported"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "'logprobs' is not supported"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 0}, 400, "'logprobs' is not supported"),
    ("/v1/completions", {"prompt": ""}, 400, "empty prompt"),
    ("/v1/completions", {"prompt": []}, 400, "'prompt' must be"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, r"outside the vocabulary \[0, 256\)"),
    ("/v1/completions", {"prompt": ["ok", [5]]}, 400, "'prompt' must be"),
    ("/v1/completions", {}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "up to 4"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "only allowed with"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "'messages' is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2,
                              "max_tokens": -1}, 400, "'max_tokens' must be >= 1, got -1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, 400,
     r"a prompt of \d+ tokens \(chat template applied\); the model's maximum length is 256 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "with a role of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "'tools' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, r"messages\[0\] \(user\) has no 'content'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "'response_format' is not supported"),
    ("/v1/completions", {"prompt": "\ud800"}, 400, "prompt is not valid Unicode text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]}, 400,
     r"messages\[0\]\.content is not valid Unicode text \(character 1"),
    ("/v1/nothing", {}, 404, "POST /v1/nothing: Not Found"),
])
def test_bad_requests_are_json_errors(server, path, body, status, match):
    import re
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert re.search(match, error["message"]) and "Traceback" not in r.text
    assert not server.engine.has_unfinished()


def test_engine_refusals_name_their_field(server):
    """A request the engine refuses (ids outside the vocabulary, too long) is a 400 whose param names the field."""
    for body, param in (({"prompt": "hi", "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
                        ({"prompt": [5, 999]}, "prompt"), ({"prompt": "hi", "max_tokens": 10 ** 6}, "prompt")):
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_what_clients_send_by_default_is_taken(server):
    """response_format {"type": "text"} (the default some clients send) and an assistant turn without text."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "and?"}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("length", "stop")


def test_wrong_method_and_the_openai_client_errors(server):
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="'best_of' is not supported"):
        server.client().completions.create(model=MODEL, prompt="x", best_of=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_shutdown_ends_open_streams_cleanly():
    """A server stopped while a stream is under way ends it first: its last chunk (finish reason "abort") and
    ``[DONE]`` reach the client, and the shutdown does not wait out the graceful timeout (5 s)."""
    engine = Engine.from_pretrained(MODEL, compile=None)
    real = engine.runner.forward

    def slow(*args, **kwargs):  # 240 tokens take 5 s or more: the stream is under way when the server stops
        time.sleep(0.02)
        return real(*args, **kwargs)
    engine.runner.forward = slow
    s = Server(engine)
    body = dict(model=MODEL, prompt="Hello", max_tokens=240, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        t0 = time.time()
        threading.Thread(target=s.stop, daemon=True).start()
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    s.thread.join(30)
    assert not s.thread.is_alive() and time.time() - t0 < 4


def test_a_failing_step_is_a_json_500_and_the_server_goes_on():
    engine = Engine.from_pretrained(MODEL, compile=None)
    real = engine.runner.forward

    def forward(ids, *args, **kwargs):
        if 250 in ids.reshape(-1).tolist():
            raise RuntimeError("poisoned step")
        return real(ids, *args, **kwargs)
    engine.runner.forward = forward
    s = Server(engine)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [5, 250], "max_tokens": 3}, timeout=30)
        assert r.status_code == 500 and "poisoned step" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                          json={"prompt": [5, 250], "max_tokens": 3, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "poisoned step" in events[-2] and events[-1] == "data: [DONE]"
        r = s.client().completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, temperature=0)
        assert len(r.choices[0].token_ids) == 3
        idle(engine)
    finally:
        s.stop()


def test_hybrid_serve_command(tmp_path):
    """The CLI entry point, as a user starts it: it warms up, serves on the port it announces (--port 0: one the
    system chose), and Ctrl-C stops it."""
    import re
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", MODEL, "--port", "0", "--compile",
                             "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        while not (found := re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1", lines[-1] if lines else "")):
            line = proc.stdout.readline()
            assert line, "".join(lines) or "no start"
            lines.append(line)
        port = int(found.group(1))
        assert port != 0
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, "no /health"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        proc.send_signal(2)
        out = "".join(lines) + proc.communicate(timeout=60)[0]
    assert "Traceback" not in out
    assert "warm-up done" in out.split("serving")[0], "the server listened before its warm-up"


def test_a_model_without_tokenizer_serves_token_ids_only(alone):
    from runtime import zoo
    s = Server(Engine(zoo.build(MODEL), compile=None))
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == alone([5, 6, 7], 4)
        for body, match in (({"prompt": "hi"}, "no tokenizer: give the prompt as token ids"),
                            ({"prompt": [5], "stop": "x"}, "'stop' strings need a tokenizer"),
                            ({"messages": [{"role": "user", "content": "x"}]}, "no tokenizer, so no chat template")):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(s.url + path, json=body, timeout=30)
            assert r.status_code == 400 and match in r.json()["error"]["message"]
    finally:
        s.stop()


def test_a_client_that_disconnects_while_sending_its_request_is_dropped_quietly(server, caplog):
    """Half a request body, then the connection closes: no traceback in the log, and the server goes on."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.2)
    time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert len(r.choices[0].token_ids) == 2
