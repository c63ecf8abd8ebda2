"""`logdiff analyze FILE`: the bitwise verdict and the framework metrics of a batch saved from verl.

A verl batch holds padded [B, T] tensors: `old_log_probs` (the trainer's recomputation),
`rollout_log_probs` (the engine's) and `response_mask` (which columns are response tokens).
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import torch

from logdiff import report
from logdiff.cli.options import add_threads_arg, exit_status
from logdiff.errors import UserError
from logdiff.metrics import Comparison, bits, compare, framework_metrics

KEYS = ("old_log_probs", "rollout_log_probs", "response_mask")
EXPORT_HINT = (
    "export the three tensors with torch.save({k: batch.batch[k] for k in "
    "('old_log_probs', 'rollout_log_probs', 'response_mask')}, 'batch.pt')"
)


def add(sub) -> None:
    p = sub.add_parser("analyze", help="bitwise verdict and verl/slime metrics of a saved verl batch (.pt or .safetensors)")
    p.add_argument("file", metavar="FILE", help="torch.save dict or safetensors file with " + ", ".join(KEYS))
    p.add_argument("--json", metavar="PATH", help="write the JSON result envelope here")
    add_threads_arg(p)
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(args) -> int:
    path = Path(args.file)
    if args.json:
        report.check_writable(args.json)
    old, rollout, mask = batch_tensors(load_batch(path), path)
    c = analyze(old, rollout, mask)
    print(f"logdiff analyze {path}: {mask.shape[0]} sequences x {mask.shape[1]} response columns; "
          f"trainer = old_log_probs ({_dtype(old)}), rollout = rollout_log_probs ({_dtype(rollout)}), "
          f"{report.threads()}")
    print(report.table([report.comparison_row("batch", path.name, c)]))
    if c.first_divergence:
        print(report.divergence_line(path.name, c))
    notes = oracle_free_notes(old, rollout, mask, c)
    for line in notes:
        print(line)
    print()
    print(report.table([{"metric": k, "value": f"{v:.6g}"} for k, v in c.metrics.items()]))
    if args.json:
        batch = {"file": str(path), "sequences": mask.shape[0], "response_columns": mask.shape[1],
                 "old_log_probs_dtype": _dtype(old), "rollout_log_probs_dtype": _dtype(rollout)}
        report.write_json(args.json, report.envelope("analyze", batch, [{"name": path.name, **c.to_dict(), "notes": notes}]))
        print(f"wrote {args.json}")
    return exit_status([c.verdict])


def analyze(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> Comparison:
    """Compares the masked tokens bitwise; the divergence position is the column in the padded batch."""
    # Widening bf16/fp16 to the other side's dtype is exact, so equal values keep equal bits.
    dtype = torch.promote_types(old.dtype, rollout.dtype)
    columns = [row.nonzero().flatten() for row in mask.bool()]
    c = compare(
        [rollout[i, cols].to(dtype) for i, cols in enumerate(columns)],
        [old[i, cols].to(dtype) for i, cols in enumerate(columns)],
        # On the batch as saved, in its own dtypes and padding: the figures verl logs for it.
        metrics=framework_metrics(old_log_prob=old, rollout_log_prob=rollout, response_mask=mask),
    )
    d = c.first_divergence
    if d is None:
        return c
    return dataclasses.replace(c, first_divergence=dataclasses.replace(d, pos=int(columns[d.seq][d.pos])))


NOT_FIDELITY = ("note: a pass here proves the two recorded tensors agree (consistency), not that either computes the "
                "model (fidelity): without the weights there is no oracle; run `logdiff check --stack YOUR_STACK` for C0")


def oracle_free_notes(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, c: Comparison) -> list[str]:
    """What can be said without the model: signs that one tensor was copied into the other, and what a pass means."""
    notes = []
    shared = old.untyped_storage().data_ptr() == rollout.untyped_storage().data_ptr()
    if shared and old.storage_offset() == rollout.storage_offset():
        notes.append("warning: old_log_probs and rollout_log_probs are the same tensor (one storage): the trainer's "
                     "recompute was never compared, the batch holds one copy twice (old_log_probs = rollout_log_probs?)")
    elif old.dtype == rollout.dtype and torch.equal(bits(old), bits(rollout)):
        padding = ~mask.bool()
        if padding.any() and bool((old[padding] != 0).any()):
            notes.append("warning: old_log_probs and rollout_log_probs are bitwise identical even in the masked padding, "
                         "which a separate recompute does not write: one was most likely copied into the other")
    if c.verdict == "pass":
        notes.append(NOT_FIDELITY)
    return notes


def load_batch(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path} is not a file; pass a saved verl batch (.pt or .safetensors)")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except SafetensorError as e:
            raise UserError(f"cannot read {path} as safetensors ({e}); write it with safetensors.torch.save_file") from None
    with path.open("rb") as f:
        head = f.read(256)
    if b"verl.protocol" in head:
        # DataProto.save_to_disk pickles the whole object: reading it back runs arbitrary code and needs verl.
        raise UserError(f"{path} is a pickled verl DataProto (save_to_disk), which logdiff does not unpickle; {EXPORT_HINT}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise UserError(f"cannot read {path}: {_load_failure(e)}; {EXPORT_HINT}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a {type(data).__name__}, not a dict of tensors; {EXPORT_HINT}")
    return data


def batch_tensors(data: dict, path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    missing = [k for k in KEYS if not isinstance(data.get(k), torch.Tensor)]
    if missing:
        raise UserError(f"{path} has no tensor {', '.join(missing)} (it has: {', '.join(map(str, data)) or 'nothing'}); "
                        f"{EXPORT_HINT}")
    old, rollout, mask = (data[k] for k in KEYS)
    for name, t in (("old_log_probs", old), ("rollout_log_probs", rollout)):
        if not t.is_floating_point():
            raise UserError(f"{name} in {path} is {_dtype(t)}, not floating point; save the log-prob tensor itself")
    if mask.ndim != 2 or old.shape != mask.shape or rollout.shape != mask.shape:
        raise UserError(f"{path}: old_log_probs {list(old.shape)}, rollout_log_probs {list(rollout.shape)} and "
                        f"response_mask {list(mask.shape)} must be one padded [batch, response_length] shape")
    if not ((mask == 0) | (mask == 1)).all():
        raise UserError(f"response_mask in {path} holds values other than 0 and 1; save verl's response_mask")
    if not mask.any():
        raise UserError(f"response_mask in {path} selects no token; there is nothing to compare")
    return old, rollout, mask


def _load_failure(e: Exception) -> str:
    # torch's weights-only error is a page of advice; the class it refused is the useful part.
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
    if refused:
        return f"it holds {refused.group(1)}, which a weights-only load refuses"
    return "not a torch.save file of plain tensors"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
