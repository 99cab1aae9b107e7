"""`k3compile serve` as users run it: a live server process on 127.0.0.1 over the compiled k3-tiny artifact, called
with the `openai` package and with raw HTTP (serving/; docs/architecture.md, "Serving")."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hardening import one_line_error, run

from k3compile.serving.bench import start_server

KEY = "test-key-123"
CLI = [sys.executable, "-m", "k3compile.cli"]


@pytest.fixture(scope="module")
def server(tvm_artifact):
    _, out = tvm_artifact
    proc, url = start_server([str(out), "--api-key", KEY, "--max-batch", "8", "--max-queue", "64", "--cache-block",
                              "16"], timeout=120)
    yield proc, url, out
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, "".join(proc.log)[-2000:]


def _generate_cli(out: Path, *args) -> list[int]:
    r = subprocess.run([*CLI, "generate", str(out), *args, "--json", "--quiet"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["tokens"][0]


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_the_server_loads_tvm_s_runtime_library_not_its_compiler(server):
    """serve never compiles: on an artifact compiled for this machine its process maps TVM's runtime library, not the
    compiler library (libtvm_compiler.so, LLVM inside; lean.runtime_library_for). The tokens it serves so are the
    next test's."""
    proc, _, _ = server
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "libtvm_runtime.so" in maps and "libtvm_compiler.so" not in maps


def test_openai_client_gets_what_generate_gives(server):
    _, url, out = server
    client = _client(url)
    assert [m.id for m in client.models.list().data] == [out.name]
    want_chat = _generate_cli(out, "--chat", "--prompt", "hello", "--max-new-tokens", "12")
    want_text = _generate_cli(out, "--prompt", "hello", "--max-new-tokens", "12")
    want_ids = _generate_cli(out, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12")

    chat = client.chat.completions.create(model=out.name, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=12, temperature=0)
    assert _ids(chat.choices[0]) == want_chat
    assert chat.usage.completion_tokens == len(want_chat)
    stream = client.chat.completions.create(model=out.name, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    ids, text, finish, usage = [], "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += c.model_extra.get("token_ids") or []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert ids == want_chat and text == chat.choices[0].message.content
    assert finish == chat.choices[0].finish_reason and usage.completion_tokens == len(want_chat)

    comp = client.completions.create(model=out.name, prompt="hello", max_tokens=12, temperature=0)
    assert _ids(comp.choices[0]) == want_text
    comp = client.completions.create(model=out.name, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
    assert _ids(comp.choices[0]) == want_ids
    streamed = [t for chunk in client.completions.create(model=out.name, prompt=[5, 6, 7, 8], max_tokens=12,
                                                         temperature=0, stream=True)
                for c in chunk.choices for t in (c.model_extra.get("token_ids") or [])]
    assert streamed == want_ids
    # a seeded sampled request repeats itself
    a, b = (client.completions.create(model=out.name, prompt="hi", max_tokens=8, temperature=0.8, seed=3)
            for _ in range(2))
    assert _ids(a.choices[0]) == _ids(b.choices[0])


def test_32_concurrent_streams(server):
    """32 streaming requests at once (the batch holds 8: the rest queue and join as rows free): each gets exactly the
    tokens its prompt gives alone, in order, none lost, duplicated or taken from another request."""
    from k3compile.backends.tvm import TvmBackend
    from k3compile.generate import generate

    _, url, out = server
    prompts = [torch.randint(3, 256, (3 + i % 7,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(32)]
    backend = TvmBackend(out)
    want = [generate(backend, [p], 10 + i % 5, eos_token_id=backend.config.eos_token_id).tokens[0]
            for i, p in enumerate(prompts)]

    async def one(client, i):
        ids, finishes = [], []
        stream = await client.completions.create(model=out.name, prompt=prompts[i], max_tokens=10 + i % 5,
                                                 temperature=0, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                ids += c.model_extra.get("token_ids") or []
                if c.finish_reason:
                    finishes.append(c.finish_reason)
        return ids, finishes

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    for i, (ids, finishes) in enumerate(results):
        assert ids == want[i], f"request {i}"
        assert len(finishes) == 1


def _post(url, path, body, key=KEY, raw=False):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw:
        headers["Content-Type"] = "application/json"
        return httpx.post(url + path, content=body, headers=headers, timeout=60)
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def test_bad_requests_get_json_errors_and_the_server_goes_on(server):
    _, url, out = server
    chat = {"model": out.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (_post(url, "/v1/chat/completions", b'{"model": ', raw=True), 400, "not valid JSON"),
        (_post(url, "/v1/chat/completions", {**chat, "max_tokens": "four"}), 400, "max_tokens"),
        (_post(url, "/v1/chat/completions", {**chat, "temperature": "hot"}), 400, "temperature"),
        (_post(url, "/v1/chat/completions", {**chat, "messages": "hi"}), 400, "messages"),
        (_post(url, "/v1/chat/completions", {**chat, "max_tokens": 0}), 400, "max_tokens"),
        (_post(url, "/v1/chat/completions", {**chat, "temperature": -0.5}), 400, "temperature"),
        (_post(url, "/v1/chat/completions", {**chat, "n": 2}), 400, "n must be 1"),
        (_post(url, "/v1/completions", {"model": out.name, "prompt": [5] * 65000, "max_tokens": 1000}), 400,
         "context"),
        (_post(url, "/v1/completions", {"model": out.name, "prompt": [5, 999]}), 400, "vocabulary"),
        (_post(url, "/v1/chat/completions", {**chat, "model": "gpt-4"}), 404, "does not exist"),
        (_post(url, "/v1/chat/completions", chat, key=None), 401, "API key"),
        (_post(url, "/v1/chat/completions", chat, key="wrong"), 401, "API key"),
        (httpx.get(url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404, "Not Found"),
    ]
    for r, status, text in cases:
        assert r.status_code == status, (r.status_code, r.text)
        err = r.json()["error"]
        assert text in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health").json()["status"] == "ok"  # no key needed there
    r = _post(url, "/v1/chat/completions", chat)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
    # the gate counts every answer by endpoint and status; paths it does not serve under one label (the server is
    # shared with other tests, so at least these)
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    counted = {(m[1], m[2]): float(m[3]) for m in
               re.finditer(r'k3_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)', metrics)}
    assert counted.get(("/v1/chat/completions", "401"), 0) >= 2
    assert counted.get(("/v1/chat/completions", "400"), 0) >= 7
    assert counted.get(("/v1/chat/completions", "200"), 0) >= 1
    assert counted.get(("other", "404"), 0) >= 1 and not any(e == "/v1/nothing" for e, _ in counted)


def test_sse_framing_and_disconnect(server):
    _, url, out = server
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": out.name, "prompt": [7, 8, 9], "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    docs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(d["object"] == "text_completion" and d["id"] == docs[0]["id"] for d in docs)
    assert sum(len(d["choices"][0]["token_ids"]) for d in docs) == 6 or docs[-1]["choices"][0]["finish_reason"]

    # a client that goes mid-stream: its row is freed at the next step, and the server serves on
    body = {**body, "max_tokens": 60000, "prompt": [7, 8, 9]}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    deadline = time.time() + 20
    while time.time() < deadline and httpx.get(url + "/health").json()["running"]:
        time.sleep(0.1)
    assert httpx.get(url + "/health").json()["running"] == 0
    metrics = httpx.get(url + "/metrics", headers=headers).text
    assert re.search(r'k3_finished_requests_total\{reason="cancelled"\} [1-9]', metrics)
    for name in ("k3_time_to_first_token_seconds_bucket", "k3_inter_token_latency_seconds_bucket",
                 "k3_queue_depth", "k3_prefix_cache_hits_total", "k3_generated_tokens_total"):
        assert name in metrics


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_memory_steady_over_500_requests(server):
    """500 requests (streamed and not, some refused, some cut off) after 100 to warm up: the server's resident memory
    grows by less than 32 MiB (allocator noise; a leaked decode state of a request is ~0.2 MiB here, 500 of them
    100 MiB)."""
    proc, url, out = server
    headers = {"Authorization": f"Bearer {KEY}"}

    def burst(n):
        with httpx.Client(headers=headers, timeout=60) as c:
            for i in range(n):
                body = {"model": out.name, "prompt": [3 + i % 200, 4, 5 + i % 7], "max_tokens": 3, "temperature": 0,
                        "stream": i % 2 == 0}
                if i % 10 == 3:
                    body["max_tokens"] = -1  # refused
                if i % 10 == 7:
                    with c.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                                         "max_tokens": 500}) as r:
                        next(r.iter_lines())
                    continue
                r = c.post(url + "/v1/completions", json=body)
                assert r.status_code in (200, 400)

    burst(100)
    before = _rss_kib(proc.pid)
    burst(500)
    time.sleep(0.5)
    assert _rss_kib(proc.pid) - before < 32 * 1024
    assert httpx.get(url + "/health").json()["running"] == 0


def test_queue_full_is_429(tvm_artifact):
    """In process: an engine that is not started keeps what it is given queued; one more is answered 429."""
    from fastapi.testclient import TestClient

    from k3compile.backends.eager import EagerBackend
    from k3compile.serving.app import create_app
    from k3compile.serving.engine import Engine, Request, Sampling
    from k3compile.serving.metrics import Metrics
    from k3compile.source import load_model

    engine = Engine(EagerBackend(load_model("k3-tiny", seed=0)), max_queue=1, metrics=Metrics())
    engine.submit(Request([5, 6], Sampling(3), lambda e: None))
    client = TestClient(create_app(engine, "m"))
    r = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert "k3_queue_depth 1.0" in client.get("/metrics").text


def test_serve_refuses_bad_setups(tmp_path, tvm_artifact):
    import socket

    _, out = tvm_artifact
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "manifest.json").write_text(json.dumps({"kind": "tvm-sharded"}))
    one_line_error(run("serve", str(sharded)), "sharded")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        one_line_error(run("serve", str(out), "--port", str(s.getsockname()[1]), "--quiet"), "cannot listen")
    finally:
        s.close()


@pytest.mark.parametrize("fixture", ["opencl_artifact", "webgpu_artifact"])
def test_engine_serves_gpu_artifacts(fixture, request):
    """A GPU artifact on its executor (PoCL / lavapipe here) behind the engine: rows joined and split (their state
    comes to the host for it), a prefix resumed from the cache; each request's tokens are what `generate` gives it
    alone on the same artifact."""
    from k3compile.backends.executor import ExecutorBackend
    from k3compile.generate import generate
    from k3compile.prefix_cache import PrefixCache
    from k3compile.serving.engine import Engine, Request, Sampling

    backend = ExecutorBackend(request.getfixturevalue(fixture))
    engine = Engine(backend, max_batch=2, cache=PrefixCache(backend.config, 4))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 40, 41], [12, 13]]
    got = [[] for _ in prompts]
    done = []
    for i, p in enumerate(prompts):
        engine.submit(Request(p, Sampling(6), lambda e, i=i: got[i].extend(e.token_ids) if e.kind == "token"
                              else done.append(e)))
    for _ in range(200):
        if len(done) == 3:
            break
        engine.turn()
    assert [e.kind for e in done] == ["done"] * 3
    assert engine.cache.stats.hits >= 1
    for p, tokens in zip(prompts, got):
        assert tokens == generate(backend, [p], 6, eos_token_id=backend.config.eos_token_id).tokens[0]
