"""The fused dequantization kernels (formats/kernels.py) equal the torch transcriptions bit for bit, for every
format the target streams and every shape edge: one group, odd group counts, act-order permutations, 4 and 8 bits,
v1 and v2 zeros, per-channel scales, every GGUF type, a layer whose types differ between layers, rows and columns
that do not fill a tile, and float32, float16 and bfloat16 outputs.

On a CPU they run under Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU); on a
CUDA machine the same tests run on the GPU, where the kernels are what offspec uses."""
import logging
import sys

import numpy as np
import pytest
import torch
from tiny import _gguf_blocks

from offspec.config import ModelConfig
from offspec.formats import gguf_blocks, kernels, published, quant
from offspec.formats.quant import QuantizedLayout

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GGUF_TYPES = list(kernels.GGUF_TYPES)


@pytest.fixture(autouse=True)
def interpreter_tiles(monkeypatch):
    """Under the interpreter a program costs milliseconds whatever its size: taller tiles (still part-filled by
    every shape here) keep the tests quick. On a GPU the tests run offspec's own tiles."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(kernels, "TILES", {**kernels.TILES, "ct4": (32, 1024, 4), "ct8": (32, 1024, 4), "int8": (32, 1024, 4),
                                               "gguf": (32, 1024, 4)})


def torch_path(quant_name: str, pieces: dict, shape: tuple, dtype: torch.dtype, field=None, layer=None):
    """The reference: the torch transcription, on the CPU."""
    out = torch.empty(shape, dtype=dtype)
    cpu = {k: v.cpu() for k, v in pieces.items()}
    if quant_name == "int8":
        out.copy_(cpu["int8"])
        out.mul_(cpu["scale"][:, None])
    else:
        published.dequantize(quant_name, cpu, out, field, layer)
    return out


def kernel(quant_name: str, pieces: dict, shape: tuple, dtype: torch.dtype, field=None, layer=None):
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    kernels.launch(quant_name, {k: v.to(DEVICE) for k, v in pieces.items()}, out, field, layer)
    return out.cpu()


def assert_kernel_is_torch_path(quant_name: str, pieces: dict, shape: tuple, field=None, layer=None):
    for dtype in DTYPES:
        want = torch_path(quant_name, pieces, shape, dtype, field, layer)
        got = kernel(quant_name, pieces, shape, dtype, field, layer)
        assert torch.equal(got, want), (quant_name, shape, dtype, (got.float() - want.float()).abs().max())


def weights(N: int, K: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


# (N out, K in): one group, an odd count of groups, rows and columns that leave a tile part-filled
AWQ_CASES = [("awq-g32", (40, 32)), ("awq-g32", (72, 96)), ("awq-g128", (24, 384)), ("awq-g64", (136, 192))]


@pytest.mark.parametrize("quant_name,shape", AWQ_CASES)
def test_awq(quant_name, shape):
    assert_kernel_is_torch_path(quant_name, published.quantize(quant_name, weights(*shape)), shape)


GPTQ_CASES = [("gptq-b4-g32", (40, 96), False), ("gptq-b4-g32-v2", (40, 96), True), ("gptq-b8-g16", (36, 48), True),
              ("gptq-b8-g16-v2", (20, 80), False), ("gptq-b4-g0", (16, 72), False), ("gptq-b4-g24-v2", (24, 72), True),
              ("gptq-b4-g128", (72, 128), True)]


@pytest.mark.parametrize("quant_name,shape,act_order", GPTQ_CASES)
def test_gptq(quant_name, shape, act_order):
    """Symmetric v1 zeros and asymmetric v2 ones, 4 and 8 bits, one group (g0), a group size that does not divide
    into K's packing (24), and act-order: input rows quantized in a random order, so g_idx is a permutation."""
    order = torch.randperm(shape[1], generator=torch.Generator().manual_seed(1)) if act_order else None
    pieces = published.quantize(quant_name, weights(*shape), order)
    assert_kernel_is_torch_path(quant_name, pieces, shape)


CT_CASES = [("ct-b4-g32-bf16", (40, 64)), ("ct-b4-g32-asym-f16", (40, 96)), ("ct-b8-g0-bf16", (24, 48)),
            ("ct-b8-g16-asym-f32", (48, 48)), ("ct-b4-g0-asym-bf16", (16, 64)), ("ct-b4-g128-f32", (8, 384))]


@pytest.mark.parametrize("quant_name,shape", CT_CASES)
def test_compressed_tensors(quant_name, shape):
    """int4 and int8, symmetric or not, grouped or one scale per output row, scales in bf16, f16 or f32."""
    assert_kernel_is_torch_path(quant_name, published.quantize(quant_name, weights(*shape)), shape)


@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_int8_target(scale_dtype):
    q, scale = quant.int8_rows(weights(40, 72))
    pieces = {"int8": q, "scale": scale.to(scale_dtype)}
    for dtype in DTYPES:
        if dtype != scale_dtype:          # the scale is stored in the compute dtype
            continue
        assert torch.equal(kernel("int8", pieces, (40, 72), dtype), torch_path("int8", pieces, (40, 72), dtype))


def gguf_raw(type_name: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    blocks = _gguf_blocks(weights(N, K, seed) * 20, type_name, torch.Generator().manual_seed(seed))
    return torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(-1).copy())


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_types(type_name):
    """Each type over one block a row and over several, with rows that leave a tile part-filled."""
    block = gguf_blocks.BY_NAME[type_name].block
    for N, K in ((3, max(block, 32)), (19, 2 * 256 + (256 if block == 256 else 32))):
        quant_name = "gguf:" + ",".join([type_name.lower()] * 7)
        assert_kernel_is_torch_path(quant_name, {"blocks": gguf_raw(type_name, N, K)}, (N, K), "q_proj", 0)


def test_a_gguf_layer_whose_types_differ_between_layers():
    """A whole layer block (QuantizedLayout) whose v and down matrices change type from layer to layer, as a Q4_K_M
    file's do: each layer's block dequantizes by kernel to exactly the torch path's dense layer."""
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=256, intermediate_size=512, n_layers=3, n_heads=4,
                      n_kv_heads=2, head_dim=64, rms_norm_eps=1e-5)
    quant_name = "gguf:q4_k,q5_k,q6_k/q8_0/q4_0,q4_1,q5_0,q5_1,q6_k/q4_k/bf16"
    layout = QuantizedLayout.of(cfg, torch.float32, quant_name)
    block = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pieces = layout.pieces(block)
    for layer in range(cfg.n_layers):
        for name, shape, _ in layout.dense.entries:
            if len(shape) == 2:
                type_name = gguf_blocks.type_of(quant_name, name, layer)
                raw = gguf_raw(type_name, *shape, seed=layer)
                pieces[f"{name}.blocks"][: raw.numel()].copy_(raw)
            else:
                pieces[name].copy_(torch.rand(shape))
        want = torch.empty(layout.dense.nbytes, dtype=torch.uint8)
        layout.dequantize(block, want, layer)                          # the CPU: the torch path
        got = torch.empty(layout.dense.nbytes, dtype=torch.uint8, device=DEVICE)
        dense = layout.dense.views(got)
        on_device = {k: v.to(DEVICE) for k, v in pieces.items()}
        for name, shape, _ in layout.dense.entries:
            if len(shape) == 2:
                kernels.launch(quant_name, {"blocks": on_device[f"{name}.blocks"]}, getattr(dense, name), name, layer)
            else:
                getattr(dense, name).copy_(on_device[name])
        assert torch.equal(got.cpu(), want), layer


# ---------------------------------------------------------------- when the kernels are used, and when not

def test_the_cpu_keeps_the_torch_path(monkeypatch):
    """On a CPU dequantize() declines (the torch transcriptions run), and OFFSPEC_DEQUANT=torch declines anywhere."""
    pieces = published.quantize("awq-g32", weights(8, 32))
    assert not kernels.dequantize("awq-g32", pieces, torch.empty(8, 32))
    assert not kernels.handles("nf4") and kernels.handles("int8") and kernels.handles("gguf:q4_k")
    monkeypatch.setenv("OFFSPEC_DEQUANT", "torch")
    assert not kernels.dequantize("awq-g32", pieces, torch.empty(8, 32, device=DEVICE))


def test_a_kernel_that_cannot_run_falls_back_with_one_line(monkeypatch, caplog):
    """No Triton, or a launch that fails (an old GPU): one warning, then False every time (the torch path runs),
    never a traceback."""
    pieces = published.quantize("awq-g32", weights(8, 32))
    monkeypatch.setattr(kernels, "_broken", [])
    monkeypatch.setattr(kernels, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("no sm_60 support\nmore")))
    with caplog.at_level(logging.WARNING, logger="offspec"):
        assert not kernels.launched("awq-g32", pieces, torch.empty(8, 32))
        assert not kernels.launched("awq-g32", pieces, torch.empty(8, 32))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no sm_60 support" in lines[0] and "torch path" in lines[0] and "more" not in lines[0]

    monkeypatch.setattr(kernels, "_broken", [])
    kernels._jit.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)                  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "offspec.formats.kernels_jit", raising=False)
    try:
        with caplog.at_level(logging.WARNING, logger="offspec"):
            caplog.clear()
            assert not kernels.launched("awq-g32", pieces, torch.empty(8, 32))
        assert len(caplog.records) == 1 and "Triton is not available" in caplog.records[0].getMessage()
    finally:
        monkeypatch.undo()
        kernels._jit.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_issue_no_sync():
    """As the ring's copy queue runs them: on a side stream, no hidden host synchronization (after the first
    launch of each, which compiles it)."""
    from drivers import on_a_side_stream_without_syncs
    cases = [("awq-g32", published.quantize("awq-g32", weights(64, 64))),
             ("gguf:" + ",".join(["q4_k"] * 7), {"blocks": gguf_raw("Q4_K", 8, 256)})]
    outs = [torch.empty((64, 64) if q.startswith("awq") else (8, 256), dtype=torch.bfloat16, device="cuda")
            for q, _ in cases]
    on_device = [{k: v.cuda() for k, v in p.items()} for _, p in cases]
    for (q, _), p, out in zip(cases, on_device, outs):
        kernels.launch(q, p, out, "q_proj", 0)
    torch.cuda.synchronize()
    on_a_side_stream_without_syncs(lambda: [kernels.launch(q, p, out, "q_proj", 0)
                                            for (q, _), p, out in zip(cases, on_device, outs)])
