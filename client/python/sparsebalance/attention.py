"""The planner's plan in the terms of a trainer's own attention kernel, and a profile of it.

Three things for trainers that keep their own attention instead of ``ops.sparse_attention``:

- ``kernel_plan(micro_batch)``: the varlen layout of a planned micro-batch (``cu_seqlens``,
  ``max_seqlen``, per-document densities) and, for top-k kernels (NSA/MoBA style), how many key
  blocks each query block keeps, by the planner's own rule (contract/block_geometry.h).
- ``flex_block_mask(selection)``: a FlexAttention ``BlockMask`` that keeps exactly the blocks a
  block selection kept (``select_blocks``, or ``sparse_attention(..., return_selection=True)``),
  inside each document and causally; documents need not start on block boundaries.
- ``measure_recall(q, k, plan)``: the exact softmax mass the plan's kept blocks hold, per
  document, on a few sampled query rows (what the planner learns its recall curves from).
- ``profile(attention, lengths, densities, shape)``: times the trainer's attention (and linear)
  callable, forward and backward, and returns the profile table text for
  ``PlannerClient.upload_profile``, so that the planner's prior is the trainer's kernel.

::

    from torch.nn.attention.flex_attention import flex_attention
    from sparsebalance.attention import (flex_block_mask, from_flex_layout, kernel_plan,
                                         select_blocks, to_flex_layout)
    kp = kernel_plan(micro_batch, block_size=64)             # kp.cu_seqlens, kp.topk(doc), ...
    sel = select_blocks(q, k, kp.cu_seqlens, kp.densities)   # q, k: [tokens, heads, head_dim]
    mask = flex_block_mask(sel, kp.cu_seqlens, device=q.device, dtype=q.dtype)
    out = from_flex_layout(flex_attention(*map(to_flex_layout, (q, k, v)), block_mask=mask))
"""

import dataclasses
import platform
import statistics
import threading
import time
import warnings

import torch

from . import _C
from .ops import (_as_list, _check_inputs, _cuda_unavailable_reason, _current_stream,
                  _selection_args, _softmax_scale_arg, _threads_arg)

__all__ = ["KernelPlan", "RecallMeasurement", "flex_attention", "flex_block_mask",
           "from_flex_layout", "kernel_plan", "measure_recall", "profile", "recall_rows",
           "select_blocks", "to_flex_layout"]


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """A micro-batch plan in a varlen kernel's terms. Every document is a sequence of its own
    (a pre-packed sample's segments too), in placement order.

    Fields:
      cu_seqlens: int32 [documents + 1] token offsets (FlashAttention's varlen layout).
      max_seqlen: tokens of the longest document.
      densities: float64 [documents], the planned density of each document's sample.
      sample_ids: the PlannedSample.id each document belongs to.
      block_size, local_blocks: the block geometry the budgets below are counted in.
      kept: int32 [documents, max query blocks]: kept[d, i] = k_i, the key blocks query block i
        of document d keeps (the top-k budget), 0 beyond the document's query blocks.
      query_blocks: int32 [documents], ceil(length / block_size).
      selection_mode, anchor_threshold: the block selection ``select`` runs, 'topk' (``topk(doc)``
        blocks per query block) or 'anchor' (anchor-guided thresholding: at most that many, see
        ``select_blocks``), and its tau (the job's PlannerConfig.selection / anchor_threshold).
      on_select: optional ``on_select(q, k, selection)``, called by ``select`` (and so
        ``block_mask``) with every selection it makes (sparsebalance.torch measures recall through it); not compared.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    densities: torch.Tensor
    sample_ids: tuple
    block_size: int
    local_blocks: int
    kept: torch.Tensor
    query_blocks: torch.Tensor
    selection_mode: str = "topk"
    anchor_threshold: float = 0.05
    on_select: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def documents(self):
        """Documents (varlen sequences) in the micro-batch."""
        return len(self.sample_ids)

    def topk(self, doc):
        """int32 [query_blocks(doc)]: key blocks each query block of document ``doc`` keeps."""
        if not 0 <= doc < self.documents:
            raise IndexError(f"doc: {doc} is not in [0, {self.documents})")
        return self.kept[doc, :int(self.query_blocks[doc])]

    def active_blocks(self):
        """int64 [documents]: kept (query block, key block) pairs of each document, one head
        (the planner's A(L, rho))."""
        return self.kept.sum(dim=1, dtype=torch.int64)

    def select(self, q, k, **options):
        """Our block selection of this micro-batch for one layer's q, k ([tokens, heads,
        head_dim]): the top-k blocks by pooled score, ``topk(doc)`` per query block (in the
        plan's ``selection_mode``: 'anchor' keeps at most that many). ``options``: of
        ``select_blocks``, overriding the plan's."""
        options.setdefault("selection", self.selection_mode)
        options.setdefault("anchor_threshold", self.anchor_threshold)
        selection = select_blocks(q, k, self.cu_seqlens.cpu(), self.densities.tolist(),
                                  self.block_size, self.local_blocks, **options)
        if self.on_select is not None:
            self.on_select(q, k, selection)
        return selection

    def block_mask(self, q, k):
        """The FlexAttention BlockMask of one layer: ``select`` on q, k, then
        ``flex_block_mask`` for q's device and dtype. Use with ``flex_attention`` below (or
        torch's on CUDA) on q, k, v in FlexAttention's layout."""
        return flex_block_mask(self.select(q, k), self.cu_seqlens.cpu(), device=q.device,
                               dtype=q.dtype)

    def document_indices(self):
        """Per document, its index among its sample's documents (a pre-packed sample's
        segments count 0, 1, ...; DocumentRecallMeasurement.document)."""
        out, seen = [], {}
        for n, sid in enumerate(self.sample_ids):
            if n > 0 and self.sample_ids[n - 1] == sid:
                seen[sid] += 1
            else:
                seen[sid] = 0
            out.append(seen[sid])
        return out


def _samples_of(plan):
    if hasattr(plan, "samples"):
        return list(plan.samples)
    try:
        return list(plan)
    except TypeError:
        raise TypeError(f"plan: a MicroBatchPlan or a list of PlannedSample is needed, got "
                        f"{type(plan).__name__}") from None


def _check_density(value, name):
    if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
        raise ValueError(f"{name}: {value!r} is not in (0, 1]")


def kernel_plan(plan, block_size=64, local_blocks=1, *, layer=None, device="cpu",
                selection="topk", anchor_threshold=0.05):
    """The varlen layout and per-query-block top-k budgets of a micro-batch plan.

    Args:
      plan: a MicroBatchPlan, or its ``samples`` (PlannedSample list) in placement order.
      block_size: tokens per block of the kernel's top-k (the job's ModelShape.block_size, so
        that the budgets are the blocks the planner costed); local_blocks: likewise.
      layer: with a layer index, a sample's ``layer_densities[layer]`` where it has them.
      device: where the tensors go (cu_seqlens on the GPU for a CUDA kernel).
      selection, anchor_threshold: the selection mode the plan's ``select`` runs ('topk' or
        'anchor', or a SelectionMode) and its tau in (0, 1] (the job's PlannerConfig fields).

    Returns a KernelPlan; k_i = clamp(ceil(rho * (i+1)), anchors_i, i+1) with rho quantized to
    1/65536, computed by the C++ rule the planner and our kernels use.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: {block_size!r} is not a positive integer")
    if not isinstance(local_blocks, int) or local_blocks < 0:
        raise ValueError(f"local_blocks: {local_blocks!r} is not a non-negative integer")
    selection, anchor_threshold = _selection_args(selection, anchor_threshold)
    cu, densities, ids, kept_rows = [0], [], [], []
    for n, sample in enumerate(_samples_of(plan)):
        density = sample.density
        if layer is not None and sample.layer_densities:
            if not 0 <= layer < len(sample.layer_densities):
                raise ValueError(f"layer: {layer} is not in [0, {len(sample.layer_densities)}) "
                                 f"(samples[{n}].layer_densities)")
            density = sample.layer_densities[layer]
            _check_density(density, f"samples[{n}].layer_densities[{layer}]")
        else:
            _check_density(density, f"samples[{n}].density")
        for d, length in enumerate(sample.documents()):
            if length < 1:
                raise ValueError(f"samples[{n}].segments[{d}]: {length} tokens; documents need "
                                 "at least one")
            cu.append(cu[-1] + int(length))
            densities.append(float(density))
            ids.append(int(sample.id))
            kept_rows.append(torch.from_numpy(
                _C.kept_blocks_per_row(int(length), float(density), block_size, local_blocks)))
    if cu[-1] >= 2 ** 31:
        raise ValueError(f"plan: {cu[-1]} tokens do not fit int32 cu_seqlens")
    query_blocks = torch.tensor([len(r) for r in kept_rows], dtype=torch.int32)
    kept = torch.zeros((len(kept_rows), max((len(r) for r in kept_rows), default=0)),
                       dtype=torch.int32)
    for d, row in enumerate(kept_rows):
        kept[d, :len(row)] = row
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    return KernelPlan(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                      max_seqlen=max(lengths, default=0),
                      densities=torch.tensor(densities, dtype=torch.float64, device=device),
                      sample_ids=tuple(ids), block_size=block_size, local_blocks=local_blocks,
                      kept=kept.to(device), query_blocks=query_blocks.to(device),
                      selection_mode=selection, anchor_threshold=anchor_threshold)



def select_blocks(q, k, cu_seqlens, densities, block_size=64, local_blocks=1, *,
                  softmax_scale=None, mass_threshold=1.0, threads=None, selection="topk",
                  anchor_threshold=0.05):
    """Runs our block selection alone (no attention): the Selection that ``sparse_attention``
    with the same arguments makes, for a kernel of the trainer's own (``flex_block_mask``).

    q, k: [total_tokens, heads, head_dim] on the CPU (selected in float32) or a CUDA device
    (bf16, needs the CUDA build). Other arguments as in ``ops.sparse_attention``; with
    mass_threshold 1 and selection 'topk' every query block keeps exactly ``KernelPlan.topk``
    blocks. selection 'anchor' (anchor-guided thresholding) keeps, of those, in the same order
    (descending pooled score), only the blocks whose score is at least the best anchor block's
    (sink block 0, the diagonal and its local blocks) + ln(anchor_threshold): a subset of the
    top-k row, anchors always kept; a row whose budget covers every causal block stays dense.
    """
    mode, tau = _selection_args(selection, anchor_threshold)
    cu = _as_list(cu_seqlens, "cu_seqlens", int)
    dens = _as_list(densities, "densities", float)
    _check_inputs(q, k, k, cu, dens)
    heads, head_dim = q.shape[1], q.shape[2]
    scale = _softmax_scale_arg(softmax_scale)
    if q.is_cuda:
        reason = _cuda_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"select_blocks: q is on {q.device} but {reason}")
        with torch.cuda.device(q.device):
            qb, kb = (t.detach().to(torch.bfloat16).contiguous() for t in (q, k))
            stream = _current_stream(q.device)
            selection = _C.cuda_select_blocks(cu, heads, head_dim, qb.data_ptr(), kb.data_ptr(),
                                              dens, int(block_size), int(local_blocks),
                                              float(mass_threshold), scale, mode, tau, stream)
            return selection.download(stream)
    if q.device.type != "cpu":
        raise ValueError(f"q: tensors on {q.device} are not supported (CPU or CUDA)")
    threads = _threads_arg(threads)
    q32, k32 = (t.detach().to(torch.float32).contiguous() for t in (q, k))
    return _C.select_blocks(cu, heads, head_dim, q32.numpy(), k32.numpy(), dens, int(block_size),
                            int(local_blocks), float(mass_threshold), scale, threads, mode, tau)


def recall_rows(length, rows=8):
    """The query rows (document-relative, ascending) ``measure_recall`` samples in a document of
    ``length`` tokens: its last ``max(1, rows // 4)`` rows (where a document's answer usually
    is) and one row at the midpoint of each of the other ``rows`` equal strata of the rest;
    every row when the document has at most ``rows``. Deterministic."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows: {rows!r} is not a positive integer")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length: {length!r} is not a positive integer")
    if length <= rows:
        return list(range(length))
    tail = max(1, rows // 4)
    rest, strata = length - tail, rows - tail
    picked = {length - 1 - t for t in range(tail)}
    picked.update(int((j + 0.5) * rest / strata) for j in range(strata))
    return sorted(picked)  # strata of rest >= strata rows never collide: (j + 0.5) r / s


@dataclasses.dataclass(frozen=True)
class RecallMeasurement:
    """What ``measure_recall`` measured, per document of the plan (placement order).

    Fields:
      recall: float64 [documents] (CPU): mean over the sampled rows and heads of the exact
        softmax mass inside the kept blocks (1.0: the kept blocks hold all of it).
      rows: int64 [documents]: query rows sampled in each document (``recall_rows``).
    """

    recall: torch.Tensor
    rows: torch.Tensor

    def token_weighted(self, cu_seqlens):
        """Mean recall weighted by the documents' tokens."""
        cu = torch.as_tensor(cu_seqlens).cpu().to(torch.float64)
        weights = cu[1:] - cu[:-1]
        return float((self.recall * weights).sum() / weights.sum().clamp(min=1.0))


def _kept_keys(selection, doc, heads, local_rows, length, block, device):
    """bool [heads, rows, length]: key token j of the document is in a kept block of the row's
    query block (causality applied by the caller)."""
    blocks = int(selection.cu_blocks[doc + 1] - selection.cu_blocks[doc])
    base = int(selection.cu_blocks[doc]) * heads
    query_block = torch.as_tensor(local_rows, dtype=torch.int64) // block
    row_id = (base + torch.arange(heads, dtype=torch.int64)[:, None] * blocks +
              query_block[None, :]).reshape(-1)
    row_ptr = torch.from_numpy(selection.row_ptr)
    col_idx = torch.from_numpy(selection.col_idx).to(torch.int64)
    starts, ends = row_ptr[row_id].to(torch.int64), row_ptr[row_id + 1].to(torch.int64)
    counts = ends - starts
    entry_row = torch.repeat_interleave(torch.arange(row_id.numel()), counts)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts)
    kept_blocks = torch.zeros((row_id.numel(), blocks), dtype=torch.bool)
    kept_blocks[entry_row, col_idx[starts[entry_row] + offsets]] = True
    key_block = torch.arange(length, dtype=torch.int64) // block
    return kept_blocks[:, key_block].view(heads, len(local_rows), length).to(device)


@torch.no_grad()
def measure_recall(q, k, plan, rows=8, *, selection=None, softmax_scale=None):
    """The recall of one layer's kept blocks, per document: on ``recall_rows(length, rows)``
    query rows of every document and every head, the exact softmax mass (causal, inside the
    document) that falls in the key blocks the row's query block keeps; the mean over rows and
    heads.

    Args:
      q, k: [total_tokens, heads, head_dim] of one layer, packed like ``plan.cu_seqlens`` (CPU
        or CUDA; computed in float32).
      plan: the micro-batch's KernelPlan (``kernel_plan`` or ``MicroBatch.attention``).
      rows: query rows sampled per document (at most this many; all of a shorter document).
      selection: the kept blocks (a Selection: ``plan.select(q, k)``, which
        ``plan.block_mask(q, k)`` masks with); None selects them here (the same blocks).
      softmax_scale: of the attention (default 1 / sqrt(head_dim)).

    Cost: rows x length x heads x head_dim per document, one host copy at the end: a few rows
    against the attention's length^2 / 2 x density.
    Returns a RecallMeasurement.
    """
    if not isinstance(plan, KernelPlan):
        raise TypeError(f"plan: a KernelPlan is needed, got {type(plan).__name__}")
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q, k: [tokens, heads, head_dim] of the same shape are needed, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    cu = plan.cu_seqlens.cpu().tolist()
    if q.shape[0] != cu[-1]:
        raise ValueError(f"q: {q.shape[0]} tokens where plan.cu_seqlens holds {cu[-1]}")
    if selection is None:  # the plan's selection (not plan.select: that would call on_select)
        selection = select_blocks(q, k, cu, plan.densities.tolist(), plan.block_size,
                                  plan.local_blocks, selection=plan.selection_mode,
                                  anchor_threshold=plan.anchor_threshold)
    elif not isinstance(selection, _C.Selection):
        raise TypeError(f"selection: a sparsebalance Selection is needed, got "
                        f"{type(selection).__name__}")
    if selection.cu_seqlens.tolist() != cu or selection.heads != q.shape[1]:
        raise ValueError("selection: it is not of this plan's documents and q's heads")
    heads, head_dim = q.shape[1], q.shape[2]
    scale = 1.0 / head_dim ** 0.5 if softmax_scale is None else float(softmax_scale)
    block = selection.block_size
    recalls, counts = [], []
    for doc in range(len(cu) - 1):
        start, length = cu[doc], cu[doc + 1] - cu[doc]
        local = recall_rows(length, rows)
        index = torch.tensor(local, dtype=torch.int64, device=q.device)
        qr = q[start + index].float()                       # [R, H, D]
        kd = k[start:start + length].float()                # [L, H, D]
        logits = torch.einsum("rhd,lhd->hrl", qr, kd) * scale
        causal = torch.arange(length, device=q.device)[None, :] <= index[:, None]  # [R, L]
        logits = logits.masked_fill(~causal, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        kept = _kept_keys(selection, doc, heads, local, length, block, q.device)
        recalls.append((p * kept).sum(-1).mean())
        counts.append(len(local))
    recall = (torch.stack(recalls).to(device="cpu", dtype=torch.float64) if recalls else
              torch.zeros(0, dtype=torch.float64))
    return RecallMeasurement(recall=recall.clamp(0.0, 1.0),
                             rows=torch.tensor(counts, dtype=torch.int64))


def flex_attention(query, key, value, block_mask=None, **kwargs):
    """torch.nn.attention.flex_attention.flex_attention, differentiable on the CPU too.

    torch 2.15 refuses CPU inputs that require grad in one up-front check, although the unfused
    path it runs on the CPU (the dense math of its higher-order op, autograd included)
    computes the gradients; tests/python/test_attention.py checks them against the dense
    reference. On the CPU this lifts that one check for the call; elsewhere it is torch's
    function unchanged. Arguments as torch's.
    """
    from torch.nn.attention import flex_attention as flex

    if query.device.type != "cpu" or not (query.requires_grad or key.requires_grad or
                                          value.requires_grad):
        return flex.flex_attention(query, key, value, block_mask=block_mask, **kwargs)
    validate = getattr(flex, "_validate_device", None)
    if validate is None:  # a torch without the check: nothing to lift
        return flex.flex_attention(query, key, value, block_mask=block_mask, **kwargs)
    with _FLEX_CHECK_LOCK, warnings.catch_warnings():
        # Its advice to torch.compile does not apply: compiled FlexAttention has no CPU backward.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        flex._validate_device = _cpu_backward_allowed(validate)
        try:
            return flex.flex_attention(query, key, value, block_mask=block_mask, **kwargs)
        finally:
            flex._validate_device = validate


def _cpu_backward_allowed(validate):
    def check(query, key, value):
        if query.device.type != "cpu":
            validate(query, key, value)
    return check


_FLEX_CHECK_LOCK = threading.Lock()


def to_flex_layout(x):
    """[total_tokens, heads, head_dim] (varlen) as FlexAttention's [1, heads, tokens, head_dim]
    (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def from_flex_layout(y):
    """FlexAttention's [1, heads, tokens, head_dim] output back as [tokens, heads, head_dim]."""
    return y.squeeze(0).transpose(0, 1)


# What FlexAttention runs: CPU and CUDA (the others lack backward or are untested here); float64
# only on the CPU (its CUDA kernels are Triton fp16/bf16/fp32).
_FLEX_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def _mask_device(device, dtype):
    device = torch.device("cpu" if device is None else device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device} cannot serve a FlexAttention block mask here (cpu or "
                         "cuda)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device}, but torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device}, but torch sees {torch.cuda.device_count()} "
                             "CUDA devices")
    if dtype is not None:
        if dtype not in _FLEX_DTYPES:
            raise ValueError(f"dtype: {dtype} is not one FlexAttention computes in "
                             "(float16, bfloat16, float32, float64)")
        if dtype == torch.float64 and device.type == "cuda":
            raise ValueError("dtype: torch.float64 on CUDA is not supported by FlexAttention's "
                             "kernels (use float32, bfloat16 or float16)")
    return device


def _causal_pairs(q0, q1, k0, k1):
    """Pairs (q, kv) with q in [q0, q1), kv in [k0, k1) and kv <= q (int64 tensors)."""
    width = (k1 - k0).clamp(min=0)

    def prefix(n):  # sum over x = 1..n of clamp(x, 0, width)
        n = n.clamp(min=0)
        inside = torch.minimum(n, width)
        return inside * (inside + 1) // 2 + (n - inside) * width

    pairs = prefix(q1 - k0) - prefix(q0 - k0)
    return torch.where(q1 > q0, pairs, torch.zeros_like(pairs))


def _ordered(blocks):
    """FlexAttention's CSR of a bool [1, H, rows, cols] block set: counts and column indices."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, indices.to(torch.int32)


def flex_block_mask(selection, cu_seqlens=None, *, device="cpu", dtype=None,
                    flex_block_size=128):
    """A FlexAttention BlockMask that keeps exactly a Selection's blocks.

    The mask is over the packed sequence: B = 1, H = the selection's heads (per-head
    selections), Q_LEN = KV_LEN = total tokens, for q, k, v in FlexAttention's layout
    (``to_flex_layout``). Query token q attends to key token kv when both are in the same
    document, kv <= q, and the key's document-relative block is kept for the query's
    document-relative block and head. Blocks the mask need not evaluate (entirely kept) are
    FlexAttention's full blocks; the others carry the exact mask_mod.

    Args:
      selection: a Selection (``select_blocks`` or ``sparse_attention(...,
        return_selection=True)``).
      cu_seqlens: if given, checked to be the selection's (a mask for another batch is an error).
      device, dtype: where FlexAttention will run and in which dtype q, k, v are (checked).
      flex_block_size: the BlockMask's own block size (FlexAttention's default 128); any
        positive value gives the same mask.

    Memory: O(heads * (tokens / flex_block_size)^2) like any BlockMask, plus the kept table.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(selection, _C.Selection):
        raise TypeError(f"selection: a sparsebalance Selection is needed, got "
                        f"{type(selection).__name__}")
    device = _mask_device(device, dtype)
    if not isinstance(flex_block_size, int) or flex_block_size < 1:
        raise ValueError(f"flex_block_size: {flex_block_size!r} is not a positive integer")
    cu = torch.from_numpy(selection.cu_seqlens).to(torch.int64)
    if cu_seqlens is not None:
        given = _as_list(cu_seqlens, "cu_seqlens", int)
        if given != cu.tolist():
            raise ValueError(f"cu_seqlens: {given[:4]}... ({len(given) - 1} sequences, "
                             f"{given[-1] if given else 0} tokens) does not match the "
                             f"selection's {cu.tolist()[:4]}... ({selection.sequences} "
                             f"sequences, {selection.total_tokens} tokens)")
    heads, block, tokens = selection.heads, selection.block_size, selection.total_tokens
    if tokens == 0:
        raise ValueError("selection: it holds no tokens")
    sequences = selection.sequences
    lengths = cu[1:] - cu[:-1]
    blocks = torch.from_numpy(selection.cu_blocks).to(torch.int64).diff()
    row_ptr = torch.from_numpy(selection.row_ptr)
    col = torch.from_numpy(selection.col_idx).to(torch.int64)

    # Every CSR row is (sequence, head, query block), rows ordered as Selection.row_id.
    seq_of_row = torch.repeat_interleave(torch.arange(sequences), blocks * heads)
    within = torch.arange(int(row_ptr.numel()) - 1) - (
        torch.from_numpy(selection.cu_blocks).to(torch.int64)[seq_of_row] * heads)
    head_of_row = within // blocks[seq_of_row]
    block_of_row = within % blocks[seq_of_row]
    row_of_entry = torch.repeat_interleave(torch.arange(seq_of_row.numel()), row_ptr.diff())
    s, h, i, j = seq_of_row[row_of_entry], head_of_row[row_of_entry], block_of_row[row_of_entry], col

    # The kept table: per (sequence, head) the causal triangle of block pairs, i(i+1)/2 + j.
    triangle = blocks * (blocks + 1) // 2
    triangle_base = torch.cat([torch.zeros(1, dtype=torch.int64),
                               torch.cumsum(triangle * heads, 0)[:-1]])
    kept = torch.zeros(int((triangle * heads).sum()), dtype=torch.bool)
    kept[triangle_base[s] + h * triangle[s] + i * (i + 1) // 2 + j] = True

    # Allowed (query, key) pairs per FlexAttention block: a flex block is in the mask when it
    # holds one, and full when all its pairs are (kept blocks of one document, all causal).
    f = flex_block_size
    n_blocks = (tokens + f - 1) // f
    start = cu[s]
    q_lo, q_hi = start + i * block, start + torch.minimum((i + 1) * block, lengths[s])
    k_lo, k_hi = start + j * block, start + torch.minimum((j + 1) * block, lengths[s])
    counts = torch.zeros(heads * n_blocks * n_blocks, dtype=torch.int64)
    span = (block - 1) // f + 2  # flex blocks one of our blocks can touch
    for a in range(span):
        qb = q_lo // f + a
        for c in range(span):
            kb = k_lo // f + c
            touched = (qb * f < q_hi) & (kb * f < k_hi)
            pairs = _causal_pairs(torch.maximum(q_lo, qb * f), torch.minimum(q_hi, (qb + 1) * f),
                                  torch.maximum(k_lo, kb * f), torch.minimum(k_hi, (kb + 1) * f))
            use = touched & (pairs > 0)
            counts.index_add_(0, ((h * n_blocks + qb) * n_blocks + kb)[use], pairs[use])
    counts = counts.view(1, heads, n_blocks, n_blocks)
    # A block cut by the end of the sequence is never full (its padding is masked), as in
    # create_block_mask.
    full = counts == f * f
    partial = (counts > 0) & ~full
    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)

    doc_of_token = torch.repeat_interleave(torch.arange(sequences), lengths).to(device)
    doc_start, block_base = cu[:-1].to(device), triangle_base.to(device)
    doc_triangle, kept = triangle.to(device), kept.to(device)

    def mask_mod(b, head, q_idx, kv_idx):
        doc = doc_of_token[q_idx]
        visible = (doc_of_token[kv_idx] == doc) & (kv_idx <= q_idx)
        first = doc_start[doc]
        qi = (q_idx - first) // block
        kj = torch.where(visible, (kv_idx - first) // block, 0)
        return visible & kept[block_base[doc] + head * doc_triangle[doc] + qi * (qi + 1) // 2 + kj]

    return BlockMask.from_kv_blocks(
        kv_num_blocks.to(device), kv_indices.to(device), full_kv_num_blocks.to(device),
        full_kv_indices.to(device), BLOCK_SIZE=f, mask_mod=mask_mod, seq_lengths=(tokens, tokens))


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu {model} ({torch.get_num_threads()} threads)"


class _Clock:
    """Seconds of a region: CUDA events on a GPU (the stream's time), perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return time.perf_counter() - start


def _check_grid(lengths, densities, shape, repeats):
    lengths, densities = list(lengths), list(densities)
    if not lengths or not densities:
        raise ValueError("lengths, densities: the grid needs at least one of each")
    for n, length in enumerate(lengths):
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"lengths[{n}]: {length!r} is not a positive integer")
    for n, density in enumerate(densities):
        _check_density(density, f"densities[{n}]")
    for field in ("heads", "head_dim"):
        if getattr(shape, field) < 1:
            raise ValueError(f"shape.{field}: {getattr(shape, field)} is not positive")
    if shape.block_size not in (64, 128):
        raise ValueError(f"shape.block_size: {shape.block_size} is not 64 or 128")
    if shape.local_blocks < 0:
        raise ValueError(f"shape.local_blocks: {shape.local_blocks} is negative")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: {repeats!r} is not a positive integer")
    return lengths, densities


def _time_backward(clock, forward, inputs, grad_seed):
    """Seconds of forward(*inputs) and its backward with a fixed random output gradient."""
    for x in inputs:
        x.grad = None
    start = clock.start()
    out = forward(*inputs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the callable returned {type(out).__name__}; a tensor is needed")
    generator = torch.Generator(device=out.device).manual_seed(grad_seed)
    grad = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
    out.backward(grad)
    return clock.seconds(start)


def profile(attention, lengths, densities, shape, linear=None, *, repeats=3, warmup=1,
            device="cpu", dtype=torch.float32, seed=0, note=None):
    """Times the trainer's own attention (and linear) callable over lengths x densities and
    returns the profile table text (contract/profile_format.h) for
    ``PlannerClient.upload_profile``.

    Args:
      attention: ``attention(q, k, v, plan) -> out``: q, k, v are [length, heads, head_dim]
        tensors (requires_grad) of one document, plan its KernelPlan (cu_seqlens, densities,
        topk); out like q. Whatever it does (block selection, a BlockMask) is timed with it.
      lengths: document lengths (tokens) to measure; densities: each in (0, 1].
      shape: a ModelShape (heads, head_dim, block_size, local_blocks; layers unused).
      linear: optional ``linear(x) -> y`` of the layer's GEMMs on x [length, heads * head_dim]
        (requires_grad), timed forward+backward and added to each row.
      repeats: measurements per grid point (the median is written); warmup: untimed runs
        before each point (compilation, caches).
      device, dtype: where and in which dtype the inputs are made; CUDA times are CUDA events
        on the current stream, CPU times are time.perf_counter.
      seed: of the random inputs; note: a comment line for the table (default: how measured).

    Returns the table text; every row is one layer's forward+backward of one document.
    """
    if not callable(attention):
        raise TypeError(f"attention: a callable is needed, got {type(attention).__name__}")
    if linear is not None and not callable(linear):
        raise TypeError(f"linear: a callable or None is needed, got {type(linear).__name__}")
    lengths, densities = _check_grid(lengths, densities, shape, repeats)
    device = torch.device(device)
    clock = _Clock(device)
    generator = torch.Generator().manual_seed(seed)
    table = _C.ProfileTable(device=_device_name(device),
                            shape=_C.ModelShape(layers=1, heads=shape.heads,
                                                head_dim=shape.head_dim,
                                                block_size=shape.block_size,
                                                local_blocks=shape.local_blocks))
    rows, breakdown = [], []
    width = shape.heads * shape.head_dim
    for length in lengths:
        qkv = [torch.randn((length, shape.heads, shape.head_dim), generator=generator)
               .to(device=device, dtype=dtype).requires_grad_() for _ in range(3)]
        x = torch.randn((length, width), generator=generator).to(device=device, dtype=dtype)
        x.requires_grad_()
        linear_seconds = 0.0
        if linear is not None:
            for _ in range(warmup):
                _time_backward(clock, linear, [x], seed)
            linear_seconds = statistics.median(
                _time_backward(clock, linear, [x], seed) for _ in range(repeats))
        for density in densities:
            sample = _C.PlannedSample(id=0, length=length, density=float(density))
            plan = kernel_plan([sample], shape.block_size, shape.local_blocks, device=device)

            def run(q, k, v, plan=plan):
                out = attention(q, k, v, plan)
                if isinstance(out, torch.Tensor) and out.shape != q.shape:
                    raise ValueError(f"attention: returned shape {tuple(out.shape)} for q of "
                                     f"shape {tuple(q.shape)}")
                return out

            for _ in range(warmup):
                _time_backward(clock, run, qkv, seed)
            attention_seconds = statistics.median(
                _time_backward(clock, run, qkv, seed) for _ in range(repeats))
            rows.append(_C.ProfileRow(length=length, density=float(density),
                                      seconds=attention_seconds + linear_seconds))
            breakdown.append(_C.ProfileBreakdown(
                attention_seconds=attention_seconds, linear_seconds=linear_seconds,
                active_blocks=shape.heads * int(plan.active_blocks().sum())))
    table.rows = rows
    table.breakdown = breakdown
    name = getattr(attention, "__qualname__", type(attention).__name__)
    table.note = note if note is not None else (
        f"sparsebalance.attention.profile of {name}"
        f"{' + linear' if linear is not None else ' (attention only)'}, {dtype}, median of "
        f"{repeats} after {warmup} warm-up")
    return _C.format_profile_table(table)
