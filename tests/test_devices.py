"""`--device`: what torch sees decides, a device that is absent is one line, a kernel set declines a device it has no
order-fixed kernels for, and the fp64 oracle stays on the CPU where the device has no fp64."""

import importlib.util

import pytest
import torch

from logdiff import devices
from logdiff.api import Unsupported
from logdiff.cli.main import main
from logdiff.errors import UserError
from logdiff.kernels import reference_kernels
from logdiff.oracle import Oracle
from logdiff.stacks import KernelStack, StackCache
from logdiff.weights import ModelSpec

ABSENT = [kind for kind in devices.KINDS[1:] if kind != "npu" and not devices.count(kind)]


@pytest.mark.parametrize("name, message", [
    ("gpu", "--device 'gpu': logdiff runs on cpu, cuda, npu, xpu"),
    ("cuda:x", "--device 'cuda:x' is not a device name"),
    *[(kind, f"--device {kind}: torch {torch.__version__} sees no such device here") for kind in ABSENT],
])
def test_a_device_that_is_not_here_is_one_line(name, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("+", r"\+")):
        devices.resolve(name)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_without_torch_npu_says_what_is_missing():
    with pytest.raises(UserError, match="needs Ascend's torch_npu"):
        devices.resolve("npu")


@pytest.mark.skipif(not ABSENT, reason="every accelerator kind is present here")
def test_run_on_an_absent_device_exits_2_in_one_line(capsys):
    assert main(["run", "--stack", "reference", "--device", ABSENT[0]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"logdiff: error: --device {ABSENT[0]}:")


def test_the_cpu_is_torchs_own_default_and_is_restored():
    with devices.using("cpu"):
        assert devices.current() == torch.device("cpu")
    with devices.using("meta"):
        assert torch.empty(1).device.type == "meta"
    assert torch.empty(1).device.type == "cpu"


def test_a_kernel_set_declines_a_device_it_has_no_order_fixed_kernels_for():
    with devices.using("meta"), pytest.raises(Unsupported, match="order-fixed kernels for cpu only, not meta"):
        KernelStack(ModelSpec("qwen3-moe-tiny"), torch.float32, 64, reference_kernels())
    with devices.using("meta"), pytest.raises(Unsupported, match="order-fixed kernels for cpu only"):
        StackCache().get("reference-no-mask", ModelSpec("qwen3-moe-tiny"), torch.float32, 64)


def test_the_oracle_computes_on_the_cpu_where_the_device_has_no_fp64(monkeypatch):
    sequences, score_from, temps = [list(range(3, 40))], [20], [1.0]
    on_cpu = Oracle(ModelSpec("qwen3-moe-tiny"), torch.bfloat16).score(sequences, score_from, temps)
    monkeypatch.setattr(devices, "NO_FP64", ("meta",))
    with devices.using("meta"):
        oracle = Oracle(ModelSpec("qwen3-moe-tiny"), torch.bfloat16)
        scores = oracle.score(sequences, score_from, temps)
    assert oracle.device == torch.device("cpu")
    assert torch.equal(scores.logprobs[0], on_cpu.logprobs[0]) and scores.logprobs[0].device.type == "cpu"


def test_every_computing_command_takes_device():
    from logdiff.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("run", "check", "bench", "bisect", "capture", "train"):
        assert any(a.dest == "device" for a in sub[command]._actions), command
