"""Block-sparse causal attention for PyTorch over SparseBalance's kernels.

``sparse_attention`` takes a varlen batch in FlashAttention's layout (documents packed along
the token axis, ``cu_seqlens`` their offsets), keeps for every query block only the key blocks
that block selection picks at each document's density (the planner's ``PlannedSample.density``)
and returns the output and the recall it kept::

    from sparsebalance.ops import sparse_attention, varlen_layout
    out, recall = sparse_attention(q, k, v, cu_seqlens=[0, 1000, 3000], densities=[0.3, 1.0])
    # q, k, v: [total_tokens, heads, head_dim] (head_dim 64 or 128); out: same shape and dtype
    cu_seqlens, densities = varlen_layout(micro_batch.samples)  # a planned micro-batch's layout

CPU tensors run the fp32 reference kernels (inputs of other floating-point dtypes are cast to
float32 and the results cast back; integer, bool and complex tensors are refused); CUDA tensors
run the sm_90 kernels in bf16 when the package was built with CUDA and a device is present.
Documents never attend to each other. Gradients flow to q, k, v.
"""

import contextlib
import math
import numbers
import time

import torch

from . import _C

__all__ = ["AttentionTimer", "sparse_attention", "reference_attention", "dense_mask",
           "varlen_layout"]


class AttentionTimer:
    """Adds up the seconds spent in the attention kernels (selection, forward, backward) of the
    calls it is passed to; ``clock`` is e.g. time.perf_counter (wall) or time.thread_time
    (this thread's CPU time, fair when ranks share cores)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds = 0.0
        self.calls = 0

    def reset(self):
        self.seconds = 0.0
        self.calls = 0

    def _add(self, start):
        self.seconds += self.clock() - start
        self.calls += 1


class _Outputs:
    """What a forward leaves for the caller besides the output tensor."""

    selection = None


@contextlib.contextmanager
def _timed(timer):
    """Adds the seconds of the block to ``timer`` (when there is one) if the block succeeds."""
    start = timer.clock() if timer is not None else 0.0
    yield
    if timer is not None:
        timer._add(start)


def _keep_for_backward(ctx, saved, timer, outputs, selection, /, **state):
    """What both kernels' forward leave: ``saved`` tensors and ``state`` (the kernel's own
    handles and settings) for backward, and the selection for the caller."""
    ctx.save_for_backward(*saved)
    ctx.timer = timer
    for name, value in state.items():
        setattr(ctx, name, value)
    outputs.selection = selection


# Backward's gradients for forward's inputs after q, k, v: cu_seqlens, densities, options,
# timer and outputs have none.
_NO_GRADIENTS = (None,) * 5


class _SparseAttentionCpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, densities, options, timer, outputs):
        tokens, heads, head_dim = q.shape
        block_size, local_blocks, scale, mass_threshold, threads, mode, tau = options
        qn, kn, vn = q.detach().numpy(), k.detach().numpy(), v.detach().numpy()
        with _timed(timer):
            selection = _C.select_blocks(cu_seqlens, heads, head_dim, qn, kn, densities,
                                         block_size, local_blocks, mass_threshold, scale, threads,
                                         mode, tau)
            out = torch.empty((tokens, heads, head_dim), dtype=torch.float32)
            lse = torch.empty((heads, tokens), dtype=torch.float32)
            _C.attention_forward(selection, head_dim, qn, kn, vn, out.numpy(), lse.numpy(), scale,
                                 threads)
        _keep_for_backward(ctx, (q, k, v, out, lse), timer, outputs, selection,
                           selection=selection, scale=scale, threads=threads)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        head_dim = q.shape[2]
        dout = dout.to(torch.float32).contiguous()
        dq = torch.empty(q.shape, dtype=torch.float32)
        dk = torch.empty(k.shape, dtype=torch.float32)
        dv = torch.empty(v.shape, dtype=torch.float32)
        with _timed(ctx.timer):
            _C.attention_backward(ctx.selection, head_dim, q.detach().numpy(),
                                  k.detach().numpy(), v.detach().numpy(), out.detach().numpy(),
                                  lse.numpy(), dout.numpy(), dq.numpy(), dk.numpy(), dv.numpy(),
                                  ctx.scale, ctx.threads)
        return (dq, dk, dv) + _NO_GRADIENTS


class _SparseAttentionCuda(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, densities, options, timer, outputs):
        tokens, heads, head_dim = q.shape
        block_size, local_blocks, scale, mass_threshold, _, mode, tau = options
        with _timed(timer):
            stream = _current_stream(q.device)
            selection = _C.cuda_select_blocks(cu_seqlens, heads, head_dim, q.data_ptr(),
                                              k.data_ptr(), densities, block_size, local_blocks,
                                              mass_threshold, scale, mode, tau, stream)
            index = selection.index
            out = torch.empty_like(q)
            lse = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)
            _C.cuda_forward(index, head_dim, q.data_ptr(), k.data_ptr(), v.data_ptr(), scale,
                            out.data_ptr(), lse.data_ptr(), stream)
        _keep_for_backward(ctx, (q, k, v, out, lse), timer, outputs, selection,
                           index=index, scale=scale)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.to(torch.bfloat16).contiguous()
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        with _timed(ctx.timer):
            _C.cuda_backward(ctx.index, q.shape[2], q.data_ptr(), k.data_ptr(), v.data_ptr(),
                             out.data_ptr(), lse.data_ptr(), dout.data_ptr(), ctx.scale,
                             delta.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                             _current_stream(q.device))
        return (dq, dk, dv) + _NO_GRADIENTS


def _current_stream(device):
    # The kernels queue their work on the stream they are given: PyTorch's current stream on
    # `device`, so that they are ordered with the work that made and will read the tensors.
    return torch.cuda.current_stream(device).cuda_stream


def _cuda_unavailable_reason():
    if not _C.cuda_compiled():
        return ("this sparsebalance build has no CUDA kernels (built without nvcc, or with "
                "-DSB_WITH_CUDA=OFF): rebuild with CUDA, or pass CPU tensors")
    count, why = _C.cuda_device_count()
    if count == 0:
        return f"the CUDA kernels see no device ({why})"
    return None


def _exact_int(x, name, i):
    """``x``, the ``i``-th of ``name``, as an int: an integer, or a real number without a
    fraction (a float tensor's 100.0); ValueError naming the entry otherwise, since rounding
    an offset would silently move a document boundary."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    if isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and \
            float(x).is_integer():
        return int(x)
    raise ValueError(f"{name}[{i}]: {x!r} is not an integer")


def _as_list(values, name, convert):
    """``values`` (a sequence or a tensor) as a list of ``convert`` (int or float); ints must
    be integral (_exact_int)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    try:
        if convert is int:
            return [_exact_int(x, name, i) for i, x in enumerate(values)]
        return [convert(x) for x in values]
    except TypeError:
        raise TypeError(f"{name}: a sequence of numbers is needed, got {type(values).__name__}")


def _softmax_scale_arg(softmax_scale):
    """The kernels' softmax scale: 0.0 (their "1/sqrt(head_dim)") for None, else the given
    scale, which must be a finite positive number that float32 holds (ValueError naming it: an
    explicit 0 or a scale rounding to 0 would silently become 1/sqrt(head_dim))."""
    if softmax_scale is None:
        return 0.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale: a number is needed, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    f32 = torch.finfo(torch.float32)
    if not (math.isfinite(scale) and f32.tiny <= scale <= f32.max):
        raise ValueError(f"softmax_scale: {softmax_scale!r} must be a positive finite float32 "
                         f"in [{f32.tiny:g}, {f32.max:g}]; leave it None for 1/sqrt(head_dim)")
    return scale


def _threads_arg(threads):
    """CPU kernel threads: torch.get_num_threads() for None, else an int in [0, 2^31) (0: every
    core), ValueError naming it otherwise."""
    if threads is None:
        return torch.get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads: an int is needed, got {type(threads).__name__}")
    if not 0 <= threads < 2 ** 31:
        raise ValueError(f"threads: {threads} must be in [0, 2^31) (0: every core)")
    return int(threads)


_SELECTION_MODES = ("topk", "anchor")


def _selection_args(selection, anchor_threshold):
    """(mode name, tau) checked: ValueError naming the argument."""
    if isinstance(selection, _C.SelectionMode):
        selection = selection.label
    if selection not in _SELECTION_MODES:
        raise ValueError(f"selection: {selection!r} is not a selection mode ('topk' or "
                         "'anchor')")
    if isinstance(anchor_threshold, bool) or not isinstance(anchor_threshold, (int, float)) or \
            not 0.0 < anchor_threshold <= 1.0:
        raise ValueError(f"anchor_threshold: {anchor_threshold!r} is not in (0, 1]")
    return selection, float(anchor_threshold)


def _check_inputs(q, k, v, cu_seqlens, densities):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: a torch.Tensor is needed, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: shape {tuple(t.shape)}; [total_tokens, heads, head_dim] "
                             "is needed")
        if not t.is_floating_point():
            # Casting integers, bools or complex numbers to float32 would compute something,
            # silently, that is not attention over the caller's values.
            raise TypeError(f"{name}: dtype {t.dtype} is not a floating-point dtype (float16, "
                            "bfloat16, float32 or float64)")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                         "differ")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: devices {q.device}, {k.device}, {v.device} differ")
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens: must start at 0 and end at total_tokens={q.shape[0]} "
                         f"(got {cu_seqlens[:3]}...{cu_seqlens[-1:]})")
    if len(densities) != len(cu_seqlens) - 1:
        raise ValueError(f"densities: {len(densities)} values for {len(cu_seqlens) - 1} "
                         "sequences (one per sequence is needed)")


def sparse_attention(q, k, v, cu_seqlens, densities, block_size=64, local_blocks=1, *,
                     softmax_scale=None, exact=False, mass_threshold=1.0, threads=None,
                     timer=None, return_selection=False, selection="topk",
                     anchor_threshold=0.05):
    """Block-sparse causal attention over a varlen batch.

    Args:
      q, k, v: [total_tokens, heads, head_dim] tensors (head_dim 64 or 128), on the CPU (any
        floating-point dtype; computed in float32) or on a CUDA device (computed in bf16).
      cu_seqlens: sequence offsets, len = sequences + 1, from 0 to total_tokens (list or tensor
        of integers; a fractional offset is refused).
      densities: one per sequence in (0, 1]: the share of causal key blocks each query block
        keeps (1.0 is dense attention). The planner's PlannedSample.density (varlen_layout).
      block_size: tokens per block (64 or 128); local_blocks: key blocks before the diagonal
        always kept (with the sink block 0 and the diagonal).
      softmax_scale: a positive finite float32; None (the default) for 1/sqrt(head_dim). 0, a
        negative or a non-finite scale is refused (ValueError), not replaced.
      exact: the recall is the exact softmax mass kept (CPU only; O(tokens^2)) instead of the
        block scores' estimate.
      mass_threshold: stop adding blocks to a row once its estimated kept mass reaches it.
      threads: CPU kernel threads, at least 0 (0: every core; default
        torch.get_num_threads()); never more run than sequences x heads.
      selection: 'topk' (each query block keeps its density's budget k_i of best-scoring key
        blocks) or 'anchor' (anchor-guided thresholding: of those, only the blocks whose pooled
        score is at least the best anchor block's + ln(anchor_threshold); never more).
      anchor_threshold: tau of 'anchor', in (0, 1].
      timer: an AttentionTimer that adds the kernel seconds of forward and backward.
      return_selection: also return the Selection (kept blocks per row, see block_mask).

    Returns:
      (out, recall): out like q; recall a float, the token-weighted share of softmax mass the
      kept blocks hold (1.0 at density 1). With return_selection: (out, recall, selection).
    """
    cu = _as_list(cu_seqlens, "cu_seqlens", int)
    dens = _as_list(densities, "densities", float)
    _check_inputs(q, k, v, cu, dens)
    head_dim = q.shape[2]
    scale = _softmax_scale_arg(softmax_scale)
    threads = _threads_arg(threads)
    mode, tau = _selection_args(selection, anchor_threshold)
    options = (int(block_size), int(local_blocks), scale, float(mass_threshold), threads,
               mode, tau)
    outputs = _Outputs()
    if q.is_cuda:
        reason = _cuda_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"sparse_attention: q is on {q.device} but {reason}")
        if exact:
            raise ValueError("sparse_attention: exact=True is CPU only (the CUDA path reports "
                             "the block scores' estimate)")
        dtype = q.dtype
        with torch.cuda.device(q.device):
            qb, kb, vb = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
            out = _SparseAttentionCuda.apply(qb, kb, vb, cu, dens, options, timer, outputs)
        out = out.to(dtype)
        # The selection stays on the GPU: its per-row estimates come to the host for the
        # recall, the whole index only when the caller asks for it.
        stream = _current_stream(q.device)
        recall = outputs.selection.recall(stream)
        if return_selection:
            return out, recall, outputs.selection.download(stream)
        return out, recall
    else:
        if q.device.type != "cpu":
            raise RuntimeError(f"sparse_attention: tensors on {q.device} are not supported "
                               "(CPU or CUDA)")
        dtype = q.dtype
        q32, k32, v32 = (t.to(torch.float32).contiguous() for t in (q, k, v))
        out = _SparseAttentionCpu.apply(q32, k32, v32, cu, dens, options, timer, outputs)
        out = out.to(dtype)
        selection = outputs.selection
        if exact:
            rows = _C.exact_recall(selection, head_dim, q32.detach().numpy(),
                                   k32.detach().numpy(), scale, options[4])
            recall = selection.token_weighted(rows)
        else:
            recall = selection.recall
    if return_selection:
        return out, recall, selection
    return out, recall


def varlen_layout(samples):
    """The varlen layout of planned samples (a MicroBatchPlan's ``samples``, in order): every
    document is a sequence of its own, a pre-packed sample's segments included, so that no
    document attends across a boundary. Returns (cu_seqlens, densities) for sparse_attention:
    offsets over the documents and each document's sample density."""
    cu, densities = [0], []
    for s in samples:
        for n in s.documents():
            cu.append(cu[-1] + int(n))
            densities.append(float(s.density))
    return cu, densities


def dense_mask(selection, seq, head, causal=True):
    """Token-level bool mask [length, length] of sequence ``seq``, head ``head``: True where a
    query token attends to a key token under the selection (kept block and, with causal,
    key <= query)."""
    block_size = selection.block_size
    length = int(selection.cu_seqlens[seq + 1] - selection.cu_seqlens[seq])
    blocks = torch.from_numpy(selection.block_mask(seq, head)).bool()
    mask = blocks.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    mask = mask[:length, :length]
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    return mask


def reference_attention(q, k, v, cu_seqlens, selection=None, softmax_scale=None):
    """Dense causal attention in plain PyTorch (per-document masking), optionally restricted to
    a Selection's kept blocks: what sparse_attention computes, for checking it. Works in the
    inputs' dtype (use float64 for a tight reference). O(tokens^2) memory per document."""
    cu = _as_list(cu_seqlens, "cu_seqlens", int)
    heads, head_dim = q.shape[1], q.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    outs = []
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [heads, length, head_dim]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if selection is None:
            mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
            mask = mask.expand(heads, -1, -1)
        else:
            mask = torch.stack([dense_mask(selection, s, h) for h in range(heads)]).to(q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1))
    return torch.cat(outs, dim=0)
