"""Tests against the real vLLM engine and server run only where vllm is installed: in this interpreter
(`nox -s vllm`) or, with LOGDIFF_VLLM_TESTS=1, in the one LOGDIFF_VLLM_PYTHON names. The default run
leaves this folder's tests out rather than skipping them."""

from __future__ import annotations

import importlib.util
import os

wanted = importlib.util.find_spec("vllm") is not None or os.environ.get("LOGDIFF_VLLM_TESTS") == "1"
collect_ignore = [] if wanted else ["test_vllm_engine.py"]
