"""`openai`: a running server that speaks the OpenAI-compatible completions API (vLLM, SGLang) as the rollout
engine, paired with a trainer in the suite's process on the same checkpoint (the reference's; `openai+hf`,
or `--rollout openai --trainer T`, for another).

The server is named by `--server-url URL` (or env `LOGDIFF_SERVER_URL`, e.g. http://127.0.0.1:8000);
the model it serves by env `LOGDIFF_SERVER_MODEL`, else the first id of its `GET /v1/models`. Start
it on the checkpoint the trainer builds: `--model DIR` for your own, or, for the seeded default,
`ModelSpec(name, seed).checkpoint_dir(dtype)`; with `--dtype` matching, and (vLLM)
`--logprobs-mode processed_logprobs` so a sampled token's log-prob is of the distribution sampled from
(tempered, truncated). The mode is the server's, fixed at its start: env `LOGDIFF_SERVER_LOGPROBS_MODE`
(processed, the default, or raw for a server started with raw_logprobs) says which, and requests that
ask for the other are declined.

Each request is one `POST /v1/completions` with the prompt as token ids, `max_tokens`, `temperature`,
`seed`, `logprobs: 0` (the sampled token's) and `return_tokens_as_token_ids: true` (tokens come back as
"token_id:N", so no tokenizer is needed on either side), `ignore_eos`, the request's top_k (-1: off),
top_p and min_p (vLLM's and SGLang's extra sampling parameters). Requests are
sent together (the server batches them as it likes; `arrival` is not honoured); a server's engine
options are fixed when it starts, so other `EngineOptions` are declined. One attempt per request, a
timeout on each (`LOGDIFF_REMOTE_TIMEOUT`, default 600 s); any failure is one line (exit 2).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from logdiff.api import DEFAULT_LOGPROBS_MODE, LOGPROB_MODES, EngineOptions, Unsupported
from logdiff.errors import UserError
from logdiff.remote import DEFAULT_TIMEOUT_S, RemoteError, RemoteRollout

MAX_IN_FLIGHT = 32


def server_url() -> str:
    url = os.environ.get("LOGDIFF_SERVER_URL", "").rstrip("/")
    if not url:
        raise UserError("stack openai needs a server: pass --server-url URL (or set LOGDIFF_SERVER_URL), "
                        "e.g. http://127.0.0.1:8000")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"server URL {url!r} is not http(s)://host:port")
    return url


def server_logprobs_mode() -> str:
    """The log-prob mode the server was started with (env LOGDIFF_SERVER_LOGPROBS_MODE, default processed)."""
    mode = os.environ.get("LOGDIFF_SERVER_LOGPROBS_MODE", DEFAULT_LOGPROBS_MODE)
    if mode not in LOGPROB_MODES:
        raise UserError(f"LOGDIFF_SERVER_LOGPROBS_MODE={mode!r} is not a log-prob mode; set it to "
                        f"{' or '.join(LOGPROB_MODES)} (the server's --logprobs-mode, processed_logprobs or raw_logprobs)")
    return mode


def request_body(model: str | None, request) -> dict:
    body = {
        "prompt": list(request.prompt), "max_tokens": request.max_new_tokens, "logprobs": 0,
        "return_tokens_as_token_ids": True, "ignore_eos": True, "top_p": 1.0, "top_k": -1,
        "temperature": request.temperature,
    }
    if request.temperature > 0:
        body.update(seed=request.seed, top_k=request.top_k or -1, top_p=request.top_p, min_p=request.min_p)
    if model:
        body["model"] = model
    return body


def parse_choice(url: str, reply: dict, asked: int) -> tuple[list[int], list[float]]:
    """(tokens, log-probs) of a completions reply; a reply without them is one line saying so."""
    try:
        choice = reply["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise RemoteError(f"server at {url} answered without choices: {json.dumps(reply)[:200]}") from None
    logprobs = choice.get("logprobs")
    if not logprobs or logprobs.get("token_logprobs") is None:
        raise RemoteError(f"server at {url} returned no log-probs (choices[0].logprobs is {json.dumps(logprobs)[:80]}); "
                          "it must support 'logprobs' on /v1/completions")
    try:
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    except (KeyError, ValueError, AttributeError):
        raise RemoteError(f"server at {url} returned tokens that are not 'token_id:N' "
                          f"({str(logprobs.get('tokens'))[:80]}); it must honour return_tokens_as_token_ids") from None
    values = logprobs["token_logprobs"]
    if len(tokens) != asked or len(values) != asked or any(v is None for v in values):
        raise RemoteError(f"server at {url} returned {len(tokens)} tokens / {len(values)} log-probs for {asked} asked "
                          f"(finish_reason {choice.get('finish_reason')!r})")
    return tokens, [float(v) for v in values]


def call(url: str, path: str, body: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """One HTTP exchange with the server; every failure is a RemoteError of one line."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raw = e.read().decode(errors="replace")
        try:
            message = json.loads(raw)["error"]["message"]
        except (json.JSONDecodeError, KeyError, TypeError):
            message = raw[:200]
        raise RemoteError(f"server at {url} answered {path} with HTTP {e.code}: {message}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise RemoteError(f"server at {url} did not answer {path} within {timeout:g} s") from None
        raise RemoteError(f"cannot reach server at {url} ({reason}); is it running?") from None
    except (socket.timeout, TimeoutError):
        raise RemoteError(f"server at {url} did not answer {path} within {timeout:g} s") from None
    except (http.client.HTTPException, ConnectionError, OSError) as e:
        raise RemoteError(f"server at {url} closed the connection during {path} ({type(e).__name__}); "
                          "did it stop?") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise RemoteError(f"server at {url} answered {path} with something that is not JSON: {raw[:120]!r}") from None


class OpenAIStack(RemoteRollout):
    """A server's completions endpoint as the rollout engine."""

    def __init__(self, spec, dtype, max_model_len, name: str = "openai"):
        super().__init__(spec, dtype, max_model_len)
        self.name = name
        self.url = server_url()
        self.model = os.environ.get("LOGDIFF_SERVER_MODEL") or None
        self.timeout = DEFAULT_TIMEOUT_S
        self.logprobs_mode = server_logprobs_mode()

    def served_model(self) -> str:
        if self.model is None:
            listed = call(self.url, "/v1/models", timeout=self.timeout)
            try:
                self.model = listed["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise RemoteError(f"server at {self.url} lists no model at /v1/models; set LOGDIFF_SERVER_MODEL") from None
        return self.model

    def remote_rollout(self, requests, options):
        if options != EngineOptions():
            raise Unsupported("a running server's engine options (KV block, chunked prefill) are fixed when it starts")
        other = {r.logprobs_mode for r in requests} - {self.logprobs_mode}
        if other:
            raise Unsupported(f"the server computes {self.logprobs_mode} log-probs (its --logprobs-mode, fixed when it "
                              f"starts; LOGDIFF_SERVER_LOGPROBS_MODE), not {other.pop()} ones")
        model = self.served_model()

        def one(request):
            reply = call(self.url, "/v1/completions", request_body(model, request), timeout=self.timeout)
            return parse_choice(self.url, reply, request.max_new_tokens)

        with ThreadPoolExecutor(max_workers=min(MAX_IN_FLIGHT, len(requests))) as pool:
            futures = {i: pool.submit(one, requests[i]) for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival)}
            return [futures[i].result() for i in range(len(requests))]

    def describe(self) -> dict:
        info = super().describe()
        info["server"] = self.url
        info["served_model"] = self.model or "(first of /v1/models)"
        info["server_logprobs_mode"] = self.logprobs_mode
        return info


def openai_rollout(spec, dtype, max_model_len):
    """an OpenAI-compatible completions server (--server-url)"""
    return OpenAIStack(spec, dtype, max_model_len)


def openai_unavailable() -> str | None:
    if not os.environ.get("LOGDIFF_SERVER_URL"):
        return "needs a server: pass --server-url URL (or set LOGDIFF_SERVER_URL)"
    return None


openai_rollout.side = "rollout"
openai_rollout.unavailable = openai_unavailable
