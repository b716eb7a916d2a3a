"""int4.Int4Weight (--draft-quant int4): PyTorch's int4 matmul over the packed matrix equals the matmul over the
reference dequantization (the module's formula, from the stored scales and zeros), for every shape edge the
packing has; the plan's bytes are the built weight's; shapes and devices it cannot run are refused in one line.
On CUDA (where present) the same checks run through the CUDA kernel."""
import pytest
import torch

from offspec.errors import InputError
from offspec.formats import int4

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(48, 128), (40, 96), (7, 64), (256, 320)])   # N padded
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("source", [None, 64])                                    # G 32 | 64 where it divides K
def test_kernel_equals_the_reference_dequantization(device, shape, rows, source):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(shape[0] * 1000 + rows)
    w = torch.randn(*shape, generator=gen).to(device, dtype)
    x = torch.randn(2, rows, shape[1], generator=gen).to(device, dtype)
    bias = torch.randn(shape[0], generator=gen).to(device, dtype)
    got = int4.Int4Weight.quantize(w, source).matmul(x, bias)                            # (2, rows, N)
    want = x.float() @ int4.reference(w, source).t() + bias.float()
    assert got.shape == (2, rows, shape[0]) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_packed_end_to_end_are_the_matrix_packed_whole(device):
    """Int4Weight.quantize packs ROWS_AT_ONCE rows at a time (padding N to 16 in its last chunk), on the device
    it is asked for: the same bytes as the padded matrix packed at once, from a matrix on the device or in host
    memory (a twin's lm_head where the target's stays on the host)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    N, K = 2 * int4.ROWS_AT_ONCE + 24, 128                                            # 3 chunks, N' = N + 8
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)).to(dtype)       # (N, K) on the host
    q, sz = int4.quantize_groups(torch.cat([w, w.new_zeros(8, K)]), int4.GROUP)
    whole = int4._pack(q.to(device))
    for held in (int4.Int4Weight.quantize(w.to(device)), int4.Int4Weight.quantize(w, device=torch.device(device))):
        assert torch.equal(held.packed, whole) and torch.equal(held.scales_zeros, sz.to(device))


def test_round_trip_error_is_within_half_a_step():
    w = torch.randn(32, 256)
    q, sz = int4.quantize_groups(w, 64)
    assert q.min() >= 0 and q.max() <= 15
    step = sz[..., 0].t().repeat_interleave(64, dim=1)                                    # (N, K)
    assert ((int4.dequantize_groups(q, sz, 64) - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("shape", [(48, 128), (7, 64), (151, 96)])
def test_planned_bytes_are_the_built_weights(shape):
    for dtype in (torch.float32, torch.bfloat16):
        assert int4.Int4Weight.quantize(torch.randn(*shape).to(dtype)).nbytes == int4.nbytes(shape, dtype)


def test_shapes_and_devices_it_cannot_run_are_refused_in_one_line():
    with pytest.raises(InputError, match="multiple of 32; this model has 80"):
        int4.check_shapes([(64, 64), (64, 80)], "--draft-quant int4")
    with pytest.raises(InputError, match="bfloat16 only"):
        int4.check_device(torch.device("cuda"), torch.float16, "--draft-quant int4")
    int4.check_device(torch.device("cpu"), torch.bfloat16, "--draft-quant int4")   # runs here


def test_a_4bit_sources_own_groups_land_on_its_levels():
    """A matrix on 16 levels a group of 32 (as a Q4_1 or AWQ g32 matrix dequantizes): int4 in the source's groups
    gives it back (float32: to rounding), as do the default groups (GROUP, 32); int4 in groups of 64 does not
    (int4.source_group)."""
    gen = torch.Generator().manual_seed(3)
    lo, step = torch.randn(48, 4, 1, generator=gen), torch.rand(48, 4, 1, generator=gen) / 10 + 0.01
    levels = torch.randint(0, 16, (48, 4, 32), generator=gen)
    levels[..., 0], levels[..., 1] = 0, 15                                            # each group spans its grid
    w = (lo + levels * step).view(48, 128)                                            # (N, K) on the source's grid
    assert int4.source_group("gguf:q4_1,q4_1") == 32 and int4.source_group("awq-g128") == 128
    assert int4.source_group("gptq-b8-g128") is None and int4.source_group("none") is None
    assert int4.held_group("awq-g128") == 128 and int4.held_group("none") == int4.GROUP
    x = torch.randn(3, 128, generator=gen)
    own = int4.Int4Weight.quantize(w, source=32)
    assert own.group == 32 and own.nbytes == int4.nbytes((48, 128), torch.float32, source=32)
    assert torch.allclose(own.matmul(x), x @ w.t(), atol=1e-4)
    assert not torch.allclose(int4.Int4Weight.quantize(w, source=64).matmul(x), x @ w.t(), atol=1e-2)
    assert torch.allclose(int4.Int4Weight.quantize(w).matmul(x), x @ w.t(), atol=1e-4)       # GROUP is 32
