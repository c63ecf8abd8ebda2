"""Out-of-process rollout without vLLM: the JSON-lines child protocol (timeouts, death, restart, one-line
errors), the vllm adapter's option mapping and its round trip through a stand-in child, the Ascend
switches, and the openai stack against a stub completions server on 127.0.0.1."""

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from logdiff import stacks
from logdiff.api import EngineOptions, Processing, Request, Unsupported
from logdiff.baselines import vllm as vllm_adapter
from logdiff.baselines.openai import OpenAIStack
from logdiff.errors import UserError
from logdiff.remote import ChildProcess, RemoteError, RemoteRollout, close_all, wait_for_idle
from logdiff.weights import ModelSpec

FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    for line in sys.stdin:
        m = json.loads(line)
        op = m.get("op")
        if op == "exit":
            break
        if op == "die":
            os._exit(3)
        if op == "sleep":
            time.sleep(m["seconds"])
        if op == "garbage":
            print("not json", flush=True)
            continue
        if op == "fail":
            print(json.dumps({"ok": False, "error": "ValueError: bad"}), flush=True)
            continue
        if op == "init":
            print(json.dumps({"ok": True, "pid": os.getpid(), "init": m.get("llm"), "weights": m.get("weights")}), flush=True)
            continue
        if op == "generate":  # a stand-in engine: token k of request i is (prompt[0] + k) % 7, log-prob -1/(k+3)
            rs = m["requests"]
            steps = [range(r["params"]["max_tokens"]) for r in rs]
            print(json.dumps({"ok": True, "tokens": [[(r["prompt"][0] + k) % 7 for k in ks] for r, ks in zip(rs, steps)],
                              "logprobs": [[-1 / (k + 3) for k in ks] for ks in steps],
                              "params": [r["params"] for r in rs]}), flush=True)
            continue
        print(json.dumps({"ok": True, "pid": os.getpid(), "echo": m}), flush=True)
""")


@pytest.fixture
def fake_child(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(FAKE_CHILD)
    yield path
    close_all()


def test_child_round_trip_restart_and_one_line_errors(fake_child):
    child = ChildProcess([sys.executable, str(fake_child)], "fake engine", init={"op": "init"}, timeout=5)
    first = child.call({"op": "echo", "x": [1.5]})
    assert first["echo"]["x"] == [1.5] and child.starts == 1
    with pytest.raises(RemoteError, match=r"^fake engine failed at fail: ValueError: bad") as e:
        child.call({"op": "fail"})
    assert "\n" not in str(e.value)
    with pytest.raises(RemoteError, match="died during die"):
        child.call({"op": "die"})
    second = child.call({"op": "echo"})  # started again on the next call
    assert child.starts == 2 and second["pid"] != first["pid"]
    with pytest.raises(RemoteError, match="gave no answer to sleep within 0.5 s"):
        child.call({"op": "sleep", "seconds": 30}, timeout=0.5)
    assert not child.alive
    with pytest.raises(RemoteError, match="not JSON"):
        child.call({"op": "garbage"})
    child.close()
    assert not child.alive


def test_at_most_max_children_run(fake_child, monkeypatch):
    monkeypatch.setattr("logdiff.remote.MAX_CHILDREN", 2)
    children = [ChildProcess([sys.executable, str(fake_child)], f"fake {i}", timeout=5) for i in range(3)]
    for c in children:
        c.call({"op": "echo"})
    assert [c.alive for c in children] == [False, True, True]
    assert children[0].call({"op": "echo"})  # starts again, closing the least recently used
    assert [c.alive for c in children] == [True, False, True]


class FakeClock:
    """A clock that advances only when slept on, and a CPU counter read from a script: no timing involved."""

    def __init__(self, cpu_readings):
        self.now, self.readings = 0.0, list(cpu_readings)

    def sleep(self, seconds):
        self.now += seconds

    def clock(self):
        return self.now

    def cpu_seconds(self):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_wait_for_idle_waits_while_the_group_burns_cpu_then_returns():
    """What vLLM's engine does for about 1 s after a request: the bench must not time the next stack meanwhile."""
    fake = FakeClock([0.0, 0.1, 0.2, 0.3, 0.305])  # busy for three windows of 0.1 s, then idle
    windows = wait_for_idle(fake.cpu_seconds, 0.1, 10.0, sleep=fake.sleep, clock=fake.clock)
    assert windows == 4


def test_wait_for_idle_returns_after_one_window_when_idle_and_gives_up_at_the_timeout():
    idle = FakeClock([1.0])
    assert wait_for_idle(idle.cpu_seconds, 0.1, 10.0, sleep=idle.sleep, clock=idle.clock) == 1
    busy = FakeClock([i * 0.1 for i in range(1000)])
    assert wait_for_idle(busy.cpu_seconds, 0.1, 2.0, sleep=busy.sleep, clock=busy.clock) == 20


def test_cpu_seconds_counts_the_child_process_group():
    """A child that did a fixed amount of work shows CPU time > 0 (however loaded the machine) and wait_idle returns."""
    work = "sum(i * i for i in range(3_000_000))\nprint('done', flush=True)\nimport time; time.sleep(60)"
    child = ChildProcess([sys.executable, "-c", work], "a busy child")
    child.start()
    try:
        assert child.proc.stdout.readline().strip() == "done"
        assert child.cpu_seconds() > 0
        child.wait_idle(timeout_s=30)
    finally:
        child.close(grace_s=0)


def test_child_that_cannot_start_is_one_line():
    child = ChildProcess(["/nonexistent/python", "x.py"], "fake engine")
    with pytest.raises(RemoteError, match="cannot start fake engine"):
        child.call({"op": "echo"})


class Constant(RemoteRollout):
    name = "constant"

    def remote_rollout(self, requests, options):
        return [([1] * r.max_new_tokens, [-0.1] * r.max_new_tokens) for r in requests]


def test_remote_rollout_keeps_fp32_bits_and_checks_token_ids():
    stack = Constant(ModelSpec("qwen3-moe-tiny"), torch.float32, 256)
    out = stack.rollout([Request((1, 2), 3)])
    value = torch.tensor(-0.1, dtype=torch.float32)
    assert out[0].tokens == [1, 1, 1] and out[0].logprobs.dtype == torch.float32
    # the double repr of an fp32 value survives JSON and comes back with the same bits
    assert torch.equal(torch.tensor(json.loads(json.dumps([float(value)])), dtype=torch.float32), value[None])
    with pytest.raises(UserError, match="token id 1024 outside the vocabulary"):
        stack.rollout([Request((1, 1024), 3)])
    with pytest.raises(Unsupported, match="constant is a rollout engine only: pair it with a trainer"):
        stack.trainer_logprobs([[1, 2]], [1], [0.0])


@pytest.mark.parametrize("page", [32, 64, 128, 256])
def test_vllm_block_sizes_that_cpu_attention_takes(page):
    kw = vllm_adapter.engine_kwargs("/ckpt", torch.bfloat16, 512, EngineOptions(page_size=page))
    assert kw["block_size"] == page and kw["dtype"] == "bfloat16" and kw["enforce_eager"]
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["skip_tokenizer_init"]


def test_vllm_option_mapping_and_declines():
    with pytest.raises(Unsupported, match="multiples of 32 only, not 16"):
        vllm_adapter.engine_kwargs("/ckpt", torch.float32, 512, EngineOptions(page_size=16))
    with pytest.raises(Unsupported, match="block tables"):
        vllm_adapter.engine_kwargs("/ckpt", torch.float32, 512, EngineOptions(shuffle_pages=1))
    kw = vllm_adapter.engine_kwargs("/ckpt", torch.float32, 512, EngineOptions(prefill_chunk=7))
    assert kw["enable_chunked_prefill"] and kw["max_num_batched_tokens"] == 7 and kw["max_num_seqs"] == 7
    assert "enable_chunked_prefill" not in vllm_adapter.engine_kwargs("/ckpt", torch.float32, 512, EngineOptions())
    greedy = vllm_adapter.sampling_params(Request((1,), 4))
    sampled = vllm_adapter.sampling_params(Request((1,), 4, temperature=0.7, seed=11))
    assert greedy["temperature"] == 0 and "seed" not in greedy and greedy["logprobs"] == 0
    assert sampled["temperature"] == 0.7 and sampled["seed"] == 11 and sampled["top_k"] == 0 and sampled["top_p"] == 1


def test_vllm_maps_truncation_to_sampling_params_and_the_mode_to_logprobs_mode():
    sampled = vllm_adapter.sampling_params(Request((1,), 4, temperature=0.8, seed=3, top_k=50, top_p=0.9, min_p=0.05))
    assert (sampled["top_k"], sampled["top_p"], sampled["min_p"]) == (50, 0.9, 0.05)
    greedy = vllm_adapter.sampling_params(Request((1,), 4, top_k=50, top_p=0.9))  # greedy: nothing to truncate
    assert (greedy["top_k"], greedy["top_p"], greedy["temperature"]) == (0, 1.0, 0.0)
    raw = vllm_adapter.engine_kwargs("/ckpt", torch.float32, 512, EngineOptions(), logprobs_mode="raw")
    assert raw["logprobs_mode"] == "raw_logprobs"


def test_vllm_declines_what_one_engine_cannot_honour():
    stack = vllm_adapter.VLLMStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 256)
    both = [Request((1,), 2, 0.8, logprobs_mode="processed"), Request((2,), 2, 0.8, logprobs_mode="raw")]
    with pytest.raises(Unsupported, match="logprobs_mode is one per engine .* ask for processed and raw log-probs"):
        stack.rollout(both)
    with pytest.raises(Unsupported, match=r"prompt_logprobs are raw log-probs \(temperature 1, untruncated\)"):
        stack.prompt_logprobs([[1, 2, 3]], [1], [1.0], processing=[Processing(top_p=0.9)])


def test_openai_sends_the_truncation_and_declines_the_mode_its_server_lacks(stub_server, monkeypatch):
    from logdiff.baselines.openai import request_body

    body = request_body("tiny", Request((1,), 4, temperature=0.8, seed=3, top_k=50, top_p=0.9, min_p=0.05))
    assert (body["top_k"], body["top_p"], body["min_p"], body["seed"]) == (50, 0.9, 0.05, 3)
    assert request_body("tiny", Request((1,), 4, temperature=0.8))["top_k"] == -1  # vLLM's "off"
    stack = OpenAIStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 256)
    with pytest.raises(Unsupported, match="the server computes processed log-probs .* not raw ones"):
        stack.rollout([Request((7,), 1, 0.8, logprobs_mode="raw")])
    monkeypatch.setenv("LOGDIFF_SERVER_LOGPROBS_MODE", "raw")
    assert OpenAIStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 256).rollout([Request((7,), 1, 0.8, logprobs_mode="raw")])
    monkeypatch.setenv("LOGDIFF_SERVER_LOGPROBS_MODE", "logits")
    with pytest.raises(UserError, match="LOGDIFF_SERVER_LOGPROBS_MODE='logits' is not a log-prob mode"):
        OpenAIStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 256)


def test_ascend_switches_read_back():
    env, kwargs = vllm_adapter.ascend_switches()
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["VLLM_ATTENTION_BACKEND"] == "FLASH_ATTN"
    assert env["HCCL_DETERMINISTIC"] == "strict"
    assert kwargs == {"block_size": 128, "enforce_eager": True}
    assert vllm_adapter.batch_invariant_switches()[0] == {"VLLM_BATCH_INVARIANT": "1"}


@pytest.mark.skipif(vllm_adapter.ascend_unavailable() is None, reason="an Ascend host")
def test_ascend_declines_off_an_ascend_host():
    with pytest.raises(Unsupported, match="torch_npu is not installed"):
        vllm_adapter.ascend_rollout(ModelSpec("qwen3-moe-tiny"), torch.float32, 256)
    out = subprocess.run([sys.executable, "-m", "logdiff", "list"], capture_output=True, text=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("ascend "))
    assert "no: torch_npu is not installed" in line


def test_vllm_adapter_through_a_stand_in_child(fake_child, monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_adapter, "CHILD", fake_child)
    monkeypatch.setenv("LOGDIFF_CACHE", str(tmp_path / "cache"))
    spec = ModelSpec("qwen3-dense-tiny")
    trainer_side = stacks.build("vllm", spec, torch.float32, 256)
    trainer_side.trainer_logprobs([[1, 2, 3]], [1], [0.0])
    assert trainer_side.rollout_side.child is None  # a trainer instance never starts an engine
    paired = stacks.build("vllm", spec, torch.float32, 256)
    assert paired.trainer_side.name == "reference" and stacks.build("vllm+hf", spec, torch.float32, 256).trainer_side.name == "hf"
    stack = paired.rollout_side
    out = stack.rollout([Request((3, 1), 4), Request((5,), 2, temperature=1.0, seed=9)])
    assert out[0].tokens == [3, 4, 5, 6] and out[1].tokens == [5, 6]
    assert torch.equal(out[0].logprobs, torch.tensor([-1 / 3, -1 / 4, -1 / 5, -1 / 6], dtype=torch.float32))
    init = stack.child.init_reply["init"]
    assert init["model"] == str(spec.checkpoint_dir(torch.float32)) and init["block_size"] == 128
    config = json.loads((spec.checkpoint_dir(torch.float32) / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"
    first = stack.child.init_reply["pid"]
    stack.rollout([Request((3,), 1)], EngineOptions(page_size=64))  # other options: another engine
    assert stack.child.init_reply["pid"] != first and stack.child.init_reply["init"]["block_size"] == 64
    stack.rollout([Request((3,), 1)])  # the first engine again: still running
    assert stack.child.init_reply["pid"] == first and len(stack.children) == 2
    stack.close()
    assert not any(c.alive for c in stack.children.values())


def test_vllm_weight_sync_reaches_running_and_later_engines(fake_child, monkeypatch, tmp_path):
    from safetensors.torch import load_file

    monkeypatch.setattr(vllm_adapter, "CHILD", fake_child)
    monkeypatch.setenv("LOGDIFF_CACHE", str(tmp_path / "cache"))
    spec = ModelSpec("qwen3-moe-tiny")
    pair = stacks.build("vllm", spec, torch.float32, 256)
    engine = pair.rollout_side
    engine.rollout([Request((3,), 1)])
    assert engine.child.init_reply["weights"] is None and engine.child.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    pair.sync_weights()  # the reference trainer's weights, through the engine's load_weights
    running = engine.child
    path = running.init["weights"]
    saved = load_file(path)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in saved and "lm_head.weight" in saved
    trainer = pair.trainer_parameters()
    assert torch.equal(saved["model.layers.0.mlp.experts.7.down_proj.weight"], trainer["model.layers.0.mlp.experts.down_proj"][7])
    engine.rollout([Request((3,), 1)], EngineOptions(page_size=64))  # an engine started after the sync loads it
    assert engine.child is not running and engine.child.init_reply["weights"] == path
    engine.close()


AMX_PERMISSION = """
import ctypes, runpy, sys
def granted():  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is the AMX tile data
    mask = ctypes.c_uint64()
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask))
    return bool(mask.value >> 18 & 1)
before = granted()
runpy.run_path(sys.argv[1], run_name="__mp_main__")  # what a spawned process does with the parent's main script
print(before, granted())
"""


@pytest.mark.skipif(not (sys.platform == "linux" and torch.cpu._is_amx_tile_supported()), reason="an x86 Linux CPU with AMX")
def test_vllm_child_asks_for_amx_in_every_spawned_process():
    """vLLM's worker (a spawned process) dies of SIGILL at its first bf16 forward unless it asked Linux for
    AMX first; spawn runs the child script's top level as __mp_main__ in it, and that must ask."""
    out = subprocess.run([sys.executable, "-c", AMX_PERMISSION, str(vllm_adapter.CHILD)], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_checkpoint_dir_loads_in_transformers(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("LOGDIFF_CACHE", str(tmp_path))
    path = ModelSpec("qwen3-moe-tiny", seed=3).checkpoint_dir(torch.bfloat16)
    assert path.name == "qwen3-moe-tiny-seed3-bf16"
    assert transformers.AutoConfig.from_pretrained(path).dtype == torch.bfloat16
    assert ModelSpec(str(path)).build(torch.bfloat16).state_dict()["lm_head.weight"].equal(
        ModelSpec("qwen3-moe-tiny", seed=3).build(torch.bfloat16).state_dict()["lm_head.weight"])


# --- the openai stack against a stub server ------------------------------------------------------

class Stub(http.server.BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *args):
        pass

    def _send(self, code, body):
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send(200, {"data": [{"id": "tiny"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.mode == "die":
            self.connection.close()
            return
        if self.mode == "slow":
            threading.Event().wait(3)
        if body.get("model") != "tiny":
            return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
        n = body["max_tokens"]
        logprobs = None if self.mode == "no-logprobs" else {
            "tokens": [f"token_id:{body['prompt'][0]}"] * n, "token_logprobs": [-0.5] * n}
        self._send(200, {"choices": [{"text": "", "logprobs": logprobs, "finish_reason": "length"}]})


@pytest.fixture
def stub_server(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("LOGDIFF_SERVER_URL", f"http://127.0.0.1:{server.server_address[1]}")
    yield Stub
    Stub.mode = "ok"
    server.shutdown()
    server.server_close()


def test_openai_stack_reads_tokens_and_logprobs(stub_server):
    stack = OpenAIStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 256)
    out = stack.rollout([Request((7, 1), 3), Request((9,), 2, arrival=1)])
    assert [o.tokens for o in out] == [[7, 7, 7], [9, 9]] and stack.model == "tiny"
    assert out[0].logprobs.tolist() == [-0.5] * 3
    with pytest.raises(Unsupported, match="fixed when it starts"):
        stack.rollout([Request((7,), 1)], EngineOptions(page_size=64))


@pytest.mark.parametrize("mode, model, message", [
    ("ok", "wrong", "answered /v1/completions with HTTP 404: The model `wrong` does not exist."),
    ("no-logprobs", None, "returned no log-probs"),
    ("die", None, "closed the connection during /v1/completions"),
    ("slow", None, "did not answer /v1/completions within 1 s"),
])
def test_openai_failures_are_one_line_and_exit_2(stub_server, monkeypatch, mode, model, message):
    stub_server.mode = mode
    env = {**os.environ, "LOGDIFF_REMOTE_TIMEOUT": "1", **({"LOGDIFF_SERVER_MODEL": model} if model else {})}
    out = subprocess.run([sys.executable, "-m", "logdiff", "run", "--stack", "openai", "--batch-size", "1",
                          "--prompt-lens", "3", "--max-new-tokens", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if not line.startswith("[")]  # progress lines start with [i/n]
    assert len(errors) == 1 and errors[0].startswith("logdiff: error: ") and message in errors[0], out.stderr


def test_openai_without_a_server_url_is_one_line(monkeypatch):
    monkeypatch.delenv("LOGDIFF_SERVER_URL", raising=False)
    out = subprocess.run([sys.executable, "-m", "logdiff", "run", "--stack", "openai"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "LOGDIFF_SERVER_URL"})
    assert out.returncode == 2 and "needs a server: pass --server-url URL" in out.stderr
    nothing = subprocess.run([sys.executable, "-m", "logdiff", "run", "--stack", "openai", "--server-url",
                              "http://127.0.0.1:9", "--batch-size", "1", "--max-new-tokens", "1"], capture_output=True, text=True)
    assert nothing.returncode == 2 and "cannot reach server at http://127.0.0.1:9" in nothing.stderr
