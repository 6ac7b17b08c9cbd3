"""sparsebalance.attention: the plan in a trainer's kernel's terms (varlen layout and top-k
budgets, a FlexAttention BlockMask from a block selection) and the profile of a trainer's own
attention, against our kernels, the dense reference, FlexAttention and a real sb-planner.

Tolerances: our CPU kernels and FlexAttention (run in float32 here) both compute in fp32, the
reference in float64. With O(1) inputs, head_dim 64 and at most 700 keys per query, fp32 rounding
leaves errors of at most ~1e-5 in the output and in dq, dk, dv (measured: 7e-7 and 7e-6); 1e-4
keeps a margin above that, while one wrongly kept or dropped block changes values by ~1e-1.
FlexAttention in float64 against the float64 reference differs by float64 rounding alone
(measured 4e-15): 1e-12.
"""

import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import sparsebalance as sb  # noqa: E402
from sparsebalance import _C  # noqa: E402
from sparsebalance.attention import (  # noqa: E402
    flex_block_mask, from_flex_layout, kernel_plan, measure_recall, profile, select_blocks,
    to_flex_layout)
from sparsebalance.ops import dense_mask, reference_attention, sparse_attention  # noqa: E402

FP32_TOL = 1e-4
FP64_TOL = 1e-12

# Documents of lengths that are not multiples of 64 or 128 (one of a single token), one pre-packed
# sample, densities from 1.0 down to small ones.
SAMPLES = [
    sb.PlannedSample(id=10, length=700, density=0.15),
    sb.PlannedSample(id=11, length=1, density=1.0),
    sb.PlannedSample(id=12, length=523, density=0.3, segments=[190, 333]),
    sb.PlannedSample(id=13, length=77, density=0.05),
]
HEADS, HEAD_DIM = 2, 64


@pytest.fixture
def flex_attention():
    """sparsebalance.attention.flex_attention: torch's, differentiable on the CPU."""
    from sparsebalance.attention import flex_attention as flex_with_cpu_backward

    return flex_with_cpu_backward


def qkv(tokens, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((tokens, HEADS, HEAD_DIM), generator=g, dtype=torch.float64).to(dtype)
            .requires_grad_() for _ in range(3)]


def forward_backward(fn, inputs, grad):
    for x in inputs:
        x.grad = None
    out = fn(*inputs)
    out.backward(grad)
    return [out.detach()] + [x.grad.detach().clone() for x in inputs]


def test_kernel_plan_is_the_varlen_layout_with_the_planners_budgets():
    kp = kernel_plan(sb.MicroBatchPlan(samples=SAMPLES), block_size=64, local_blocks=1)
    assert kp.cu_seqlens.dtype == torch.int32
    assert kp.cu_seqlens.tolist() == [0, 700, 701, 891, 1224, 1301]
    assert kp.max_seqlen == 700 and kp.documents == 5
    assert kp.sample_ids == (10, 11, 12, 12, 13)
    assert kp.densities.tolist() == [0.15, 1.0, 0.3, 0.3, 0.05]
    assert kp.query_blocks.tolist() == [11, 1, 3, 6, 2]
    assert kp.kept.shape == (5, 11)
    for doc, (length, density) in enumerate([(700, 0.15), (1, 1.0), (190, 0.3), (333, 0.3),
                                             (77, 0.05)]):
        q = _C.quantize_density(density)
        topk = kp.topk(doc)
        assert topk.tolist() == [_C.kept_blocks(i, q, 1) for i in range(len(topk))]
        assert kp.kept[doc, len(topk):].eq(0).all()
        assert int(kp.active_blocks()[doc]) == _C.active_blocks(length, density, 64, 1)
    # The rule itself, written out for the 700-token document at 0.15 (quantized 9830/65536):
    # k_i = clamp(ceil(q (i+1) / 65536), min(i+1, 3), i+1).
    assert kp.topk(0).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    assert kp.topk(3).tolist() == [1, 2, 3, 3, 3, 3]  # ceil(0.3 * 6) = 2 < 3 anchors
    wide = kernel_plan(SAMPLES, block_size=128, local_blocks=0)
    assert wide.query_blocks.tolist() == [6, 1, 2, 3, 1]
    assert wide.topk(0).tolist() == [1, 2, 2, 2, 2, 2]


def test_kernel_plan_budgets_are_the_kept_counts_of_a_real_selection():
    for block_size in (64, 128):
        kp = kernel_plan(SAMPLES, block_size=block_size)
        q, k, _ = qkv(int(kp.cu_seqlens[-1]))
        selection = select_blocks(q, k, kp.cu_seqlens, kp.densities, block_size)
        per_row = selection.row_ptr[1:] - selection.row_ptr[:-1]
        for doc in range(kp.documents):
            for head in range(HEADS):
                rows = [selection.row_id(doc, head, i) for i in range(int(kp.query_blocks[doc]))]
                assert per_row[rows].tolist() == kp.topk(doc).tolist(), (block_size, doc, head)
        assert int(kp.active_blocks().sum()) * HEADS == selection.active_blocks


def test_kernel_plan_layer_densities_and_errors():
    layered = sb.PlannedSample(id=1, length=640, density=0.5, layer_densities=[1.0, 0.1])
    assert kernel_plan([layered], layer=1).densities.tolist() == [0.1]
    assert kernel_plan([layered]).densities.tolist() == [0.5]
    with pytest.raises(ValueError, match=r"layer: 2 is not in \[0, 2\)"):
        kernel_plan([layered], layer=2)
    with pytest.raises(ValueError, match=r"samples\[1\]\.density: 1\.5 is not in \(0, 1\]"):
        kernel_plan([SAMPLES[0], sb.PlannedSample(id=2, length=10, density=1.5)])
    with pytest.raises(ValueError, match="block_size"):
        kernel_plan(SAMPLES, block_size=0)
    with pytest.raises(TypeError, match="plan"):
        kernel_plan(3)


def test_select_blocks_is_the_selection_sparse_attention_runs():
    kp = kernel_plan(SAMPLES)
    q, k, v = qkv(int(kp.cu_seqlens[-1]))
    _, _, ours = sparse_attention(q, k, v, kp.cu_seqlens, kp.densities, return_selection=True)
    alone = select_blocks(q, k, kp.cu_seqlens, kp.densities)
    assert alone.row_ptr.tolist() == ours.row_ptr.tolist()
    assert alone.col_idx.tolist() == ours.col_idx.tolist()


def token_mask(selection):
    """[heads, tokens, tokens] bool: the selection's mask over the packed sequence."""
    cu = selection.cu_seqlens.tolist()
    mask = torch.zeros((selection.heads, cu[-1], cu[-1]), dtype=torch.bool)
    for s in range(len(cu) - 1):
        for h in range(selection.heads):
            mask[h, cu[s]:cu[s + 1], cu[s]:cu[s + 1]] = dense_mask(selection, s, h)
    return mask


def blocks_of(num_blocks, indices):
    """A BlockMask's CSR part as a dense bool [B, H, rows, cols]."""
    dense = torch.zeros(indices.shape, dtype=torch.bool)
    for index in torch.nonzero(torch.ones(num_blocks.shape)).tolist():
        dense[tuple(index)][indices[tuple(index)][:num_blocks[tuple(index)]].long()] = True
    return dense


@pytest.mark.parametrize("block_size", [64, 128])
def test_block_mask_is_exact_and_has_flexs_own_block_structure(block_size):
    kp = kernel_plan(SAMPLES, block_size=block_size)
    tokens = int(kp.cu_seqlens[-1])
    q, k, _ = qkv(tokens)
    selection = select_blocks(q, k, kp.cu_seqlens, kp.densities, block_size)
    expected = token_mask(selection)
    positions = torch.arange(tokens)
    for flex_block in (64, 128, 100):
        mask = flex_block_mask(selection, kp.cu_seqlens, flex_block_size=flex_block)
        assert mask.shape == (1, HEADS, tokens, tokens)
        # The mask_mod at every (head, query, key) is the selection's token mask.
        mask_mod = mask.mask_mod
        over_keys = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
        over_queries = torch.vmap(over_keys, in_dims=(None, None, 0, None))
        over_heads = torch.vmap(over_queries, in_dims=(None, 0, None, None))
        got = over_heads(torch.tensor(0), torch.arange(HEADS), positions, positions)
        assert torch.equal(got, expected), flex_block
        # Partial and full blocks are the ones FlexAttention's create_block_mask finds by
        # evaluating that mask_mod everywhere.
        reference = flex.create_block_mask(mask_mod, 1, HEADS, tokens, tokens, device="cpu",
                                           BLOCK_SIZE=flex_block)
        for num, idx in (("kv_num_blocks", "kv_indices"),
                         ("full_kv_num_blocks", "full_kv_indices")):
            assert torch.equal(getattr(mask, num), getattr(reference, num)), (flex_block, num)
            assert torch.equal(blocks_of(getattr(mask, num), getattr(mask, idx)),
                               blocks_of(getattr(reference, num), getattr(reference, idx)))
        assert mask.full_kv_num_blocks.sum() > 0 or flex_block > 64


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("block_size", [64, 128])
def test_flex_attention_on_the_mask_matches_our_op_and_the_reference(flex_attention, block_size):
    kp = kernel_plan(SAMPLES, block_size=block_size)
    tokens = int(kp.cu_seqlens[-1])
    inputs32 = qkv(tokens, torch.float32)
    inputs64 = qkv(tokens, torch.float64)
    grad = torch.randn((tokens, HEADS, HEAD_DIM), generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)
    state = {}

    def ours(q, k, v):
        out, _, state["selection"] = sparse_attention(q, k, v, kp.cu_seqlens, kp.densities,
                                                      block_size, return_selection=True)
        return out

    ours_result = forward_backward(ours, inputs32, grad.float())
    selection = state["selection"]
    # Blocks were dropped (below, the output differs from dense attention), as planned.
    assert selection.active_blocks < sum(n * (n + 1) // 2 for n in kp.query_blocks.tolist()) * HEADS
    assert selection.active_blocks == int(kp.active_blocks().sum()) * HEADS

    def reference(q, k, v):
        return reference_attention(q, k, v, kp.cu_seqlens, selection)

    truth = forward_backward(reference, inputs64, grad)
    dense = reference_attention(*[x.detach() for x in inputs64], kp.cu_seqlens)
    assert (dense - truth[0]).abs().max() > 100 * FP32_TOL  # sparsity changed the output

    def with_flex(dtype):
        mask = flex_block_mask(selection, kp.cu_seqlens, dtype=dtype)

        def run(q, k, v):
            out = flex_attention(to_flex_layout(q), to_flex_layout(k), to_flex_layout(v),
                                 block_mask=mask)
            return from_flex_layout(out)
        return run

    flex32 = forward_backward(with_flex(torch.float32), inputs32, grad.float())
    flex64 = forward_backward(with_flex(torch.float64), inputs64, grad)
    for name, a, b, c, d in zip(["out", "dq", "dk", "dv"], flex32, ours_result, truth, flex64):
        assert (a.double() - c).abs().max() < FP32_TOL, f"flex fp32 vs reference: {name}"
        assert (b.double() - c).abs().max() < FP32_TOL, f"ours vs reference: {name}"
        assert (a - b).abs().max() < FP32_TOL, f"flex fp32 vs ours: {name}"
        assert (d - c).abs().max() < FP64_TOL, f"flex fp64 vs reference: {name}"


def test_block_mask_rejects_what_it_cannot_serve():
    kp = kernel_plan(SAMPLES)
    q, k, _ = qkv(int(kp.cu_seqlens[-1]))
    selection = select_blocks(q, k, kp.cu_seqlens, kp.densities)
    other = kernel_plan(SAMPLES[:2]).cu_seqlens
    with pytest.raises(ValueError, match="cu_seqlens: .* does not match the selection"):
        flex_block_mask(selection, other)
    with pytest.raises(ValueError, match="device: meta"):
        flex_block_mask(selection, device="meta")
    with pytest.raises(ValueError, match="dtype: torch.int32"):
        flex_block_mask(selection, dtype=torch.int32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: cuda.*no CUDA device"):
            flex_block_mask(selection, device="cuda")
    else:
        with pytest.raises(ValueError, match="dtype: torch.float64 on CUDA"):
            flex_block_mask(selection, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match="flex_block_size"):
        flex_block_mask(selection, flex_block_size=0)
    with pytest.raises(TypeError, match="selection"):
        flex_block_mask(kp)


def our_attention(q, k, v, plan):
    """A trainer's attention callable as profile() calls it: our op at the plan's densities."""
    out, _ = sparse_attention(q, k, v, plan.cu_seqlens, plan.densities, plan.block_size,
                              plan.local_blocks, threads=1)
    return out


def test_profile_of_a_trainers_attention_parses_and_uploads(planner):
    shape = sb.ModelShape(heads=HEADS, head_dim=HEAD_DIM, block_size=64, local_blocks=1)
    linear = torch.nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM)
    lengths, densities = [128, 512, 1024], [1.0, 0.3]
    text = profile(our_attention, lengths, densities, shape, linear=linear, repeats=1)
    table = _C.parse_profile_table(text)
    assert [(r.length, r.density) for r in table.rows] == [
        (n, d) for n in lengths for d in densities]
    assert table.shape.heads == HEADS and table.shape.head_dim == HEAD_DIM
    assert table.device.startswith("cpu")
    assert all(r.seconds > 0 for r in table.rows)
    # The breakdown counts the work each row timed: 1024 tokens keep more blocks than 128 at
    # every density. (Not the seconds: a test never compares wall-clock times, and one repeat of
    # a 25 ms call on a loaded machine can come out either way.)
    blocks = {(int(f[1]), float(f[2])): int(f[5]) for f in
              (line.split() for line in text.splitlines()) if len(f) == 6 and f[0] == "#"
              and f[1].isdigit()}
    for density in densities:
        assert blocks[(1024, density)] > blocks[(128, density)] > 0
    again = _C.format_profile_table(table)
    assert _C.parse_profile_table(again) == table
    # The breakdown comments carry the kept blocks over all heads.
    assert f"#   1024 0.3 " in text
    assert text.splitlines()[-1].endswith(
        str(HEADS * _C.active_blocks(1024, 0.3, 64, 1)))

    # The upload goes through the planner's fit, which refuses times that do not grow with the
    # kept blocks. One repeat of each row timed on a loaded machine can come out that way, so
    # the upload carries the measured table's rows with times of a known cost instead: 2 us a
    # kept block over all heads and 10 ns a token, well apart for every grid point.
    for row in table.rows:
        kept = HEADS * _C.active_blocks(row.length, row.density, 64, 1)
        row.seconds = 2e-6 * kept + 1e-8 * row.length
    client = sb.PlannerClient(sb.ClientOptions(target=planner.address))
    client.create_job("profile-test", sb.PlannerConfig(ranks=1, micro_batches=1,
                                                      micro_batch_capacity=4096, shape=shape))
    assert client.upload_profile(_C.format_profile_table(table)) == table.device


def test_profile_rejects_a_bad_grid():
    shape = sb.ModelShape(heads=1, head_dim=64)
    with pytest.raises(ValueError, match=r"lengths\[1\]: 0 is not a positive integer"):
        profile(our_attention, [64, 0], [1.0], shape)
    with pytest.raises(ValueError, match=r"densities\[0\]: 0.0 is not in \(0, 1\]"):
        profile(our_attention, [64], [0.0], shape)
    with pytest.raises(ValueError, match="shape.block_size: 32"):
        profile(our_attention, [64], [1.0], sb.ModelShape(heads=1, head_dim=64, block_size=32))
    with pytest.raises(ValueError, match="attention: returned shape"):
        profile(lambda q, k, v, plan: q[:1], [64], [1.0], shape)
    with pytest.raises(TypeError, match="attention"):
        profile(None, [64], [1.0], shape)


def test_the_cpu_backward_is_lifted_for_the_call_only():
    # Our flex_attention differentiates on the CPU; torch's own still refuses afterwards (the
    # check is restored, nothing leaks into other code of the process).
    from sparsebalance.attention import flex_attention

    leaves = qkv(130)
    q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in leaves)
    flex_attention(q, k, v).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex.flex_attention(q, k, v)


def test_a_kernel_plans_block_mask_is_the_selections():
    plan = [sb.PlannedSample(id=1, length=300, density=0.3),
            sb.PlannedSample(id=2, length=200, density=1.0)]
    kp = kernel_plan(plan, block_size=64)
    q, k, _ = qkv(500)
    mask = kp.block_mask(q, k)
    expected = flex_block_mask(select_blocks(q, k, [0, 300, 500], [0.3, 1.0]), [0, 300, 500])
    assert torch.equal(mask.to_dense(), expected.to_dense())
    assert mask.shape[-2:] == (500, 500)


# Anchor-guided thresholding (selection="anchor"): q, k with a shared direction and a strength
# per key block, so that pooled block scores are about the strength: uniform in [-4, 4) nats,
# and 6 for the first 64 tokens (the first document's sink block), so that every threshold tau
# in [0.05, 0.9] (ln tau >= -3) drops some of top-k's blocks, and a vanishing one none.
def anchor_qkv(tokens, block_size=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn((1, HEADS, HEAD_DIM), generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    q = 0.5 * torch.randn((tokens, HEADS, HEAD_DIM), generator=g) + 8.0 * direction
    strength = 8.0 * torch.rand((tokens + block_size - 1) // block_size, generator=g) - 4.0
    strength[0] = 6.0
    per_token = strength.repeat_interleave(block_size)[:tokens, None, None]
    k = 0.5 * torch.randn((tokens, HEADS, HEAD_DIM), generator=g) + per_token * direction
    return q, k


ANCHOR_CU = [0, 1500, 1501, 2200, 2277]
ANCHOR_DENSITIES = [0.3, 1.0, 0.5, 0.1]


def kept_rows(selection):
    row_ptr, col_idx = selection.row_ptr, selection.col_idx
    return [set(col_idx[row_ptr[r]:row_ptr[r + 1]].tolist()) for r in range(selection.rows)]


def rows_with_geometry(selection, densities, local_blocks=1):
    """(row id, query block i, budget k_i) of every row."""
    cu_blocks = selection.cu_blocks.tolist()
    for s, density in enumerate(densities):
        blocks = cu_blocks[s + 1] - cu_blocks[s]
        budget = _C.kept_blocks_per_row(blocks * selection.block_size, density,
                                        selection.block_size, local_blocks)
        for h in range(selection.heads):
            for i in range(blocks):
                yield selection.row_id(s, h, i), i, int(budget[i])


def test_anchor_with_a_vanishing_threshold_is_topk():
    q, k = anchor_qkv(ANCHOR_CU[-1])
    topk = select_blocks(q, k, ANCHOR_CU, ANCHOR_DENSITIES, selection="topk")
    anchor = select_blocks(q, k, ANCHOR_CU, ANCHOR_DENSITIES, selection="anchor",
                           anchor_threshold=1e-30)
    assert anchor.row_ptr.tolist() == topk.row_ptr.tolist()
    assert anchor.col_idx.tolist() == topk.col_idx.tolist()
    # The default tau (0.05) does drop blocks on these inputs: the comparison above is not moot.
    assert select_blocks(q, k, ANCHOR_CU, ANCHOR_DENSITIES, selection="anchor").active_blocks < \
        topk.active_blocks


def test_anchor_rows_are_nested_subsets_of_topk_within_the_budget():
    q, k = anchor_qkv(ANCHOR_CU[-1])
    topk = select_blocks(q, k, ANCHOR_CU, ANCHOR_DENSITIES)
    top_rows = kept_rows(topk)
    previous = top_rows
    for tau in (0.05, 0.3, 0.9):
        anchor = select_blocks(q, k, ANCHOR_CU, ANCHOR_DENSITIES, selection="anchor",
                               anchor_threshold=tau)
        rows = kept_rows(anchor)
        dropped = 0
        for row, i, budget in rows_with_geometry(anchor, ANCHOR_DENSITIES):
            anchors = {0} | set(range(max(1, i - 1), i + 1))
            assert anchors <= rows[row] <= top_rows[row], (tau, row)
            assert len(rows[row]) <= budget
            if budget == i + 1:  # a budget covering every causal block stays dense
                assert rows[row] == set(range(i + 1))
            # Higher tau keeps a prefix of the same score order: a subset of lower tau's row.
            assert rows[row] <= previous[row], (tau, row)
            dropped += len(top_rows[row]) - len(rows[row])
        assert dropped > 0, tau
        previous = rows


def test_kernel_plan_carries_the_selection_mode():
    plan = [sb.PlannedSample(id=1, length=1500, density=0.3),
            sb.PlannedSample(id=2, length=777, density=0.5)]
    q, k = anchor_qkv(2277)
    kp = kernel_plan(plan, selection="anchor", anchor_threshold=0.3)
    assert (kp.selection_mode, kp.anchor_threshold) == ("anchor", 0.3)
    expected = select_blocks(q, k, [0, 1500, 2277], [0.3, 0.5], selection="anchor",
                             anchor_threshold=0.3)
    got = kp.select(q, k)
    assert got.col_idx.tolist() == expected.col_idx.tolist()
    assert got.active_blocks < kernel_plan(plan).select(q, k).active_blocks
    # measure_recall selects with the plan's mode when not given the selection.
    assert torch.equal(measure_recall(q, k, kp, 16).recall,
                       measure_recall(q, k, kp, 16, selection=expected).recall)
    assert kernel_plan(plan, selection=sb.SelectionMode.ANCHOR).selection_mode == "anchor"
    # sparse_attention runs the same selection.
    _, _, selection = sparse_attention(q, k, k, [0, 1500, 2277], [0.3, 0.5], selection="anchor",
                                       anchor_threshold=0.3, return_selection=True)
    assert selection.col_idx.tolist() == expected.col_idx.tolist()


@pytest.mark.parametrize("tau", [0.0, -0.1, 1.5, float("nan")])
def test_bad_anchor_threshold_raises_naming_it(tau):
    q, k = anchor_qkv(200)
    calls = [
        lambda: select_blocks(q, k, [0, 200], [0.3], selection="anchor", anchor_threshold=tau),
        lambda: _C.select_blocks([0, 200], HEADS, HEAD_DIM, q.numpy(), k.numpy(), [0.3],
                                 selection="anchor", anchor_threshold=tau),
        lambda: sparse_attention(q, k, k, [0, 200], [0.3], anchor_threshold=tau),
        lambda: kernel_plan([sb.PlannedSample(id=1, length=200, density=0.3)],
                            anchor_threshold=tau),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="anchor_threshold"):
            call()
    with pytest.raises(sb.PlannerError, match="anchor_threshold"):
        sb.PlannerConfig(anchor_threshold=tau).validate()


def test_bad_selection_mode_raises_naming_it():
    q, k = anchor_qkv(200)
    for mode in ("top-k", "", 3):
        with pytest.raises(ValueError, match="selection"):
            select_blocks(q, k, [0, 200], [0.3], selection=mode)
        with pytest.raises(ValueError, match="selection"):
            _C.select_blocks([0, 200], HEADS, HEAD_DIM, q.numpy(), k.numpy(), [0.3],
                             selection=mode)
        with pytest.raises(ValueError, match="selection"):
            sparse_attention(q, k, k, [0, 200], [0.3], selection=mode)
    config = sb.PlannerConfig(selection="anchor", anchor_threshold=0.2)
    assert (config.selection, config.selection.label) == (sb.SelectionMode.ANCHOR, "anchor")
