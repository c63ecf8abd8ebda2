"""`logdiff bench --profile`: where a case's time goes, per stack. One more measure() call per stack and
case after the timed repeats (so it never counts in the figures), under torch.profiler; the ops by self
CPU time, grouped by input shape, so a padded GEMM shows apart from the one it pads."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from logdiff import report
from logdiff.api import Stack
from logdiff.bench.cases import Case, measure
from logdiff.workload import Workload

ROWS = 30


def profile_case(stack: Stack, name: str, case: Case, workload: Workload, out: Path) -> Path:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        m = measure(stack, case, workload)
    ops = prof.key_averages(group_by_input_shape=True)
    header = (f"# torch.profiler: stack {name}, {workload.model} {workload.dtype}, case {case.name} ({case.describe()}), "
              f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}\n"
              f"# one measure() call: {m.tokens_per_s:.4g} tokens/s under the profiler; self CPU time by op and input shape\n")
    path = out / f"profile-{case.name}-{name}.txt"
    report.write_text(path, header + ops.table(sort_by="self_cpu_time_total", row_limit=ROWS, max_name_column_width=40) + "\n")
    return path
