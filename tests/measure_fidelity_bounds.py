"""Measures what logdiff.oracle.FIDELITY_BOUNDS are derived from: the largest |logp - logp_fp64| of the honest
stacks over C0's workloads, per dtype, rollout and trainer sides (max over tokens, and max over sequences of
the mean). Run: `python tests/measure_fidelity_bounds.py [stacks] [dtypes]`; the output committed in
results/<machine>/fidelity/bounds-measurement.txt."""

import sys
import time

from logdiff.api import TrainerInputs
from logdiff.conformance.workloads import WORKLOADS, with_dtype
from logdiff.oracle import Oracle, fidelity
from logdiff.runner import engine_options
from logdiff.stacks import StackCache

WORKLOADS_MEASURED = ["block-edges", "sampled", "long-decode", "dense", "batch-20", "block-edges-sampled"]


def main(names, dtypes):
    cache = StackCache()
    for dtype in dtypes:
        for name in WORKLOADS_MEASURED:
            w = with_dtype(WORKLOADS[name], dtype)
            oracle = Oracle(w.spec, w.torch_dtype)
            for stack_name in names:
                started = time.perf_counter()
                stack = cache.get(stack_name, w.spec, w.torch_dtype, 512)
                requests = w.requests()
                outputs = stack.rollout(requests, engine_options(w))
                scored = TrainerInputs.after(requests, outputs)
                trainer = stack.trainer_logprobs(scored.sequences, scored.score_from, scored.temperatures)
                exact = oracle.score(scored.sequences, scored.score_from, scored.temperatures)
                r = fidelity("rollout", [o.logprobs for o in outputs], exact, w.torch_dtype, [o.tokens for o in outputs],
                             [q.temperature == 0 for q in requests])
                t = fidelity("trainer", trainer, exact, w.torch_dtype)
                print(f"{stack_name:12s} {dtype} {name:20s} rollout max {r.max_abs_error:.3g} mean {r.mean_abs_error:.3g} "
                      f"greedy {r.greedy_mismatch}  trainer max {t.max_abs_error:.3g} mean {t.mean_abs_error:.3g}  "
                      f"{time.perf_counter() - started:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["reference", "baseline", "naive", "hf", "hf-eager"],
         sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp32", "bf16", "fp16"])
