"""The foundation's promise: `reference` (and `naive`) are bitwise consistent across the workload
space; `baseline` and every ablation are not, each on the workload its docstring names."""

import pytest

from logdiff.kernels.ablations import ABLATIONS, BREAKS_IN_LOW_PRECISION_ON, BREAKS_ON

MODELS = ["qwen3-moe-tiny", "qwen3-dense-tiny"]
DTYPES = ["fp32", "bf16", "fp16"]
# prompt lengths around the 128-token KV block: 1, B-1, B, B+1, and all of them mixed in one batch
EDGE_PROMPTS = [(1,), (127,), (128,), (129,), (1, 127, 128, 129, 40, 250)]


def assert_bitwise(result):
    c = result.comparison
    assert c.verdict == "pass", f"{result.stack}: {c.bitwise_equal_tokens}/{c.tokens} equal; {c.first_divergence}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_reference_is_bitwise_across_block_edges(run, model, dtype):
    for prompts in EDGE_PROMPTS:
        # 130 new tokens: every decode crosses at least one block boundary
        r = run("reference", model=model, dtype=dtype, batch_size=len(prompts), prompt_lens=prompts,
                max_new_tokens=130 if len(prompts) == 1 else 20)
        assert_bitwise(r)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8, 15, 16, 17])
def test_reference_is_bitwise_for_batch_sizes_1_to_17(run, batch_size):
    assert_bitwise(run("reference", dtype="bf16", batch_size=batch_size, prompt_lens=(3, 60, 127, 129), max_new_tokens=12))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_bitwise_with_temperature_sampling(run, dtype):
    assert_bitwise(run("reference", dtype=dtype, temperature=0.8, max_new_tokens=24))


@pytest.mark.parametrize("block_size", [1, 16, 100, 128, 256])
def test_reference_is_bitwise_for_any_page_size(run, block_size):
    assert_bitwise(run("reference", dtype="bf16", block_size=block_size, max_new_tokens=16))


def test_reference_is_bitwise_with_continuous_batching_and_chunked_prefill(run):
    assert_bitwise(run("reference", dtype="bf16", stagger=3, prefill_chunk=50, batch_size=8, max_new_tokens=20))


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_is_bitwise(run, dtype):
    assert_bitwise(run("naive", dtype=dtype, temperature=0.7))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_baseline_fails_visibly(run, dtype):
    c = run("baseline", dtype=dtype).comparison
    assert c.verdict == "fail"
    assert c.max_abs_logdiff > 0 and c.first_divergence is not None


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_ablation_breaks_parity_on_its_named_workload(run, name):
    fields = BREAKS_ON[name]
    assert_bitwise(run("reference", **fields))
    c = run(name, **fields).comparison
    assert c.verdict == "fail", f"{name} stayed bitwise on {fields}"
    assert c.first_divergence is not None


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_ablation_breaks_parity_in_the_dtypes_rl_trains_in(run, name, dtype):
    fields = {**BREAKS_IN_LOW_PRECISION_ON[name], "dtype": dtype}
    assert_bitwise(run("reference", **fields))
    c = run(name, **fields).comparison
    assert c.verdict == "fail", f"{name} stayed bitwise in {dtype} on {fields}"


def test_precision_ablation_is_harmless_in_fp32(run):
    """The precision switch only rounds P to the model dtype: in fp32 that is the identity."""
    fields = {**BREAKS_ON["reference-no-precision"], "dtype": "fp32"}
    assert_bitwise(run("reference-no-precision", **fields))
