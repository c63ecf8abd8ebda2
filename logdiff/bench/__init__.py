"""Eager-mode throughput: the model cases (`cases`), kernel cases at qwen3-30b-a3b shapes (`kernel_cases`),
the interleaved runner (`run`), ratios with spread (`stats`), published peer figures (`peers`) and the
result files (`output`). `logdiff bench`, perf/ (pytest-benchmark) and perf/asv all time these cases."""
