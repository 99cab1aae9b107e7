"""The HTTP API's request reader fuzzed (serving/app.py): whatever JSON a client sends, the answer is a generation
(200) or an OpenAI-shaped JSON error with a client status, never a 500 or a traceback, and the server goes on.
In process (FastAPI's TestClient) over eager k3-tiny; the live server is tests/export/test_serve.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from k3compile.backends.eager import EagerBackend
from k3compile.serving.app import create_server
from k3compile.source import load_model, tokenizer_for


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    backend = EagerBackend(load_model("k3-tiny", seed=0))
    app, engine = create_server(backend, tokenizer_for("k3-tiny", backend.config), "m", max_queue=64,
                                cache_block=4)
    with TestClient(app) as c:
        yield c
    engine.close()


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False, width=32)
                       | st.text(max_size=8), lambda kids: st.lists(kids, max_size=3)
                       | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=6)
FIELDS = {
    "model": st.just("other") | JSONISH,
    # never absent, null or large: a chat request without max_tokens runs to the context (65536 tokens)
    "max_tokens": st.integers(-2, 3) | st.text(max_size=3) | st.booleans() | st.floats(-1, 3),
    "temperature": st.sampled_from([0, 0.5, -1.0, 1e30]) | JSONISH,
    "top_p": st.sampled_from([0.5, 1, 0, 2]) | JSONISH,
    "stream": st.booleans() | JSONISH,
    "stop": st.sampled_from(["a", ["a", "b"], [""], ["a"] * 5]) | JSONISH,
    "seed": st.integers(-2**70, 2**70) | JSONISH,
    "n": st.sampled_from([1, 2]) | JSONISH,
    "prompt": st.sampled_from(["hi", [5, 6], [[5], [7, 8]], ["a", "b"], [], [300], [[]]]) | JSONISH,
    "messages": st.sampled_from([[{"role": "user", "content": "hi"}], [], [{"role": "user"}],
                                 [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                 [{"role": "user", "content": [{"type": "image_url"}]}]]) | JSONISH,
    "logprobs": st.booleans() | JSONISH,
}


VALID = {"/v1/chat/completions": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
         "/v1/completions": {"model": "m", "max_tokens": 2, "prompt": [5, 6]}}


@st.composite
def _mutated(draw):
    """A valid request with up to two fields set to a fuzzed value (or dropped), or any JSON at all."""
    path = draw(st.sampled_from(sorted(VALID)))
    if draw(st.integers(0, 4)) == 0:
        return path, draw(JSONISH)
    body = dict(VALID[path])
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        if name != "max_tokens" and draw(st.booleans()) and name in body:
            del body[name]
        else:
            body[name] = draw(FIELDS[name])
    return path, body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=_mutated(), raw=st.integers(0, 5))
@example(case=("/v1/completions", {**VALID["/v1/completions"], "model": "other"}), raw=1)
@example(case=("/v1/chat/completions", VALID["/v1/chat/completions"]), raw=1)
@example(case=("/v1/completions", {**VALID["/v1/completions"], "seed": 2**65}), raw=1)  # past torch's seeds: 400
def test_any_body_gets_an_answer_or_a_json_error(client, case, raw):
    path, body = case
    content = json.dumps(body).encode()
    if raw == 0:
        content = content[: len(content) // 2]  # cut: malformed JSON (or an empty body) most of the time
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400, 404, 429), (r.status_code, r.text)
    STATUSES.append(r.status_code)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        doc = r.json()
        assert doc["choices"] and all(1 <= len(c["token_ids"]) <= 3 for c in doc["choices"])


STATUSES: list[int] = []


def test_after_the_fuzz_it_still_serves(client):
    assert {200, 400, 404} <= set(STATUSES), sorted(set(STATUSES))  # the fuzz reached generation and each refusal
    r = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    assert client.get("/health").json()["running"] == 0
