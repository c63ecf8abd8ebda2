"""Every verdict says what ran: the platform (GEMM tiers, MKL/oneDNN, ISA, threads, engine versions, switches,
fallbacks) in every result envelope and header, and each kernel set's GEMM backend, attention paths and the
alignments switched off in its stack's describe()."""

import importlib.metadata
import json

import pytest
import torch

from logdiff import report
from logdiff.cli.main import main
from logdiff.kernels import gemm
from logdiff.kernels.ablations import ABLATIONS, PARALLEL_ABLATIONS
from logdiff.workload import Workload

QUICK = ["--batch-size", "1", "--prompt-lens", "3", "--max-new-tokens", "2"]


def test_the_platform_names_the_libraries_torch_was_built_with():
    p = report.platform_info()
    built = torch.__config__.show()
    for name in ("mkl", "onednn"):
        if p["libraries"][name] is not None:
            assert p["libraries"][name] in built
    assert (p["libraries"]["mkl"] is not None) == torch.backends.mkl.is_available()
    assert (p["libraries"]["onednn"] is not None) == torch.backends.mkldnn.is_available()


def test_the_isa_flags_agree_with_the_cpu_capability_torch_uses():
    p = report.platform_info()
    if p["isa"] is None:
        pytest.skip("this OS has no /proc/cpuinfo")
    assert set(p["isa"]) <= set(report.ISA_FLAGS)
    if p["cpu_capability"] == "AVX512":
        assert "avx512f" in p["isa"]
    if p["cpu_capability"] in ("AVX2", "AVX512"):
        assert {"avx2", "fma"} <= set(p["isa"])
    if gemm.tiers()["bf16"] == "amx-bf16":
        assert "amx_bf16" in p["isa"]


def test_the_engine_versions_are_the_installed_distributions():
    versions = report.platform_info()["versions"]
    assert versions["torch"] == importlib.metadata.version("torch") and versions["torch"].startswith("2.13.0")
    import transformers

    assert versions["transformers"] == transformers.__version__
    assert set(versions) <= set(report.ENGINES)


def test_switches_set_in_the_environment_and_torch_are_named(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("LOGDIFF_GEMM_TIER", gemm.tiers()["fp32/fp16"])
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        p = report.platform_info()
    finally:
        torch.use_deterministic_algorithms(before)
    assert p["switches"]["env"]["VLLM_BATCH_INVARIANT"] == "1" and p["switches"]["deterministic_algorithms"] is True
    line = report.provenance_line(p)
    assert "VLLM_BATCH_INVARIANT=1" in line and "deterministic algorithms" in line
    assert p["fallbacks"] == [] and "fell back: nothing" in line  # a forced tier is a switch, not a fallback


def test_a_tier_the_cpu_lacks_is_a_fallback():
    assert gemm.fallbacks(["portable", "avx2"], {"fp32/fp16": "avx2", "bf16": "avx2"}) == [
        "fp32/fp16 GEMMs on avx2: this CPU has no avx512", "bf16 GEMMs on avx2: this CPU has no amx-bf16"]
    assert gemm.fallbacks(list(gemm.TIERS), {"fp32/fp16": "avx512", "bf16": "amx-bf16"}) == []
    here = gemm.tiers_here()
    assert report.platform_info()["fallbacks"] == gemm.fallbacks(here, gemm.tiers())


@pytest.mark.parametrize("name", [*ABLATIONS, *PARALLEL_ABLATIONS])
def test_each_ablation_says_which_alignment_it_switched_off(stack_cache, name):
    kernels = stack_cache(name, Workload()).describe()["kernels"]
    assert kernels["switched_off"] == [name.removeprefix("reference-no-").replace("-", "_")]
    assert kernels["alignments"][kernels["switched_off"][0]] is False


def test_the_reference_baseline_and_naive_say_what_they_run(stack_cache):
    reference, baseline, naive = (stack_cache(n, Workload()).describe()["kernels"] for n in ("reference", "baseline", "naive"))
    assert reference["switched_off"] == [] and reference["gemm"] == "logdiff GEMM (one fixed K order)"
    assert reference["attention"] == {"trainer": "train_attention", "rollout": "rollout_attention"}
    assert "align=Alignments(mask=True, order=True" in reference["ops"]["train_attention"]
    assert baseline["alignments"] is None and baseline["gemm"].startswith("torch.matmul")
    assert baseline["attention"]["trainer"] == "sdpa_train_attention"
    assert naive["gemm"] == reference["gemm"] and "block=" in naive["ops"]["train_attention"]
    assert reference["devices"] == ["cpu"] and all(not name.startswith("?") for name in reference["ops"].values())


def test_run_prints_and_writes_what_ran(tmp_path, capsys):
    path = tmp_path / "run.json"
    assert main(["run", *QUICK, "--stack", "reference-no-order", "--json", str(path)]) == 1  # it diverges
    out = capsys.readouterr().out
    assert "reference-no-order: ran GEMM logdiff GEMM, a call's lone last row reduced as two K halves" in out
    assert "alignments off: order" in out and "\nran: mkl " in out
    envelope = json.loads(path.read_text())
    assert envelope["stacks"][0]["describe"]["kernels"]["switched_off"] == ["order"]
    assert envelope["platform"]["libraries"] == report.native_libraries()
    assert envelope["platform"]["threads"] == 1


def test_the_hf_stack_names_its_attention_implementation(stack_cache):
    describe = stack_cache("hf", Workload()).describe()
    assert describe["attn_implementation"] == "sdpa"
    assert report.kernels_line("hf", describe) == "hf: ran device cpu; attn_implementation sdpa; experts_implementation default"
