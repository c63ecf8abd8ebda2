"""The rollout engine: paged KV cache, scheduler with continuous batching, prefill and decode."""

from logdiff.engine.engine import RolloutEngine
from logdiff.engine.scheduler import Request, RolloutOutput

__all__ = ["RolloutEngine", "Request", "RolloutOutput"]
