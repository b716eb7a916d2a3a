"""bfloat16 on a CPU without bfloat16 instructions: wide sequences' rows computed in float32, chosen per sequence,
close to the bfloat16 kernel's result, and each sequence's rows whatever shares the call."""
import pytest
import torch
import torch.nn.functional as F
from tiny import save_agreeing_pair

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, TreeConfig
from offspec.engine.generate import GenerationRequest
from offspec.engine.load import load_engine
from offspec.formats import cpu_bf16
from offspec.formats.weights import FUSED_MAX_ROWS, Int8Weight, RowKernels, linear

CPU = torch.device("cpu")


@pytest.fixture
def float32_wide(monkeypatch):
    """This process as on a CPU without bfloat16 instructions, whatever this one has."""
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda: False)


def test_the_cpus_flags_decide_and_the_variable_overrides(tmp_path, monkeypatch, caplog):
    info = tmp_path / "cpuinfo"
    for flags, native in (("fpu avx2 fma", False), ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16", True)):
        info.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
        assert (cpu_bf16.cpu_flags(cpu_bf16.cpu_info(str(info))) & set(cpu_bf16.NATIVE_FLAGS) != set()) == native
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")              # an Arm core
    assert "bf16" in cpu_bf16.cpu_flags(cpu_bf16.cpu_info(str(info)))
    assert cpu_bf16.cpu_info(str(tmp_path / "none")) == {}
    for forced, native in (("native", True), ("float32", False)):
        monkeypatch.setenv("OFFSPEC_CPU_BF16", forced)
        cpu_bf16.native_bf16.cache_clear()
        assert cpu_bf16.native_bf16() is native
        assert cpu_bf16.wide_in_float32(CPU, torch.bfloat16) is not native
    monkeypatch.setenv("OFFSPEC_CPU_BF16", "fp32")                        # a value it does not know: one warning
    cpu_bf16.native_bf16.cache_clear()
    with caplog.at_level("WARNING", logger="offspec"):
        assert cpu_bf16.native_bf16() == bool(cpu_bf16.cpu_flags(cpu_bf16.cpu_info()) & set(cpu_bf16.NATIVE_FLAGS))
    assert [r.getMessage() for r in caplog.records] == [
        "OFFSPEC_CPU_BF16='fp32' is neither 'native' nor 'float32': ignored, the CPU's flags decide"]
    cpu_bf16.native_bf16.cache_clear()


def test_only_bfloat16_on_a_cpu_without_it_computes_wide_rows_in_float32(float32_wide):
    wide = cpu_bf16.WIDE_MIN_ROWS
    assert cpu_bf16.wide_rows([1, wide, 1], CPU, torch.bfloat16).tolist() == [False] + [True] * wide + [False]
    assert cpu_bf16.wide_rows([1, wide - 1], CPU, torch.bfloat16) is None          # a few rows: bf16's kernel
    assert cpu_bf16.wide_rows([5], CPU, torch.float32) is None
    assert cpu_bf16.wide_rows([5], CPU, torch.float16) is None
    assert cpu_bf16.wide_rows([5], torch.device("cuda"), torch.bfloat16) is None


@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_is_the_float32_product_rounded_once(bias, monkeypatch):
    """A block of W's rows upcast at a time (here 3 of 40, so the blocks do not divide it) gives the float32
    product of the whole matrix, rounded once to bfloat16."""
    torch.manual_seed(0)
    w, x = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(7, 64, dtype=torch.bfloat16)
    b = torch.randn(40, dtype=torch.bfloat16) if bias else None
    monkeypatch.setattr(cpu_bf16, "UPCAST_BYTES", 3 * 64 * 4)
    got = cpu_bf16.float32_linear(x, w, b)
    want = (x.double() @ w.double().T + (b.double() if bias else 0)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7     # a bf16 step at most
    assert torch.equal(got, F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16))


def test_each_sequence_reads_its_own_kernel_whatever_shares_the_call(float32_wide):
    """A packed bfloat16 call of sequences of every width: rows of sequences under WIDE_MIN_ROWS read the bfloat16
    kernel, the wider ones float32 (for an Int8Weight: its int8 copy up to FUSED_MAX_ROWS); every sequence's rows
    are bit for bit what it gets in a call of its own."""
    torch.manual_seed(0)
    w, bias = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    widths = [1, cpu_bf16.WIDE_MIN_ROWS, FUSED_MAX_ROWS + 2, cpu_bf16.WIDE_MIN_ROWS - 1, 1]
    x = torch.randn(sum(widths), 64, dtype=torch.bfloat16)
    kernels = RowKernels.of(widths, CPU, torch.bfloat16)
    for weight in (w, Int8Weight.quantize(w)):
        got = linear(x, weight, bias, kernels)
        at = 0
        for width in widths:
            alone = linear(x[at:at + width], weight, bias, RowKernels.of([width], CPU, torch.bfloat16))
            assert torch.equal(alone, got[at:at + width]), (type(weight), width)
            at += width
    wide = kernels.wide
    got = linear(x, w, bias, kernels)
    assert torch.equal(got[wide], cpu_bf16.float32_linear(x[wide], w, bias))
    assert torch.equal(got[~wide], F.linear(x[~wide], w, bias))
    assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))                # no kernels given: bf16's


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("bf16pair"), n_layers=3, seed=5, tie=True)[:2]


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("draft_quant", ["none", "int8"])
def test_a_bf16_batch_on_such_a_cpu_keeps_each_prompts_tokens(pair, draft_quant, float32_wide):
    """Greedy bfloat16, wide rows in float32: each prompt's tokens in a batch (passes of every width, prompts
    joining beside trees) are its tokens alone, with the draft dense or beside its int8 copy."""
    runtime = RuntimeConfig(dtype=torch.bfloat16, draft_quant=draft_quant)
    engine = load_engine(*pair, OffloadConfig(mode="none"), runtime, progress=False,
                         limits=RunLimits(concurrency=3)).engine
    g = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(5, 120, (n,), generator=g).tolist()) for n in (5, 1, 9, 17, 2)]
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(policy="dyspec", budget=8),
                                  ignore_eos=True) for p, n in zip(prompts, (9, 14, 6, 11, 8))]
    try:
        alone = [tokens_of(engine.generate(r)) for r in requests]
        batch = {i: [] for i in range(len(requests))}
        for event in engine.run_batch(requests, concurrency=3):
            assert event.error is None, event.error
            batch[event.request] += event.step.tokens
    finally:
        engine.close()
    assert [batch[i] for i in range(len(requests))] == alone


def test_the_heap_is_kept_once_the_float32_path_runs(float32_wide):
    """glibc would hand each freed 4 MB block back to the system; the first wide call raises its thresholds."""
    import platform
    cpu_bf16.keep_heap.cache_clear()
    assert cpu_bf16.wide_rows([1], CPU, torch.bfloat16) is None and cpu_bf16.keep_heap.cache_info().currsize == 0
    cpu_bf16.wide_rows([cpu_bf16.WIDE_MIN_ROWS], CPU, torch.bfloat16)
    assert cpu_bf16.keep_heap.cache_info().currsize == 1
    assert cpu_bf16.keep_heap() is (platform.libc_ver()[0] == "glibc")
