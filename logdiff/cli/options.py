"""Command-line options shared by the `logdiff` commands that run a workload."""

from __future__ import annotations

import argparse
import os

from logdiff import stacks
from logdiff.api import LOGPROB_MODES, Processing
from logdiff.errors import UserError
from logdiff.stacks import RUN_STACKS
from logdiff.workload import DEFAULT_PROMPT_LENS, Workload


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(f"{message}; see `{self.prog} --help`")


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 16,130") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list; pass e.g. 16,130")
    return values


THREADS_HELP = ("torch CPU threads (default: $OMP_NUM_THREADS if set, else 1: chosen for a shared machine, where torch's "
                "one-per-core default ran `check --stack baseline` 30x slower under load; on an idle machine give its cores)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", metavar="NAME",
                   help="where the stacks built on torch and the fp64 oracle compute: cpu, cuda, npu or xpu, with an "
                        "index if several (as torch sees them; default cpu). A kernel set without order-fixed kernels "
                        "for that device declines it")


def threads_from_args(args) -> int:
    """--threads, else $OMP_NUM_THREADS (its first level, as in "4,2"), else 1."""
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads {args.threads} is not positive; pass 1 or more")
        return args.threads
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not env:
        return 1
    try:
        threads = int(env.split(",")[0])
    except ValueError:
        threads = 0
    if threads < 1:
        raise UserError(f"OMP_NUM_THREADS={env!r} is not a positive integer; unset it or pass --threads N")
    return threads


EXIT_CODES = """\
exit status, the same for every command (a CI can gate on it):
  0  every stack passed (list, bench, capture: the command completed)
  1  a stack failed a property: bits differ, or C0 (fidelity) fails, or an engine erred in a test;
     train: a stack is not exactly on-policy; bisect: the paths or bundles diverge (or do not reproduce)
  2  bad input, or nothing could run: a missing engine, a stack that declined the workload or every
     property (Unsupported), an unsupported parallel degree, a bad or incomplete bundle; one line on
     stderr, no traceback"""


def exit_status(verdicts) -> int:
    """The exit status from each stack's verdict: 1 if one failed, else 2 if one could not run at all ("skipped")
    or there was none, else 0 ("pass", or check's "partial": it ran, some properties declined or xfailed)."""
    found = set(verdicts)
    return 1 if "fail" in found else 2 if "skipped" in found or not found else 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Where the out-of-process stacks find their engine (they read the environment variables named)."""
    p.add_argument("--server-url", metavar="URL",
                   help="rollout openai: the OpenAI-compatible server to score (env LOGDIFF_SERVER_URL)")
    p.add_argument("--vllm-python", metavar="PATH",
                   help="rollouts vllm*: the python of the environment that has vLLM (env LOGDIFF_VLLM_PYTHON; "
                        "default this interpreter)")


def apply_engine_args(args) -> None:
    if getattr(args, "server_url", None):
        os.environ["LOGDIFF_SERVER_URL"] = args.server_url
    if getattr(args, "vllm_python", None):
        os.environ["LOGDIFF_VLLM_PYTHON"] = args.vllm_python


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """`--rollout R --trainer T`: one stack's rollout engine against another's trainer (the stack `R+T`)."""
    p.add_argument("--rollout", metavar="NAME",
                   help="pair this stack's rollout engine (e.g. vllm, hf, openai, reference) with --trainer's trainer "
                        "on the same weights (default reference when only --trainer is given)")
    p.add_argument("--trainer", metavar="NAME",
                   help="pair this stack's trainer (e.g. verl, hf, baseline, reference) with --rollout's engine "
                        "(default reference when only --rollout is given)")


def apply_pair_args(args) -> None:
    """Adds `--rollout R --trainer T` to the stacks a command runs, as the stack `R+T`."""
    if not (args.rollout or args.trainer):
        if hasattr(args, "stack") and not args.stack:
            raise UserError("no stack to check: pass --stack NAME, or --rollout R --trainer T")
        return
    name = stacks.pair_name(args.rollout or "reference", args.trainer or "reference")
    if hasattr(args, "stacks"):
        args.stacks = (args.stacks or []) + [name]
    elif args.stack:
        raise UserError(f"pass either --stack {args.stack} or --rollout/--trainer ({name}), not both")
    else:
        args.stack = name


def add_workload_args(p: argparse.ArgumentParser, stacks_default=RUN_STACKS) -> None:
    d = Workload()
    p.add_argument("--stack", action="append", dest="stacks", metavar="NAME",
                   help=f"stack to test, repeatable: built-in, module:attr, entry point, a pair ROLLOUT+TRAINER, or all "
                        f"(every built-in) (default: {', '.join(stacks_default)})")
    add_pair_args(p)
    p.add_argument("--model", default=d.model, help=f"named config or checkpoint directory (default {d.model})")
    add_layers_arg(p)
    p.add_argument("--dtype", default=d.dtype, help="fp32, bf16 or fp16 (default fp32)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"requests (default {d.batch_size})")
    p.add_argument("--prompt-lens", type=int_list, default=DEFAULT_PROMPT_LENS,
                   help=f"prompt length per request, cycled to the batch size (default {','.join(map(str, d.prompt_lens))})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"tokens per response (default {d.max_new_tokens})")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature, 0 = greedy (default 0)")
    add_processing_args(p)
    p.add_argument("--seed", type=int, default=d.seed, help="seed of weights, prompts and sampling (default 0)")
    p.add_argument("--block-size", type=int, default=d.block_size, help=f"KV cache page size (default {d.block_size})")
    p.add_argument("--stagger", type=int, default=d.stagger,
                   help=f"request i joins the running batch at engine step i*K (default {d.stagger}; 0 = all at once)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill forward (default: whole prompt)")
    add_engine_args(p)
    p.set_defaults(stacks_default=stacks_default)


LOGPROBS_MODE_HELP = (
    "what a recorded log-prob means: processed (default) = under the distribution the token was sampled from, "
    "after temperature and top-k/top-p/min-p, renormalised: the behaviour policy's probability in the RL "
    "importance ratio; raw = log_softmax of the model's logits at temperature 1 (docs/logprob-semantics.md)")


def add_processing_args(p: argparse.ArgumentParser) -> None:
    """Truncation of the sampled distribution and the log-prob mode; truncation applies to sampled tokens only."""
    d = Processing()
    p.add_argument("--top-k", type=int, default=d.top_k, help="sample from the k likeliest tokens (default 0: off)")
    p.add_argument("--top-p", type=float, default=d.top_p,
                   help="sample from the likeliest tokens whose mass reaches P (default 1: off)")
    p.add_argument("--min-p", type=float, default=d.min_p,
                   help="sample from tokens at least P times as likely as the likeliest (default 0: off)")
    p.add_argument("--logprobs-mode", choices=LOGPROB_MODES, default=d.logprobs_mode, help=LOGPROBS_MODE_HELP)


def processing_from_args(args) -> Processing:
    return Processing(args.top_k, args.top_p, args.min_p, args.logprobs_mode)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of trainer and rollout (default 1)")
    p.add_argument("--trainer-tp", type=int, default=None, help="tensor-parallel degree of the trainer (default --tp)")
    p.add_argument("--rollout-tp", type=int, default=None, help="tensor-parallel degree of the rollout engine (default --tp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default 1)")


def parallel_layout(args) -> dict:
    """The degrees asked for: {} for one process."""
    layout = dict(trainer_tp=args.trainer_tp or args.tp, rollout_tp=args.rollout_tp or args.tp, ep=args.ep)
    if min(layout.values()) < 1:
        raise UserError(f"parallel degrees {layout} must be >= 1")
    return {} if set(layout.values()) == {1} else layout


def add_layers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep the first N decoder layers of the model (embeddings, final norm, lm_head kept): a "
                        "quick gate on a real checkpoint (default: all)")


def workload_from_args(args) -> Workload:
    w = Workload(
        model=args.model, layers=args.layers, dtype=args.dtype, batch_size=args.batch_size, prompt_lens=args.prompt_lens,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        block_size=args.block_size, stagger=args.stagger, prefill_chunk=args.prefill_chunk,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, logprobs_mode=args.logprobs_mode,
    )
    w.validate()
    return w


def stack_names(args) -> list[str]:
    apply_engine_args(args)
    names = args.stacks or list(args.stacks_default)
    if "all" in names:  # every built-in stack in this process, in registry order
        at = names.index("all")
        names = names[:at] + [n for n in stacks.builtin_stacks()
                              if n not in names and n not in stacks.EXTERNAL_STACKS] + names[at + 1:]
    for name in names:
        stacks.require(name)
    return names
