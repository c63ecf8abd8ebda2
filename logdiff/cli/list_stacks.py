"""`logdiff list`: the stacks (built-in and installed plugins) and the named models."""

from __future__ import annotations

from logdiff import report, stacks
from logdiff.cli.options import add_engine_args, apply_engine_args
from logdiff.config import NAMED_CONFIGS


def add(sub) -> None:
    p = sub.add_parser("list", help="list stacks (and whether each can run here) and models")
    add_engine_args(p)
    p.set_defaults(func=cmd_list)


def _available(factory) -> str:
    reason = stacks.unavailable(factory)
    return f"no: {reason}" if reason else "yes"


def cmd_list(args) -> int:
    apply_engine_args(args)
    rows = [{"stack": name, "what it is": stacks.first_line(f.__doc__), "available": _available(f)}
            for name, f in stacks.builtin_stacks().items()]
    rows += [{"stack": name, "what it is": f"plugin {target}", "available": "yes"}
             for name, target in stacks.plugin_stacks().items()]
    print(report.table(rows))
    print("\nAny two pair up: --rollout R --trainer T (or the stack R+T) runs R's rollout engine against T's trainer.\n")
    models = [
        {"model": c.name, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
         "heads q/kv": f"{c.num_attention_heads}/{c.num_key_value_heads}", "head_dim": c.head_dim,
         "experts": f"{c.num_experts} top-{c.num_experts_per_tok}" if c.is_moe else "dense", "vocab": c.vocab_size}
        for c in NAMED_CONFIGS.values()
    ]
    print(report.table(models))
    print("\n--model also takes a transformers checkpoint directory (config.json + *.safetensors).")
    return 0
