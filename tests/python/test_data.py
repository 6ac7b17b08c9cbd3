"""GlobalBatchSampler: every rank computes the same global batches from the seed alone."""

import subprocess
import sys

import numpy as np
import pytest

import sparsebalance as sb
from sparsebalance.data import GlobalBatchSampler

LENGTHS = [((i * 7919) % 3000) + 50 for i in range(500)] + [5000, 9000]


def first_batches(sampler, n):
    out = []
    for batch in sampler:
        out.append((batch.ids, batch.lengths))
        if len(out) == n:
            return out
    return out


def test_same_seed_same_batches_every_time():
    a = GlobalBatchSampler(LENGTHS, seed=42, tokens_per_step=8192)
    b = GlobalBatchSampler(LENGTHS, seed=42, tokens_per_step=8192)
    assert first_batches(a, 200) == first_batches(b, 200)  # crosses epoch boundaries
    c = GlobalBatchSampler(LENGTHS, seed=43, tokens_per_step=8192)
    assert first_batches(c, 5) != first_batches(a, 5)


def test_same_batches_in_another_process():
    # A rank is another interpreter: nothing is shared but the seed.
    code = ("from sparsebalance.data import GlobalBatchSampler; import json; "
            f"s = GlobalBatchSampler({LENGTHS!r}, seed=42, tokens_per_step=8192); "
            "print(json.dumps([s.batch(k).ids for k in range(30)]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    import json
    here = GlobalBatchSampler(LENGTHS, seed=42, tokens_per_step=8192)
    assert json.loads(result.stdout) == [here.batch(k).ids for k in range(30)]


def test_batches_fit_and_an_epoch_covers_every_document_once():
    sampler = GlobalBatchSampler(LENGTHS, seed=7, tokens_per_step=8192, max_length=4096)
    assert sampler.skipped == [500, 501]  # longer than max_length
    seen, batches = [], 0
    for batch in sampler:
        if batch.epoch > 0:
            break
        assert 0 < batch.tokens <= 8192
        assert batch.lengths == [LENGTHS[i] for i in batch.ids]
        seen += batch.ids
        batches += 1
    assert sorted(seen) == list(range(500))
    assert sampler.steps_in_epoch(0) == batches


def test_random_access_matches_iteration():
    sampler = GlobalBatchSampler(LENGTHS, seed=3, tokens_per_step=6000)
    iterated = first_batches(GlobalBatchSampler(LENGTHS, seed=3, tokens_per_step=6000), 250)
    for step in (0, 1, 99, 249):
        batch = sampler.batch(step)
        assert batch.step == step and (batch.ids, batch.lengths) == iterated[step]


def test_samples_and_bad_arguments():
    batch = GlobalBatchSampler(LENGTHS, seed=1, tokens_per_step=8192).batch(0)
    samples = batch.samples(sensitivity=lambda i: 0.5)
    assert [s.id for s in samples] == batch.ids and samples[0].sensitivity == 0.5
    assert isinstance(samples[0], sb.Sample)
    with pytest.raises(ValueError, match="lengths\\[1\\]"):
        GlobalBatchSampler([10, 0], seed=1, tokens_per_step=100)
    with pytest.raises(ValueError, match="max_length"):
        GlobalBatchSampler([10], seed=1, tokens_per_step=100, max_length=200)
    # Not token counts: refused naming the field, never truncated or flattened.
    for bad in ([], [100.7, 20], [[10, 20], [30, 40]], ["10", "20"], [float("nan")]):
        with pytest.raises(ValueError, match="lengths"):
            GlobalBatchSampler(bad, seed=1, tokens_per_step=100)
    # Whole numbers of any numeric type are token counts.
    for good in ([10, 20], np.array([10, 20], dtype=np.uint16), [10.0, 20.0]):
        assert GlobalBatchSampler(good, seed=1, tokens_per_step=100).lengths == [10, 20]


def test_the_sampler_protocol_set_epoch_len_and_resume():
    sampler = GlobalBatchSampler(LENGTHS, seed=5, tokens_per_step=8192, epochs=1)
    whole = list(sampler)
    assert len(sampler) == len(whole) == sampler.steps_in_epoch(0)
    assert [b.step for b in whole] == list(range(len(whole)))
    # set_epoch: the next epoch, numbered on from the first one, another order.
    sampler.set_epoch(1)
    second = list(sampler)
    assert len(sampler) == len(second) == sampler.steps_in_epoch(1)
    assert second[0].step == len(whole) and {b.epoch for b in second} == {1}
    assert sorted(i for b in second for i in b.ids) == sorted(i for b in whole for i in b.ids)
    assert [b.ids for b in second] != [b.ids for b in whole]
    # A checkpoint taken mid-epoch resumes where it stopped, in a new sampler.
    sampler.set_epoch(0)
    it = iter(sampler)
    seen = [next(it) for _ in range(3)]
    state = sampler.state_dict()
    resumed = GlobalBatchSampler(LENGTHS, seed=5, tokens_per_step=8192, epochs=1)
    resumed.load_state_dict(state)
    assert len(resumed) == len(whole) - 3  # what is left of the epoch
    rest = list(resumed)
    assert len(rest) == len(whole) - 3
    assert [b.ids for b in seen + rest] == [b.ids for b in whole]
    with pytest.raises(ValueError, match="seed"):
        GlobalBatchSampler(LENGTHS, seed=6, tokens_per_step=8192).load_state_dict(state)
    with pytest.raises(TypeError, match="forever"):
        len(GlobalBatchSampler(LENGTHS, seed=5, tokens_per_step=8192))


def splitmix64(x):
    mask = (1 << 64) - 1
    z = x & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 12345])
def test_the_vectorised_permutation_is_the_scalar_definition(seed):
    # The order is part of the contract between ranks and runs: the numpy version must equal
    # the definition written out in plain integers (ids sorted by their SplitMix64 hash).
    from sparsebalance.data import permutation

    n = 2000
    gamma = 0x9E3779B97F4A7C15
    expected = sorted(range(n), key=lambda i: (splitmix64(seed + (i + 1) * gamma), i))
    assert permutation(n, seed).tolist() == expected
