"""The global batch of every step, computed alike on every rank from a seed (no communication).

SparseBalance plans a step's *global* batch: every rank must pass the same documents to
TrainerSession.plan, and the planner then says which of them each rank trains on. A plain
DistributedSampler hands each rank a different shard instead; this sampler hands every rank the
whole batch::

    sampler = GlobalBatchSampler(lengths, seed=1, tokens_per_step=65536)
    for step, batch in enumerate(sampler):           # batch.ids, batch.lengths
        plan = session.plan(step, batch.samples())
        ... train on the documents of plan.micro_batches ...

Each epoch is a permutation of the dataset (seeded by (seed, epoch) with SplitMix64 and a
Fisher-Yates shuffle, so it is the same on every machine and Python version), cut greedily into
batches of at most ``tokens_per_step`` tokens. ``sampler.batch(step)`` gives any step directly
(a restarted rank resumes without replaying).
"""

import collections

__all__ = ["GlobalBatch", "GlobalBatchSampler"]

_MASK64 = (1 << 64) - 1


def _splitmix64(state):
    """One SplitMix64 step: returns (next_state, value)."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _permutation(n, seed):
    order = list(range(n))
    state = seed & _MASK64
    for i in range(n - 1, 0, -1):
        state, r = _splitmix64(state)
        j = r % (i + 1)  # modulo bias below 2^-40 for any realistic dataset size
        order[i], order[j] = order[j], order[i]
    return order


class GlobalBatch(collections.namedtuple("GlobalBatch", ["step", "epoch", "ids", "lengths"])):
    """One step's global batch: document ids (indices into the dataset) and their lengths."""

    @property
    def tokens(self):
        return sum(self.lengths)

    def samples(self, sensitivity=None):
        """The batch as sparsebalance.Sample objects; ``sensitivity`` (a function of the id)
        sets each one's sparsity sensitivity."""
        from ._C import Sample

        return [Sample(id=i, length=n, sensitivity=(sensitivity(i) if sensitivity else 0.0))
                for i, n in zip(self.ids, self.lengths)]


class GlobalBatchSampler:
    """Yields GlobalBatch objects, the same on every rank.

    Args:
      lengths: token count of every document of the dataset (document id = index).
      seed: the shared seed (every rank passes the same).
      tokens_per_step: most tokens in one batch; documents are added in the epoch's order
        until the next one would pass it.
      max_length: documents longer than this are skipped (default tokens_per_step; use the
        planner's micro-batch capacity). ``skipped`` lists them.
      epochs: how many epochs iteration runs (None: forever).
    """

    def __init__(self, lengths, seed, tokens_per_step, max_length=None, epochs=None):
        self.lengths = [int(n) for n in lengths]
        self.seed = int(seed)
        self.tokens_per_step = int(tokens_per_step)
        self.max_length = self.tokens_per_step if max_length is None else int(max_length)
        if self.tokens_per_step <= 0:
            raise ValueError(f"tokens_per_step: {tokens_per_step} is not positive")
        if self.max_length > self.tokens_per_step:
            raise ValueError(f"max_length: {self.max_length} exceeds tokens_per_step="
                             f"{self.tokens_per_step}; such documents could never fit")
        for i, n in enumerate(self.lengths):
            if n <= 0:
                raise ValueError(f"lengths[{i}]: {n} is not a positive token count")
        self.skipped = [i for i, n in enumerate(self.lengths) if n > self.max_length]
        if len(self.skipped) == len(self.lengths):
            raise ValueError(f"lengths: every document is longer than max_length="
                             f"{self.max_length}")
        self.epochs = epochs
        self._epoch_cache = {}

    def _epoch_batches(self, epoch):
        if epoch not in self._epoch_cache:
            order = _permutation(len(self.lengths), self.seed * 1_000_003 + epoch)
            batches, current, tokens = [], [], 0
            for i in order:
                n = self.lengths[i]
                if n > self.max_length:
                    continue
                if current and tokens + n > self.tokens_per_step:
                    batches.append(current)
                    current, tokens = [], 0
                current.append(i)
                tokens += n
            if current:
                batches.append(current)
            self._epoch_cache = {epoch: batches}  # keep one epoch: memory stays bounded
        return self._epoch_cache[epoch]

    def steps_in_epoch(self, epoch=0):
        """Batches in ``epoch`` (epochs are packed separately, so counts may differ a little)."""
        return len(self._epoch_batches(epoch))

    def batch(self, step):
        """The global batch of ``step`` (0-based, counting across epochs)."""
        if step < 0:
            raise ValueError(f"step: {step} is negative")
        epoch, rest = 0, step
        while True:
            batches = self._epoch_batches(epoch)
            if rest < len(batches):
                ids = batches[rest]
                return GlobalBatch(step, epoch, list(ids), [self.lengths[i] for i in ids])
            rest -= len(batches)
            epoch += 1

    def __iter__(self):
        step, epoch = 0, 0
        while self.epochs is None or epoch < self.epochs:
            for ids in self._epoch_batches(epoch):
                yield GlobalBatch(step, epoch, list(ids), [self.lengths[i] for i in ids])
                step += 1
            epoch += 1
