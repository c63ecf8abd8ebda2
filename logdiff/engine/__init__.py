"""The rollout engine: paged KV cache, scheduler with continuous batching, prefill and decode."""

from logdiff.engine.engine import RolloutEngine

__all__ = ["RolloutEngine"]
