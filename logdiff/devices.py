"""Where the stacks built on torch (reference, baseline, naive, hf, `logdiff train`) and the fp64 oracle compute:
`--device cpu|cuda|npu|xpu[:N]`, as torch sees them.

The choice is torch's default device while a command runs (`using`): weights are placed there as they are
built and every tensor the engine and the trainer make lands there too. A kernel set without order-fixed
kernels for that kind of device declines it (`KernelSet.devices`); the oracle computes in fp64 where the
device has fp64, else on the CPU. Ascend's torch_npu is imported only when `npu` is asked for: without
Ascend's CANN it makes `import torch` itself fail, so nothing else touches it.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from logdiff.errors import UserError

KINDS = ("cpu", "cuda", "npu", "xpu")
NO_FP64 = ("npu",)  # Ascend's cube units have no fp64: the oracle streams on the CPU there


def _backend(kind: str):
    """torch's module for an accelerator kind, or None where this torch has none."""
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return None
        import torch_npu  # noqa: F401  (registers torch.npu)
    return getattr(torch, kind, None)


def count(kind: str) -> int:
    """How many devices of `kind` torch sees here."""
    if kind == "cpu":
        return 1
    backend = _backend(kind)
    try:
        return backend.device_count() if backend is not None and backend.is_available() else 0
    except RuntimeError:  # a driver that is installed but cannot start
        return 0


def present() -> list[str]:
    """The accelerators torch sees on this machine, e.g. ["cuda:0", "cuda:1"]; [] on a CPU-only machine."""
    return [f"{kind}:{i}" for kind in KINDS[1:] for i in range(count(kind))]


def resolve(name: str) -> torch.device:
    """`--device NAME` as a torch device, or one line saying why it cannot be used here."""
    kind = name.split(":")[0]
    if kind not in KINDS:
        raise UserError(f"--device {name!r}: logdiff runs on {', '.join(KINDS)}; pass one of them, e.g. cuda:0")
    if kind == "npu" and importlib.util.find_spec("torch_npu") is None:
        raise UserError("--device npu needs Ascend's torch_npu (with CANN), which is not installed here; pass --device cpu")
    _backend(kind)  # torch_npu registers the name "npu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r} is not a device name; pass one of {', '.join(KINDS)}, e.g. cuda:0") from None
    seen = count(device.type)
    if device.index is not None and device.index >= seen or not seen:
        found = ", ".join(present()) or "none"
        raise UserError(f"--device {name}: torch {torch.__version__} sees no such device here (accelerators: {found}); "
                        "pass --device cpu or one that is present")
    return device


def has_fp64(device: torch.device) -> bool:
    return device.type not in NO_FP64


@contextlib.contextmanager
def using(device: torch.device | str):
    """Torch's default device is `device` inside the block (and what it was, after). The CPU is torch's own
    default: asking for it while it is the default changes nothing (a default-device mode costs every op)."""
    before = torch.get_default_device()
    if torch.device(device).type == before.type == "cpu":
        yield
        return
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None if before.type == "cpu" else before)


def current() -> torch.device:
    return torch.get_default_device()
