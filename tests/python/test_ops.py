"""sparsebalance.ops.sparse_attention against PyTorch's own attention math: dense causal
attention with per-document masking at density 1.0, and the same restricted to the selected
blocks below 1.0 (so lower densities change the output only through the dropped blocks). The
kernels are fp32, so gradcheck in float64 does not apply: the references are computed in
float64 and compared with tolerances."""

import math

import pytest

torch = pytest.importorskip("torch")

import sparsebalance as sb  # noqa: E402
from sparsebalance import _C, attention  # noqa: E402
from sparsebalance.ops import (AttentionTimer, dense_mask, reference_attention,  # noqa: E402
                               sparse_attention, varlen_layout)

# Lengths that are not multiples of the block size, and a one-block document.
CU = [0, 300, 337, 1000]


def inputs(cu, heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(cu[-1], heads, head_dim, generator=g, dtype=torch.float64,
                        requires_grad=True) for _ in range(3)]


def grads(out, tensors, dout):
    return torch.autograd.grad(out, tensors, dout)


def assert_close(actual, expected, what):
    # fp32 kernels against a float64 reference: relative to the reference's scale.
    scale = expected.abs().max().item()
    err = (actual.double() - expected).abs().max().item()
    assert err <= 2e-5 * max(1.0, scale) + 2e-6, f"{what}: max error {err} (scale {scale})"


@pytest.mark.parametrize("heads,head_dim,block_size", [(2, 64, 64), (1, 128, 128)])
def test_dense_density_matches_pytorch_causal_attention(heads, head_dim, block_size):
    q, k, v = inputs(CU, heads, head_dim)
    out, recall = sparse_attention(q, k, v, CU, [1.0] * 3, block_size=block_size)
    ref = reference_attention(q, k, v, CU)
    assert out.dtype == torch.float64 and out.shape == q.shape
    assert_close(out, ref, "out")
    assert recall == 1.0
    dout = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), dout), grads(ref, (q, k, v), dout)):
        assert_close(a, b, f"d{name}")


def test_a_packed_samples_documents_run_as_if_alone():
    # A planned micro-batch with a pre-packed sample: its segments are sequences of their own,
    # so each document's output and gradients are those of the document run alone.
    samples = [sb.PlannedSample(id=1, length=300, density=0.4, segments=[100, 130, 70]),
               sb.PlannedSample(id=2, length=90, density=1.0)]
    cu, densities = varlen_layout(samples)
    assert (cu, densities) == ([0, 100, 230, 300, 390], [0.4, 0.4, 0.4, 1.0])
    q, k, v = inputs(cu, 2, 64, seed=5)
    out, _ = sparse_attention(q, k, v, cu, densities)
    dout = torch.randn_like(out)
    dq, dk, dv = grads(out, (q, k, v), dout)
    for a, b, density in zip(cu, cu[1:], densities):
        alone = [t.detach()[a:b].clone().requires_grad_(True) for t in (q, k, v)]
        out_alone, _ = sparse_attention(*alone, [0, b - a], [density])
        assert_close(out[a:b], out_alone.double(), f"out [{a}, {b})")
        for name, packed, single in zip("qkv", (dq, dk, dv), grads(out_alone, alone, dout[a:b])):
            assert_close(packed[a:b], single.double(), f"d{name} [{a}, {b})")
    # As one sequence, the later documents would attend to the earlier ones.
    one, _ = sparse_attention(q, k, v, [0, 300, 390], [0.4, 1.0])
    assert (one[100:300] - out[100:300]).abs().max().item() > 1e-2


def test_reference_is_pytorch_softmax_attention_per_document():
    # The reference itself, document by document, against a plain masked softmax (float64).
    q, k, v = inputs([0, 70], 1, 64)
    scores = (q[:, 0] @ k[:, 0].T) / 8.0
    scores = scores.masked_fill(torch.ones(70, 70).triu(1).bool(), float("-inf"))
    expected = torch.softmax(scores, -1) @ v[:, 0]
    assert torch.allclose(reference_attention(q, k, v, [0, 70])[:, 0], expected)


def test_lower_density_changes_output_only_through_dropped_blocks():
    q, k, v = inputs(CU, 2, 64, seed=1)
    densities = [0.2, 1.0, 0.35]
    out, recall, selection = sparse_attention(q, k, v, CU, densities, return_selection=True)
    masked = reference_attention(q, k, v, CU, selection=selection)
    dense = reference_attention(q, k, v, CU)
    assert_close(out, masked, "out vs masked reference")
    # Blocks were really dropped: the output differs from dense attention where they were.
    assert (out.double() - dense).abs().max().item() > 1e-2
    assert 0.0 < recall < 1.0 and selection.achieved_density < 1.0
    # The dense document (density 1.0) is untouched.
    a, b = CU[1], CU[2]
    assert_close(out[a:b], dense[a:b], "the density-1 document")
    dout = torch.randn_like(masked)
    for name, x, y in zip("qkv", grads(out, (q, k, v), dout), grads(masked, (q, k, v), dout)):
        assert_close(x, y, f"d{name} vs masked reference")


def test_selection_keeps_anchors_and_the_planned_count():
    q, k, v = inputs([0, 1024], 1, 64, seed=2)
    _, _, selection = sparse_attention(q, k, v, [0, 1024], [0.25], return_selection=True)
    mask = selection.block_mask(0, 0)  # 16 x 16 blocks
    for i in range(16):
        kept = [j for j in range(16) if mask[i, j]]
        assert kept == sorted(kept) and max(kept) == i  # causal, diagonal kept
        assert 0 in kept and (i == 0 or i - 1 in kept)  # sink and local block
        assert len(kept) == min(i + 1, max(math.ceil(0.25 * (i + 1)), len({0, i, max(i - 1, 0)})))
    assert dense_mask(selection, 0, 0).shape == (1024, 1024)


def test_recall_estimated_and_exact():
    q, k, v = inputs(CU, 2, 64, seed=3)
    densities = [0.3, 0.5, 0.3]
    _, estimated, selection = sparse_attention(q, k, v, CU, densities, return_selection=True)
    _, exact = sparse_attention(q, k, v, CU, densities, exact=True)
    # Exact recall = the softmax mass of the dense float64 attention inside the kept blocks,
    # averaged over every query token and head.
    kept, count = 0.0, 0
    for s in range(3):
        a, b = CU[s], CU[s + 1]
        for h in range(2):
            scores = (q[a:b, h] @ k[a:b, h].T).detach() / 8.0
            causal = torch.ones(b - a, b - a).tril().bool()
            p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
            kept += (p * dense_mask(selection, s, h)).sum().item()
            count += b - a
    assert exact == pytest.approx(kept / count, abs=1e-4)
    assert 0 < exact < 1 and abs(estimated - exact) < 0.1
    assert sparse_attention(q, k, v, CU, [1.0] * 3, exact=True)[1] == pytest.approx(1.0)


def test_timer_and_float32_inputs():
    q, k, v = (t.detach().float().requires_grad_() for t in inputs([0, 256], 1, 64))
    timer = AttentionTimer()
    out, _ = sparse_attention(q, k, v, torch.tensor([0, 256], dtype=torch.int32),
                              torch.tensor([0.5]), timer=timer)
    out.sum().backward()
    assert out.dtype == torch.float32 and q.grad.shape == q.shape
    assert timer.calls == 2 and timer.seconds > 0  # forward and backward


def test_bad_inputs_raise_clear_errors():
    q, k, v = inputs([0, 128], 1, 64)
    with pytest.raises(ValueError, match="densities"):
        sparse_attention(q, k, v, [0, 128], [0.5, 0.5])
    with pytest.raises(ValueError, match="cu_seqlens"):
        sparse_attention(q, k, v, [0, 100], [0.5])
    with pytest.raises(ValueError, match="shape"):
        sparse_attention(q[:, 0], k, v, [0, 128], [0.5])
    with pytest.raises(sb.KernelError) as e:
        sparse_attention(q, k, v, [0, 128], [0.0])
    assert e.value.code == "INVALID_ARGUMENT" and "densit" in e.value.message
    q32 = torch.randn(128, 1, 32)
    with pytest.raises(sb.KernelError, match="head_dim"):
        sparse_attention(q32, q32, q32, [0, 128], [1.0])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_non_floating_inputs_are_refused_naming_the_tensor(dtype):
    # They used to be cast to float32 and run: attention over values the caller never had.
    q, k, v = (t.detach() for t in inputs([0, 128], 1, 64))
    bad = (q * 10).to(dtype)
    for name, args in (("q", (bad, k, v)), ("k", (q, bad, v)), ("v", (q, k, bad))):
        with pytest.raises(TypeError, match=f"^{name}: dtype {dtype}"):
            sparse_attention(*args, [0, 128], [0.5])
    with pytest.raises(TypeError, match="q: dtype"):
        attention.select_blocks(bad, k, [0, 128], [0.5])


@pytest.mark.parametrize("cu", [[0, 50.7, 128], torch.tensor([0.0, 63.5, 128.0])])
def test_fractional_offsets_are_refused_not_truncated(cu):
    q, k, v = (t.detach() for t in inputs([0, 128], 1, 64))
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\]: (50\.7|63\.5) is not an integer"):
        sparse_attention(q, k, v, cu, [0.5, 0.5])
    # Integral values of a float tensor are offsets all the same.
    out, _ = sparse_attention(q, k, v, torch.tensor([0.0, 64.0, 128.0]), [0.5, 0.5])
    ref, _ = sparse_attention(q, k, v, [0, 64, 128], [0.5, 0.5])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("scale", [0.0, -1.0, 1e-50, 1e40, float("nan"), float("inf")])
def test_an_explicit_softmax_scale_must_be_one_the_kernels_use(scale):
    # 0 (or a scale that rounds to 0 in float32) was silently replaced by 1/sqrt(head_dim).
    q, k, v = (t.detach() for t in inputs([0, 128], 1, 64))
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_attention(q, k, v, [0, 128], [1.0], softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale"):
        attention.select_blocks(q, k, [0, 128], [1.0], softmax_scale=scale)


def test_the_default_and_a_given_softmax_scale_are_the_ones_applied():
    q, k, v = (t.detach() for t in inputs([0, 128], 1, 64))
    for given, applied in ((None, 64 ** -0.5), (0.3, 0.3)):
        out, _ = sparse_attention(q, k, v, [0, 128], [1.0], softmax_scale=given)
        ref = reference_attention(q, k, v, [0, 128], softmax_scale=applied)
        assert_close(out, ref, f"softmax_scale={given}")


def test_threads_are_checked_and_never_exceed_the_work():
    q, k, v = (t.detach() for t in inputs([0, 128], 2, 64))
    ref, _ = sparse_attention(q, k, v, [0, 128], [0.5], threads=1)
    # 2 heads, 2^31 - 1 threads asked: a workspace per asked thread was a MemoryError.
    out, _ = sparse_attention(q, k, v, [0, 128], [0.5], threads=2 ** 31 - 1)
    assert torch.equal(out, ref)
    for bad, error in ((-3, ValueError), (2 ** 40, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="threads"):
            sparse_attention(q, k, v, [0, 128], [0.5], threads=bad)
    # The bindings refuse a negative count too (the kernels' 0 means every core).
    import numpy as np
    qn = q.float().numpy()
    with pytest.raises(sb.KernelError, match="threads=-1 must be non-negative"):
        _C.select_blocks([0, 128], 2, 64, qn, qn, [1.0], threads=-1)
    selection = _C.select_blocks([0, 128], 2, 64, qn, qn, [1.0])
    out_np, lse = np.zeros_like(qn), np.zeros((2, 128), np.float32)
    with pytest.raises(sb.KernelError, match="threads=-2 must be non-negative"):
        _C.attention_forward(selection, 64, qn, qn, qn, out_np, lse, threads=-2)


def test_kernel_bindings_use_buffers_in_place_and_refuse_copies():
    import numpy as np
    q = np.random.default_rng(0).standard_normal((128, 1, 64)).astype(np.float32)
    selection = _C.select_blocks([0, 128], 1, 64, q, q, [1.0])
    out = np.zeros((128, 1, 64), np.float32)
    lse = np.zeros((1, 128), np.float32)
    _C.attention_forward(selection, 64, q, q, q, out, lse)
    assert np.abs(out).sum() > 0 and np.isfinite(lse).all()  # written into our arrays
    with pytest.raises(ValueError, match="float32"):  # no silent conversion (a lost write)
        _C.attention_forward(selection, 64, q, q, q, out.astype(np.float64), lse)
    noncontiguous = np.zeros((128, 2, 64), np.float32)[:, :1]
    with pytest.raises(ValueError, match="contiguous"):
        _C.attention_forward(selection, 64, q, q, q, noncontiguous, lse)
    with pytest.raises(ValueError, match="writable"):
        readonly = out.copy()
        readonly.setflags(write=False)
        _C.attention_forward(selection, 64, q, q, q, readonly, lse)


def test_cuda_tensors_need_cuda_kernels_and_a_device():
    compiled = _C.cuda_compiled()
    count, why = _C.cuda_device_count()
    if torch.cuda.is_available() and compiled and count > 0:
        q, k, v = (t.detach().float() for t in inputs(CU, 2, 64))
        ref = reference_attention(q.double(), k.double(), v.double(), CU)
        qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
        out, recall = sparse_attention(qc, kc, vc, CU, [1.0] * 3)
        assert (out.double().cpu() - ref).abs().max().item() < 3e-2  # bf16
        out.sum().backward()
        assert qc.grad is not None and recall == pytest.approx(1.0)
        return
    from sparsebalance.ops import _cuda_unavailable_reason
    reason = _cuda_unavailable_reason()
    assert reason and ("no CUDA kernels" in reason or "no device" in reason)
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch ({reason})")


def test_selection_arrays_hold_the_kernels_values_under_numpy_2():
    # Regression: built with pybind11 2.10 (Debian bookworm's), arrays the module returns were
    # all zeros under numpy 2 (it read numpy 2's dtype structs with the old layout).
    import numpy

    q, k, v = inputs(CU, 1, 64, seed=4)
    _, _, selection = sparse_attention(q, k, v, CU, [0.5] * 3, return_selection=True)
    assert [int(x) for x in selection.cu_seqlens] == CU, numpy.__version__
    assert [int(x) for x in selection.cu_blocks] == [0, 5, 6, 17]
    assert int(selection.row_ptr[-1]) == len(selection.col_idx) > 0
