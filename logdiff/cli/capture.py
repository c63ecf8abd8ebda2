"""`logdiff capture --stack NAME`: run a workload on a stack with capture on and write each side as an offline
bundle (logdiff.bisect.bundle), for `logdiff bisect --bundle A --bundle B` later, on any CPU."""

from __future__ import annotations

from logdiff import report, stacks
from logdiff.api import TrainerInputs, Unsupported
from logdiff.bisect.bundle import ROWS, WorkloadRecorder, check_target, manifest, write_bundle
from logdiff.bisect.locate import ROLLOUT, TRAINER
from logdiff.cli.options import add_device_arg, add_threads_arg, add_workload_args, stack_names, workload_from_args
from logdiff.errors import UserError
from logdiff.report import progress
from logdiff.runner import engine_options

BOTH = "both"


def add(sub) -> None:
    p = sub.add_parser("capture", help="write a stack's rollout and trainer capture points as offline bundles, for "
                                       "`logdiff bisect --bundle A --bundle B` (docs/bundle-format.md)")
    add_workload_args(p, stacks_default=("reference",))
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--side", choices=(ROLLOUT, TRAINER, BOTH), default=BOTH,
                   help="which path to capture; the trainer scores the rollout's tokens either way (default both)")
    p.add_argument("--out", metavar="DIR",
                   help="write the bundles into DIR/rollout and DIR/trainer (default ./logdiff-out/capture/<stack>)")
    p.set_defaults(func=cmd_capture)


def cmd_capture(args) -> int:
    workload = workload_from_args(args)
    names = stack_names(args)
    if len(names) != 1:
        raise UserError(f"capture runs one stack, got {len(names)} ({', '.join(names)}); pass --stack once")
    out = report.output_dir(args.out or report.default_out("capture", names[0].replace(":", "_")), "--out")
    sides = [side for side in (ROLLOUT, TRAINER) if args.side in (side, BOTH)]
    for side in sides:
        check_target(out / side)  # before any work
    progress(f"{names[0]}: building")
    stack = stacks.build(names[0], workload.spec, workload.torch_dtype, workload.max_model_len)
    if not stack.supports_capture:
        raise UserError(f"stack {names[0]!r} does not implement the capture hook (supports_capture, see logdiff.api.Stack); "
                        "add it, or write bundles from your own hooks as docs/bundle-format.md shows")
    requests = workload.requests()
    recorders = {side: WorkloadRecorder(len(requests)) for side in sides}
    try:
        progress(f"{names[0]}: rollout" + (" with capture on" if ROLLOUT in recorders else ""))
        outputs = stack.rollout(requests, engine_options(workload), capture=recorders.get(ROLLOUT))
        scored = TrainerInputs.after(requests, outputs)
        if TRAINER in recorders:
            progress(f"{names[0]}: trainer with capture on")
            stack.trainer_logprobs(scored.sequences, scored.score_from, scored.temperatures, capture=recorders[TRAINER])
    except Unsupported as e:
        raise UserError(f"stack {names[0]!r} cannot run this workload ({e}); change the workload options") from None
    provenance = report.envelope("capture", workload.to_dict(), [{"name": stack.name, "describe": stack.describe()}])
    for side, recorder in recorders.items():
        tensors = recorder.tensors()
        path = out / side
        size = write_bundle(path, manifest(side, names[0], workload.model, workload.dtype, workload.spec.config(),
                                           scored.sequences, scored.score_from, scored.temperatures, tensors, provenance),
                            tensors)
        points = sum(not name.endswith(ROWS) for name in tensors)
        print(f"wrote {path}: {side}, {points} capture points, {len(requests)} sequences, {size / 1e6:.1f} MB")
    return 0
