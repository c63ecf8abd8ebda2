"""logdiff: bitwise train-inference consistency conformance and Eager-mode benchmarks."""

__version__ = "0.1.0"
