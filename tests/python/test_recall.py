"""Measured recall from Python: the binding's DocumentRecallMeasurement, MicroBatchTiming's
documents and recall_seconds and the planner's length buckets; sparsebalance.attention's
measure_recall against a brute-force softmax; and sparsebalance.torch.Balancer measuring it
through mb.attention.block_mask and handing it to the C++ report."""

import pickle

import pytest

torch = pytest.importorskip("torch")

import sparsebalance as sb  # noqa: E402
import sparsebalance.torch as sbt  # noqa: E402
from sparsebalance import _C  # noqa: E402
from sparsebalance.attention import kernel_plan, measure_recall, recall_rows  # noqa: E402


# -- the binding --------------------------------------------------------------------------------

def test_document_recall_reaches_the_cpp_timing_and_back():
    doc = _C.DocumentRecallMeasurement(sample_id=7, document=2, recall=0.75,
                                       layer_recall=[0.5, 1.0], rows=8)
    timing = _C.MicroBatchTiming(micro_batch=1, compute_seconds=0.5, tokens=100,
                                 documents=[doc], recall_seconds=0.01)
    # The fields live in the C++ struct: read back through it, copied, pickled.
    assert timing.documents == [doc] and timing.recall_seconds == 0.01
    (back,) = timing.documents
    assert (back.sample_id, back.document, back.recall, back.layer_recall, back.rows) == \
        (7, 2, 0.75, [0.5, 1.0], 8)
    assert pickle.loads(pickle.dumps(timing)) == timing
    other = _C.MicroBatchTiming(micro_batch=1, compute_seconds=0.5, tokens=100,
                                documents=[_C.DocumentRecallMeasurement(sample_id=7, document=2,
                                                                        recall=0.5, rows=8)],
                                recall_seconds=0.01)
    assert other != timing
    assert _C.MicroBatchTiming().documents == [] and _C.MicroBatchTiming().recall_seconds == 0.0


def test_recall_buckets_are_the_planners():
    capacity = 131072
    assert _C.RECALL_BUCKETS == 4
    assert [_C.recall_bucket(n, capacity) for n in (1, 2047, 2048, 8191, 8192, 32767, 32768,
                                                      capacity)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [_C.recall_bucket_label(b, capacity) for b in range(4)] == \
        ["<2K", "2K-8K", "8K-32K", "32K+"]
    assert [_C.recall_bucket_range(b, capacity) for b in range(4)] == \
        [(1, 2047), (2048, 8191), (8192, 32767), (32768, capacity)]
    # Ranges and buckets agree at a small capacity too.
    for b in range(4):
        lo, hi = _C.recall_bucket_range(b, 4096)
        assert _C.recall_bucket(lo, 4096) == b == _C.recall_bucket(hi, 4096)
    with pytest.raises(ValueError, match="bucket: 4"):
        _C.recall_bucket_label(4, capacity)
    with pytest.raises(ValueError, match="capacity"):
        _C.recall_bucket(10, 0)


# -- measure_recall -----------------------------------------------------------------------------

def test_recall_rows_keep_the_last_rows_and_spread_the_rest():
    rows = recall_rows(1000, 8)
    assert len(rows) == 8 and rows == sorted(set(rows)) and rows[-2:] == [998, 999]
    assert rows[0] < 1000 // 8  # the first stratum
    assert recall_rows(1000, 8) == rows  # deterministic
    assert recall_rows(5, 8) == [0, 1, 2, 3, 4]
    assert recall_rows(9, 8)[-1] == 8 and len(recall_rows(9, 8)) == 8
    assert recall_rows(3, 1) == [2]
    with pytest.raises(ValueError, match="rows"):
        recall_rows(10, 0)


def packed(lengths, heads=2, head_dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(n, heads, head_dim, generator=g)
    # A few strong keys far back, so that the mass is concentrated and top-k matters.
    k[::37] *= 4
    return q, k


def plan_of(lengths, density, block_size=64):
    samples = [_C.PlannedSample(id=10 + i, length=n, density=density)
               for i, n in enumerate(lengths)]
    return kernel_plan(samples, block_size=block_size, local_blocks=1)


def brute_force(q, k, plan, selection, rows):
    """Mean over rows and heads of the softmax mass in kept blocks, from the full matrix."""
    cu = plan.cu_seqlens.tolist()
    out = []
    for d in range(len(cu) - 1):
        s, n = cu[d], cu[d + 1] - cu[d]
        qd, kd = q[s:s + n].double(), k[s:s + n].double()
        values = []
        for h in range(q.shape[1]):
            logits = (qd[:, h] @ kd[:, h].T) / q.shape[2] ** 0.5
            logits = logits.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
            p = torch.softmax(logits, -1)
            blocks = torch.from_numpy(selection.block_mask(d, h)).bool()
            b = plan.block_size
            kept = blocks[torch.arange(n)[:, None] // b, torch.arange(n)[None, :] // b]
            values += [float((p[r] * kept[r]).sum()) for r in recall_rows(n, rows)]
        out.append(sum(values) / len(values))
    return out


def test_measure_recall_is_the_exact_softmax_mass_of_the_kept_blocks():
    lengths = [40, 300, 1000]
    q, k = packed(lengths)
    plan = plan_of(lengths, 0.2)
    selection = plan.select(q, k)
    measured = measure_recall(q, k, plan, rows=8, selection=selection)
    assert measured.rows.tolist() == [8, 8, 8]
    assert measured.recall.tolist() == pytest.approx(brute_force(q, k, plan, selection, 8),
                                                     abs=1e-5)
    # A one-block document keeps everything; the long one loses mass at density 0.2.
    assert measured.recall[0] == pytest.approx(1.0)
    assert measured.recall[2] < 0.99
    # Without a selection it selects the same blocks itself.
    assert torch.equal(measure_recall(q, k, plan, rows=8).recall, measured.recall)
    # More rows, still exact.
    more = measure_recall(q, k, plan, rows=32, selection=selection)
    assert more.recall.tolist() == pytest.approx(brute_force(q, k, plan, selection, 32),
                                                 abs=1e-5)


def test_recall_grows_with_density_and_is_one_when_dense():
    lengths = [2048]
    q, k = packed(lengths, seed=3)
    recalls = [float(measure_recall(q, k, plan_of(lengths, d)).recall[0])
               for d in (0.1, 0.3, 0.6, 1.0)]
    assert recalls == sorted(recalls) and recalls[0] < recalls[-1]
    assert recalls[-1] == pytest.approx(1.0, abs=1e-6)


def test_measure_recall_refuses_what_does_not_match():
    lengths = [100, 200]
    q, k = packed(lengths)
    plan = plan_of(lengths, 0.5)
    with pytest.raises(ValueError, match="q: 299 tokens"):
        measure_recall(q[:-1], k[:-1], plan)
    with pytest.raises(ValueError, match="same shape"):
        measure_recall(q, k[:, :1], plan)
    other = plan_of([300], 0.5)
    with pytest.raises(ValueError, match="selection"):
        measure_recall(q, k, plan, selection=other.select(q, k))
    with pytest.raises(TypeError, match="KernelPlan"):
        measure_recall(q, k, [1, 2])


# -- the Balancer -------------------------------------------------------------------------------

LENGTHS = [60 + (i * 7919) % 900 for i in range(200)]


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        return torch.full((LENGTHS[i],), i)


class Recording:
    """Wraps the C++ Balancer: records what report() is given, then hands it on."""

    def __init__(self, inner):
        self.inner, self.reports = inner, []

    def report(self, step, timings, wait):
        self.reports.append((step, list(timings)))
        return self.inner.report(step, timings, wait)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_layers(balancer, steps, layers, heads=2, head_dim=64):
    """Each micro-batch: one block_mask call per layer on random q, k (as a model would)."""
    g = torch.Generator().manual_seed(0)
    seen = []
    for step in balancer.batches(Tokens(), steps=steps):
        for mb in step:
            with balancer.timed(mb):
                if not mb.num_tokens:
                    continue
                for _ in range(layers):
                    q = torch.randn(mb.num_tokens, heads, head_dim, generator=g)
                    k = torch.randn(mb.num_tokens, heads, head_dim, generator=g)
                    mb.attention.block_mask(q, k)
            seen.append(mb)
    return seen


def test_balancer_measures_recall_per_document_and_layer_and_reports_it(planner):
    layers = 2
    balancer = sbt.Balancer(planner.address, LENGTHS, capacity=1024, micro_batches=2,
                            layers=layers, heads=2, head_dim=64, tokens_per_step=1500,
                            density_default=0.2)
    balancer._c = Recording(balancer._c)
    seen = run_layers(balancer, 3, layers)
    assert balancer.close()
    reports = balancer._c.reports
    assert [s for s, _ in reports] == [0, 1, 2]
    timings = [t for _, ts in reports for t in ts if t.tokens]
    assert len(timings) == len(seen)
    for mb, timing in zip(seen, timings):
        docs = timing.documents
        assert [(d.sample_id, d.document) for d in docs] == [(s.id, 0) for s in mb.samples]
        for d, sample in zip(docs, mb.samples):
            assert len(d.layer_recall) == layers and 0 < d.recall <= 1
            assert d.recall == pytest.approx(sum(d.layer_recall) / layers)
            assert d.rows == min(8, sample.length)
        assert timing.recall_seconds > 0
        # The token-weighted recall is the documents' (the trainer did not set its own).
        weights = [s.length for s in mb.samples]
        assert timing.recall == pytest.approx(
            sum(d.recall * w for d, w in zip(docs, weights)) / sum(weights))
    # Densities below 1 on documents of many blocks lose some mass.
    assert min(d.recall for t in timings for d in t.documents) < 1


def test_recall_can_be_limited_to_layers_or_turned_off(planner):
    balancer = sbt.Balancer(planner.address, LENGTHS, capacity=1024, micro_batches=2,
                            layers=3, heads=2, head_dim=64, tokens_per_step=1500,
                            recall_layers=[1], recall_rows=4)
    seen = run_layers(balancer, 1, 3)
    for mb in seen:
        assert sorted(mb.layer_recall) == [1]
        docs, weighted = mb.document_recall()
        assert all(d.layer_recall == [] and d.rows == min(4, s.length)
                   for d, s in zip(docs, mb.samples))
        assert 0 < weighted <= 1
    balancer.close()
    off = sbt.Balancer(planner.address, LENGTHS, capacity=1024, micro_batches=2, layers=1,
                       heads=2, head_dim=64, tokens_per_step=1500, measure_recall=False)
    off._c = Recording(off._c)
    explicit = []
    for step in off.batches(Tokens(), steps=1):
        for mb in step:
            with off.timed(mb):
                if not mb.num_tokens:
                    continue
                q = torch.randn(mb.num_tokens, 2, 64)
                mb.attention.block_mask(q, q)
                assert not mb.layer_recall  # the hook is off
                # A trainer with its own kernel measures explicitly.
                measured = mb.measure_recall(q, q.clone(), 0)
                assert measured.recall.numel() == len(mb.samples)
                with pytest.raises(ValueError, match="layer: 1"):
                    mb.measure_recall(q, q, 1)
                explicit.append(mb)
    off.close()
    timings = [t for _, ts in off._c.reports for t in ts if t.tokens]
    assert explicit and len(timings) == len(explicit)
    assert all(len(t.documents) == len(mb.samples) for t, mb in zip(timings, explicit))
    with pytest.raises(ValueError, match="recall_rows"):
        sbt.Balancer(planner.address, LENGTHS, capacity=1024, recall_rows=0)

