"""Bad requests against `tinyllm serve` (a real subprocess, API key set): each gets the right
status in OpenAI's error shape, and the server goes on serving good requests after it."""

import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256
# 12 blocks of 16: 192 tokens of KV cache, so a 200-token prompt fits the model's context but
# never the cache: max_model_len is cut to 192 and the prompt is refused before it runs.
# A budget of 64 tokens a step: longer prompts run in chunks (the default configuration's path
# that once killed the process: a step that runs only a chunk has no row to sample).
BUDGET = 64
SERVE_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-blocks",
    "12",
    "--block-size",
    "16",
    "--max-num-batched-tokens",
    str(BUDGET),
]
LONG = "hello " * 300  # about 300 tokens: over the context
NEVER_FITS = "hello " * 199  # about 200 tokens: fits the context, not the cache


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "serve.log"


@pytest.fixture(scope="module")
def base_url(log_path):
    with open(log_path, "w") as log:
        cmd = [
            sys.executable,
            "-m",
            "tinyllm.entrypoints.cli",
            "serve",
            "--port",
            "0",
            "--api-key",
            KEY,
        ]
        proc = subprocess.Popen(cmd + SERVE_ARGS, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"running on (http://127\.0\.0\.1:\d+)", log_path.read_text())):
            assert proc.poll() is None, f"tinyllm serve exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, (
                f"tinyllm serve did not start:\n{log_path.read_text()}"
            )
            time.sleep(0.1)
        yield m.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def good_request_succeeds(base_url: str) -> None:
    r = httpx.post(
        f"{base_url}/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]

# (path, JSON body or raw bytes, status, param the error names)
BAD = {
    "malformed JSON": (COMPLETION, b'{"prompt": "x",', 400, None),
    "body not an object": (COMPLETION, [1, 2], 400, None),
    "max_tokens a string": (COMPLETION, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    "max_tokens a float": (COMPLETION, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    "negative max_tokens": (COMPLETION, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    "prompt a number": (COMPLETION, {"prompt": 3}, 400, "prompt"),
    "missing prompt": (COMPLETION, {"max_tokens": 3}, 400, "prompt"),
    "empty prompt list": (COMPLETION, {"prompt": []}, 400, "prompt"),
    "top_p 5": (COMPLETION, {"prompt": "x", "top_p": 5}, 400, "top_p"),
    "temperature -1": (COMPLETION, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    "n 0": (COMPLETION, {"prompt": "x", "n": 0}, 400, "n"),
    "empty stop": (COMPLETION, {"prompt": "x", "stop": [""]}, 400, "stop"),
    "logprobs 50": (COMPLETION, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    "seed 2**70": (COMPLETION, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    "logit_bias word key": (COMPLETION, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    "logit_bias too many": (
        COMPLETION,
        {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}},
        400,
        "logit_bias",
    ),
    "logit_bias huge id": (
        COMPLETION,
        {"prompt": "x", "logit_bias": {"999999": 1}},
        400,
        "logit_bias",
    ),
    "logit_bias over the limit": (
        COMPLETION,
        {"prompt": "x", "logit_bias": {"5": 101}},
        400,
        "logit_bias",
    ),
    "logit_bias under the limit": (
        CHAT,
        {"messages": MESSAGES, "logit_bias": {"5": -100.5}},
        400,
        "logit_bias",
    ),
    "token id outside vocab": (COMPLETION, {"prompt": [1, 10**9]}, 400, "prompt"),
    "negative token id": (COMPLETION, {"prompt": [[1], [-1]]}, 400, "prompt"),
    "stop_token_ids outside vocab": (
        COMPLETION,
        {"prompt": "x", "stop_token_ids": [10**9]},
        400,
        "stop_token_ids",
    ),
    "negative stop_token_ids": (
        CHAT,
        {"messages": MESSAGES, "stop_token_ids": [2, -1]},
        400,
        "stop_token_ids",
    ),
    "prompt too long": (COMPLETION, {"prompt": LONG}, 400, "prompt"),
    "prompt + max_tokens too long": (
        COMPLETION,
        {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    "stream_options without stream": (
        COMPLETION,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        None,
    ),
    "lone surrogate": (COMPLETION, {"prompt": "a\ud800"}, 400, "prompt"),
    "lone surrogate in chat": (
        CHAT,
        {"messages": [{"role": "user", "content": "a\ud800"}]},
        400,
        "messages",
    ),
    "too many completions": (COMPLETION, {"prompt": ["a", "b", "c"], "n": 128}, 400, "n"),
    "unknown model": (COMPLETION, {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    "missing messages": (CHAT, {"max_tokens": 3}, 400, "messages"),
    "empty messages": (CHAT, {"messages": []}, 400, "messages"),
    "message without role": (CHAT, {"messages": [{"content": "Hi"}]}, 400, "messages"),
    "image content": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        None,
    ),
    "top_logprobs 21": (
        CHAT,
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    "top_logprobs without logprobs": (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, None),
    "chat prompt too long": (
        CHAT,
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
    ),
    "chat max_completion_tokens too long": (
        CHAT,
        {"messages": MESSAGES, "max_completion_tokens": 10**6},
        400,
        "max_completion_tokens",
    ),
    "tokenize neither": ("/tokenize", {}, 400, None),
    "detokenize outside vocab": ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_request(base_url, case):
    path, body, status, param = BAD[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(f"{base_url}{path}", content=content, headers=headers)
    error = assert_error(r, status, param)
    if case == "prompt + max_tokens too long":  # names both numbers and the limit
        assert all(str(n) in error["message"] for n in (MAX_MODEL_LEN, MAX_MODEL_LEN + 1))
    good_request_succeeds(base_url)


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (COMPLETION, {"stop": [str(i) for i in range(17)]}, "stop", "at most 16 stop strings"),
        (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens=0"),
        (CHAT, {"max_tokens": 0}, "max_tokens", "max_tokens=0 must be an integer >= 1"),
        # Without echo there is nothing to answer with: still refused.
        (COMPLETION, {"max_tokens": 0, "logprobs": 1}, "max_tokens", "max_tokens=0 must be"),
    ],
)
def test_an_error_names_the_field_the_client_sent_and_its_limit(
    base_url, path, body, param, message
):
    body = body | ({"prompt": "x"} if path == COMPLETION else {"messages": MESSAGES})
    error = assert_error(httpx.post(f"{base_url}{path}", json=body, headers=AUTH), 400, param)
    assert message in error["message"], error


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_says_how_to_send_it(base_url, content_type):
    headers = AUTH | ({"Content-Type": content_type} if content_type else {})
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    r = httpx.post(f"{base_url}{COMPLETION}", content=body, headers=headers)
    message = assert_error(r, 400)["message"]
    assert "send the body as JSON with Content-Type: application/json" in message
    assert (content_type or "none") in message
    good_request_succeeds(base_url)


def test_unset_fields_take_the_models_defaults(base_url):
    """The default model carries no recommendations: greedy, up to 512 tokens, so a chat
    request that sets neither gets the complete greedy answer, the same every time."""
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}

    def answer(body: dict) -> dict:  # a whole answer: longer than httpx's 5 s on a busy machine
        return httpx.post(f"{base_url}{CHAT}", json=body, headers=AUTH, timeout=120).json()

    answers = [answer(body) for _ in range(2)]
    greedy = answer(body | {"temperature": 0})
    texts = {a["choices"][0]["message"]["content"] for a in [*answers, greedy]}
    assert len(texts) == 1 and "Paris" in texts.pop()
    assert answers[0]["choices"][0]["finish_reason"] == "stop"


def test_start_up_says_what_is_served_and_where(log_path):
    log = log_path.read_text()
    assert "serving SmolLM2-135M-Instruct.Q4_1 (context 192 tokens) on a free port" in log
    assert "loaded SmolLM2-135M-Instruct.Q4_1: 134.5M parameters" in log
    assert "paged KV cache: 12 blocks x 16 tokens = 192 tokens" in log
    assert "limited by num_blocks" in log
    resident = re.search(r"API key required; (\d+) MB resident", log)
    assert resident and 100 < int(resident[1]) < 1000  # torch and the int4 weights, mostly


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(base_url, headers):
    r = httpx.post(f"{base_url}{COMPLETION}", json={"prompt": "x"}, headers=headers)
    assert_error(r, 401)
    assert_error(httpx.get(f"{base_url}/v1/models", headers=headers), 401)
    assert_error(httpx.get(f"{base_url}/metrics", headers=headers), 401)
    assert_error(httpx.post(f"{base_url}/reset_prefix_cache", headers=headers), 401)
    assert httpx.get(f"{base_url}/health").status_code == 200  # probes need no key
    reset = httpx.post(f"{base_url}/reset_prefix_cache", headers=AUTH)
    assert reset.status_code == 200 and reset.json()["num_blocks_forgotten"] >= 0
    good_request_succeeds(base_url)


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_is_413(base_url, chunked):
    body = json.dumps({"prompt": "x" * (5 << 20)}).encode()
    # A generator has no length: httpx sends it chunked, and the limit trips while reading.
    content = iter([body[i : i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(f"{base_url}{COMPLETION}", content=content, headers=headers)
    assert_error(r, 413)
    good_request_succeeds(base_url)


def test_request_the_cache_can_never_hold(base_url):
    """It fits the model's context but not the KV cache, which cuts max_model_len: refused
    before it runs, and the client hears why."""
    body = {"prompt": NEVER_FITS, "max_tokens": 4}
    r = httpx.post(f"{base_url}{COMPLETION}", json=body, headers=AUTH)
    error = assert_error(r, 400)
    assert (
        "context is 192 tokens (max_model_len, cut to what the KV cache holds" in error["message"]
    )
    assert error["code"] == "context_length_exceeded"
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.APIError, match="KV cache"):
        list(client.completions.create(model=model, stream=True, **body))
    good_request_succeeds(base_url)


def test_odd_but_valid_parameters(base_url):
    body = {
        "prompt": "Hi",
        "max_tokens": 2,
        "top_k": 10**30,
        "stop": "never",
        "user": "me",
        "logit_bias": {"0": -100},
        "temperature": None,
        "some_future_field": 1,
    }
    r = httpx.post(f"{base_url}{COMPLETION}", json=body, headers=AUTH)
    assert r.status_code == 200, r.text


def test_one_log_line_per_request(base_url, log_path):
    good_request_succeeds(base_url)
    httpx.post(f"{base_url}{COMPLETION}", json={"prompt": "x", "top_p": 5}, headers=AUTH)
    time.sleep(0.2)  # the subprocess writes its log on its own schedule
    lines = log_path.read_text().splitlines()
    assert any(
        re.search(r"cmpl-\w+: 1 choice\(s\), \d+ prompt \+ \d+ completion", x) for x in lines
    )
    assert any("POST /v1/completions -> 400: top_p=5.0" in line for line in lines)


def test_a_prompt_longer_than_the_budget_and_seeds_at_the_limit(base_url):
    """The default configuration (int4, CPU attention) serving a prompt of about 150 tokens in
    chunks of 64; n=2 with the largest seed (choice 1's seed wraps instead of overflowing)."""
    body = {"prompt": "hello " * 150, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{base_url}{COMPLETION}", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 2 * BUDGET
    assert r.json()["usage"]["completion_tokens"] == 4
    for path, extra in ((COMPLETION, {"prompt": "Hi"}), (CHAT, {"messages": MESSAGES})):
        body = {"max_tokens": 3, "seed": 2**63 - 1, "n": 2, "temperature": 1.0, **extra}
        r = httpx.post(f"{base_url}{path}", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = httpx.post(f"{base_url}{COMPLETION}", json={"prompt": "Hi", "seed": 2**63}, headers=AUTH)
    assert assert_error(r, 400, "seed")
    good_request_succeeds(base_url)
