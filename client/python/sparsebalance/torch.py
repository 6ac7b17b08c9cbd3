"""SparseBalance for torch trainers in a few lines: ``sparsebalance.torch.Balancer``.

::

    import sparsebalance.torch as sbt
    balancer = sbt.Balancer(planner="sb-planner:50151", lengths=dataset.lengths,
                            micro_batches=2, capacity=8192, tokens_per_step=49152)
    for step in balancer.batches(dataset):         # this rank's micro-batches, step after step
        for mb in step:
            with balancer.timed(mb):               # CUDA events on GPU, thread CPU time on CPU
                loss = model(mb.tokens, mb.attention) * mb.loss_weight
                loss.backward()
        optimizer.step(); optimizer.zero_grad()
    balancer.close()                               # delivers what is still buffered

What it does for the trainer (torchrun or any initialised ``torch.distributed`` group):

- reads the rank and world size from the process group (or ``RANK``/``WORLD_SIZE``) and the
  device from ``LOCAL_RANK``; rank 0 creates the job (or resumes ``job=``) and shares its id and
  token over the group; every rank joins;
- draws every step's global batch from the seed (``sparsebalance.data.GlobalBatchSampler``: the
  same on every rank, no communication) and asks the planner for this rank's part; step N+1 is
  submitted and planned in the background while step N trains (``prefetch``);
- when the planner cannot be reached every rank plans locally, agreed with one collective per
  step; a warning with the reason at most once a minute; ``stats.local_steps`` counts such steps
  and the planner learns of them once it is back;
- documents the planner defers (``overflow="defer"``) are carried into the next step, never
  dropped, and a document drawn again while carried (a new epoch) waits a step (``held``);
  ``state_dict``/``load_state_dict`` resume at the right step with both;
- ``mb.loss_weight`` makes a token-mean loss per micro-batch add up, after DDP's average over
  ranks, to the token mean of the whole step (micro-batches hold unequal token counts);
- times each micro-batch and reports the timings to the planner in the background;
- measures recall: every ``mb.attention.block_mask(q, k)`` (or ``.select(q, k)``) call, one
  per layer in order, also measures, on a few sampled query rows per document, the exact
  softmax mass the kept blocks hold (``sparsebalance.attention.measure_recall``), and the report carries it per
  document and layer (``measure_recall=False`` turns it off; a trainer with its own kernel
  calls ``mb.measure_recall(q, k, layer)``). Its time is reported apart, not as compute.

The plan in a kernel's terms: ``mb.cu_seqlens``, ``mb.densities``, ``mb.max_seqlen``, and
``mb.attention`` (``sparsebalance.attention``: per-document top-k budgets, FlexAttention block
masks). ``sparsebalance.ops.sparse_attention`` takes ``mb.cu_seqlens`` and ``mb.densities``.
"""

import contextlib
import dataclasses
import hashlib
import os
import socket
import struct
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from . import _C
from ._C import ModelShape, PlannerConfig
from .data import GlobalBatchSampler
from .ops import varlen_layout

__all__ = ["Balancer", "MicroBatch", "ModelShape", "PlannedDataset", "PlannerConfig", "Step"]

_WORLD_ENV = ("RANK", "WORLD_SIZE")
_SHAPE_FIELDS = ("layers", "heads", "head_dim", "block_size", "local_blocks")


def _process_group_ranks(group):
    """(rank, world) of this process: the initialised process group's, else torchrun's
    RANK/WORLD_SIZE, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if all(name in os.environ for name in _WORLD_ENV):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world > 1:
            raise RuntimeError(f"Balancer: RANK={rank} WORLD_SIZE={world} but torch.distributed "
                               "is not initialised: call dist.init_process_group() first")
        return rank, world
    return 0, 1


class _Node:
    """This rank's node: the ranks of ``group`` whose host name is ``node``, in order (``ranks``,
    as ranks of ``group``; ``members``, as global ranks, the first leading), and a gloo group of
    them made for the Balancer's node collectives (None when the rank is alone on its node).
    Every rank of ``group`` makes one, together."""

    def __init__(self, group, node):
        world = dist.get_world_size(group)
        names = [None] * world
        dist.all_gather_object(names, node, group=group)
        global_ranks = (dist.get_process_group_ranks(group) if group is not None
                        else list(range(world)))
        self.ranks = [r for r, name in enumerate(names) if name == node]
        self.members = [global_ranks[r] for r in self.ranks]
        self.leader = self.members[0]
        self.me = dist.get_rank()
        # Only the node's ranks take part in making its group.
        self.group = (dist.new_group(self.members, backend="gloo", use_local_synchronization=True)
                      if len(self.members) > 1 else None)

    def gather(self, report):
        """gather_reports: each rank's report bytes to the node's leader."""
        if self.group is None:
            return [report]
        out = [None] * len(self.members) if self.me == self.leader else None
        dist.gather_object(report, out, dst=self.leader, group=self.group)
        return out

    def scatter(self, payloads):
        """scatter_plans: the leader's payloads, one to each rank of the node (a node of more
        than one rank: alone, a rank fetches its own plan)."""
        out = [None]
        dist.scatter_object_list(out, payloads if self.me == self.leader else None,
                                 src=self.leader, group=self.group)
        return out[0]


def _default_device():
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class MicroBatch:
    """One micro-batch of this rank's plan: its documents packed varlen.

    Attributes: ``index`` (in the rank's plan), ``step``, ``samples`` (PlannedSample: id, length,
    density, segments), ``ids``, ``tokens`` (the dataset's items concatenated, on the balancer's
    device; a dict of such tensors when items are dicts), ``cu_seqlens`` (int32 tensor, one entry
    per document: a pre-packed sample's segments are documents of their own), ``densities``
    (one per document), ``max_seqlen``, ``num_tokens``, ``loss_weight`` and ``document_weight``
    (see Balancer), ``attention`` (the plan in a kernel's terms). Set ``recall`` (and
    ``achieved_density``) when the kernel measures them: the report carries them (by default
    ``recall`` is the token-weighted measured recall, see ``measure_recall``).
    """

    def __init__(self, step, index, samples, tokens, device, loss_weight, document_weight,
                 shape, recall_rows=0, recall_layers=None, selection="topk",
                 anchor_threshold=0.05):
        self.step, self.index, self.samples = step, index, list(samples)
        self._shape = shape
        self._selection = (selection, anchor_threshold)  # the job's selection mode and tau
        self.ids = [s.id for s in self.samples]
        cu, densities = varlen_layout(self.samples)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        self.densities = densities
        self.max_seqlen = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        self.num_tokens = cu[-1]
        self.tokens = tokens
        self.loss_weight = loss_weight
        self.document_weight = document_weight
        self.recall = None
        self.achieved_density = None
        self.last = False  # the last micro-batch of its step (the optimizer steps after it)
        self._attention = None
        self._seconds = None
        self._recall_rows = recall_rows  # 0: no automatic measurement
        self._recall_layers = recall_layers  # None: every layer
        self._mask_calls = 0  # block_mask calls so far: the layer of the next one
        self.layer_recall = {}  # layer -> RecallMeasurement
        self._recall_timers = []

    @property
    def attention(self):
        """The plan in a kernel's terms (sparsebalance.attention.KernelPlan, in the job's block
        geometry and selection mode): cu_seqlens, densities, per-document top-k budgets
        (``topk(doc)``), and ``block_mask(q, k)``, one layer's FlexAttention BlockMask."""
        if self._attention is None:
            from .attention import kernel_plan

            self._attention = kernel_plan(self.samples, block_size=self._shape.block_size,
                                          local_blocks=self._shape.local_blocks,
                                          device=self.cu_seqlens.device,
                                          selection=self._selection[0],
                                          anchor_threshold=self._selection[1])
            if self._recall_rows:
                self._attention = dataclasses.replace(self._attention,
                                                      on_select=self._on_select)
        return self._attention

    def _on_select(self, q, k, selection):
        """select's (block_mask's) hook: its n-th call is layer n (calls beyond the model's layers, e.g.
        activation checkpointing's recomputation, are not measured again)."""
        layer = self._mask_calls
        self._mask_calls += 1
        if layer >= self._shape.layers or layer in self.layer_recall:
            return
        if self._recall_layers is not None and layer not in self._recall_layers:
            return
        self.measure_recall(q, k, layer, selection=selection, rows=self._recall_rows)

    def measure_recall(self, q, k, layer=0, *, selection=None, rows=None):
        """Measures the recall of layer ``layer``'s kept blocks for q, k ([tokens, heads,
        head_dim], packed like ``cu_seqlens``): sparsebalance.attention.measure_recall on
        ``rows`` sampled query rows per document (default: the Balancer's ``recall_rows``, 8
        when off). ``selection``: the blocks the kernel kept (default: the plan's selection on
        q, k). The report carries the documents' recall; the time it takes is reported as
        recall_seconds, apart from compute. Returns the RecallMeasurement."""
        from .attention import measure_recall

        if not 0 <= layer < self._shape.layers:
            raise ValueError(f"layer: {layer} is not in [0, {self._shape.layers})")
        rows = rows or self._recall_rows or 8
        timer = _Timer(q.device)
        with timer:
            measured = measure_recall(q, k, self.attention, rows, selection=selection)
        self._recall_timers.append(timer)
        self.layer_recall[layer] = measured
        return measured

    def recall_seconds(self):
        """Time spent in measure_recall so far (the report's recall_seconds)."""
        return sum(t.seconds() for t in self._recall_timers)

    def document_recall(self):
        """The measured recall as DocumentRecallMeasurement list (one per document; recall is
        the mean over the measured layers, layer_recall one per layer when all were measured)
        and its token-weighted mean; ([], None) when nothing was measured."""
        if not self.layer_recall:
            return [], None
        plan = self.attention
        layers = sorted(self.layer_recall)
        per_layer = torch.stack([self.layer_recall[n].recall for n in layers])  # [layers, docs]
        mean = per_layer.mean(dim=0)
        rows = self.layer_recall[layers[0]].rows.tolist()
        full = layers == list(range(self._shape.layers))
        docs = [_C.DocumentRecallMeasurement(
                    sample_id=plan.sample_ids[d], document=index, recall=float(mean[d]),
                    layer_recall=per_layer[:, d].tolist() if full else [], rows=int(rows[d]))
                for d, index in enumerate(plan.document_indices())]
        cu = self.cu_seqlens.cpu().to(torch.float64)
        weights = cu[1:] - cu[:-1]
        weighted = float((mean * weights).sum() / weights.sum().clamp(min=1.0))
        return docs, weighted

    def __repr__(self):
        return (f"MicroBatch(step={self.step}, index={self.index}, documents="
                f"{len(self.densities)}, tokens={self.num_tokens})")


class Step(list):
    """This rank's micro-batches of one step (a list of MicroBatch), with ``step``, ``plan``
    (the RankStepPlan), ``local`` (planned on this machine because the planner was away),
    ``plan_wait_seconds`` (how long the step waited for its plan: submit and planning when not
    prefetched) and ``plan_seconds`` (the whole plan() call, with the collective that agrees on
    local plans: it also waits for the slowest rank to arrive)."""

    def __init__(self, number, plan, micro_batches, plan_wait_seconds, plan_seconds):
        super().__init__(micro_batches)
        self.step, self.plan = number, plan
        self.local = plan.local_fallback
        self.plan_wait_seconds = plan_wait_seconds
        self.plan_seconds = plan_seconds


class _Timer:
    """Compute seconds of one micro-batch: CUDA events on a GPU (read after the step, so timing
    adds no synchronisation), this thread's CPU time on the CPU (fair when ranks share cores)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.start = self.end = None

    def __enter__(self):
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.thread_time()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.end = time.thread_time()
        return False

    def seconds(self):
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1000.0
        return self.end - self.start


class Balancer:
    """SparseBalance for one rank of a torch trainer (see the module's docstring).

    Args:
      planner: sb-planner's "host:port" (default: $SPARSEBALANCE_PLANNER). None or "" with
        ``allow_offline_start``: plan locally only.
      lengths: token count of every dataset item (item id = index). Required.
      tokens_per_step: tokens in one global batch (default: ranks x micro_batches x capacity x
        ``fill``).
      seed: the data order's seed (every rank the same: with tokens_per_step and lengths,
        checked at start; ranks that differ all raise ValueError).
      config: a PlannerConfig for a new job; or leave it None and pass its fields as keyword
        arguments (micro_batches=, micro_batch_capacity= or capacity=, policy=, ...; shape= or
        the ModelShape's own fields: layers=, heads=, head_dim=, block_size=, local_blocks=).
        overflow defaults to "defer" here: documents that do not fit a step are carried, never
        dropped, and placed before the next step's new documents.
        ``ranks`` is the world size. A resumed job (``job=``) uses the job's own config.
        max_shards must be 1: documents run whole here (ValueError otherwise), and a step
        whose plan holds a shard, once the job's max_shards is raised with UpdateJobConfig,
        raises PlannerError on every rank (FAILED_PRECONDITION on the ranks holding one,
        ABORTED on the others).
      job, token: resume this existing job instead of creating one (rank 0 creates otherwise).
      admin_token: the planner's admin token for creating the job, when it has one.
      allow_offline_start: an unreachable planner at start is an error unless this is True.
      prefetch: plan step N+1 while step N trains (True by default).
      group: the process group (default: the global one). device: where tokens go (default:
        cuda:LOCAL_RANK when CUDA is available, else cpu).
      call_timeout_seconds, plan_timeout_seconds: planner deadlines before falling back.
      host_name: this rank's host name for the planner (``GetJob``'s slowest ranks, the
        slow-rank metrics); default: the machine's.
      node_reports: send the reports of this rank's node (the ranks with the same
        ``host_name``) through its first rank: one ``ReportStepBatch`` call per node and step
        instead of a ``ReportStep`` per rank, which cuts the planner's CPU per report about 4x
        at 8 ranks a node (README, Service load). Costs a gather of a few hundred bytes per
        rank and step over a gloo group of the node. Off by default.
      node_plans: fetch the plans of this rank's node through its first rank: one
        ``GetRankPlans`` call per node and step (prefetched by the leader) instead of a
        ``GetRankPlan`` per rank, handed to the node's ranks by a scatter over the same gloo
        group. With node_reports it takes the planner's CPU per step at 4,096 ranks in nodes of
        8 from about 0.29 to 0.17 s (README, Service load). A member waits for its plan in
        plan(), behind its leader's. Off by default.
      warn: called with each fallback warning (default: warnings.warn), at most once a minute.
      measure_recall: measure recall through ``mb.attention.block_mask`` (True by default; see
        the module's docstring); recall_rows: query rows sampled per document (8);
        recall_layers: the layers measured (None: all).
    """

    def __init__(self, planner=None, lengths=None, *, tokens_per_step=None, fill=0.8, seed=0,
                 config=None, job=None, token=None, admin_token="", name=None,
                 allow_offline_start=False, prefetch=True, group=None, device=None,
                 call_timeout_seconds=2.0, plan_timeout_seconds=60.0, warn=None,
                 measure_recall=True, recall_rows=8, recall_layers=None, host_name=None,
                 node_reports=False, node_plans=False, **config_fields):
        if lengths is None:
            raise ValueError("lengths: the dataset's token count per item is needed (e.g. "
                             "lengths=dataset.lengths)")
        if not isinstance(recall_rows, int) or recall_rows < 1:
            raise ValueError(f"recall_rows: {recall_rows!r} is not a positive integer")
        self._recall_rows = recall_rows if measure_recall else 0
        self._recall_layers = None if recall_layers is None else frozenset(recall_layers)
        self.group = group
        self._warn = warn or (lambda line: warnings.warn(line, RuntimeWarning, stacklevel=2))
        self.rank, self.world = _process_group_ranks(group)
        self.device = torch.device(device) if device is not None else _default_device()
        if planner is None:
            planner = os.environ.get("SPARSEBALANCE_PLANNER", "")
        if not planner and not allow_offline_start:
            raise ValueError("planner: no address (pass planner=\"host:port\" or set "
                             "SPARSEBALANCE_PLANNER; allow_offline_start=True plans locally)")
        config = self._config(config, config_fields)
        self._target, self._call_timeout = planner, call_timeout_seconds
        options = _C.BalancerOptions(
            client=_C.ClientOptions(target=planner or "127.0.0.1:1", token=token or "",
                                    admin_token=admin_token or "",
                                    call_timeout_seconds=call_timeout_seconds,
                                    plan_timeout_seconds=plan_timeout_seconds,
                                    host_name=host_name or ""),
            rank=self.rank, world=self.world, job_id=job or "",
            job_name=name or f"torch-{os.getpid()}", config=config,
            allow_offline_start=allow_offline_start or not planner, prefetch=prefetch,
            # Documents run whole here: a shard in a plan (max_shards raised by UpdateJobConfig
            # after the check below) is an error on every rank, not a document trained twice.
            runs_shards=False,
            any_rank=self._any_rank, share_job=self._share_job,
            warn=self._warn)
        if (node_reports or node_plans) and self.world > 1:
            node = _Node(group, host_name or socket.gethostname())
            if node_reports:
                options.gather_reports = node.gather
            if node_plans and node.group is not None:
                options.plan_group = node.ranks
                options.scatter_plans = node.scatter
        self._c = _C.Balancer.start(options)
        self.config = self._c.config
        # What this rank refuses of the job's config and its own arguments. Every rank checks,
        # then all learn whether any refused (one collective), so that they raise together: a
        # rank raising alone left the others waiting in the next collective, a hang until the
        # process group's timeout. The job's config can differ between ranks when
        # UpdateJobConfig changes it while they join.
        problem = None
        capacity = self.config.micro_batch_capacity
        room = self.world * self.config.micro_batches * capacity
        if tokens_per_step is None:
            tokens_per_step = int(fill * room)
        if self.config.max_shards > 1:
            # A split document's shards need the key/value exchange between ranks, which only
            # sb-worker runs so far; running a shard as a whole document would train it twice.
            problem = ValueError(f"max_shards: {self.config.max_shards}: sparsebalance.torch "
                                 "does not run documents split over ranks yet (sb-worker does); "
                                 "use max_shards=1")
        elif tokens_per_step > room and self.config.overflow == _C.OverflowPolicy.ERROR:
            problem = ValueError(f"tokens_per_step: {tokens_per_step} tokens a step do not fit "
                                 f"{self.world} ranks x {self.config.micro_batches} micro-batches "
                                 f"x {capacity} tokens = {room}; lower it, or overflow=\"defer\"")
        else:
            try:
                self.sampler = GlobalBatchSampler(lengths, seed=seed,
                                                  tokens_per_step=tokens_per_step,
                                                  max_length=capacity)
            except ValueError as e:
                problem = e
        if self._any_rank(problem is not None):
            self._c.finish(0)
            raise problem or ValueError(
                "another rank refused the job's config or its own arguments at start (its error "
                "says which); this rank stops with it")
        if tokens_per_step >= room:
            # Under defer, what a step defers goes ahead of the next step's batch: with at least
            # as many tokens drawn a step as the ranks hold, the carried documents only pile up
            # (measured: 25 of 400 documents never trained in 3 epochs at 1.27 x the room).
            self._warn(f"tokens_per_step: {tokens_per_step} tokens a step, at least the "
                       f"{room} the ranks hold: the documents each step defers pile up and some "
                       "may never be trained; lower it (or fill) below the room")
        if self.world > 1:
            self._check_ranks_draw_alike()
        self.lengths = self.sampler.lengths
        if self.sampler.skipped:
            skipped = self.sampler.skipped
            self._warn(f"lengths: {len(skipped)} documents are longer than the micro-batch "
                       f"capacity ({capacity} tokens) and are never trained (ids "
                       f"{skipped[:8]}{' ...' if len(skipped) > 8 else ''}); raise capacity or "
                       "split them")
        self._pending = None  # (step number, [(MicroBatch, _Timer)], step start)
        self._held = {}  # step -> Samples drawn earlier, held back for it (_step_batch)
        self._warned_untimed = False

    # -- set-up -----------------------------------------------------------------------------
    def _check_ranks_draw_alike(self):
        """Every rank draws each step's global batch itself, from the seed, tokens_per_step and
        lengths: ranks given different ones planned different batches (offline, silently). A
        digest of the three, all-reduced: every rank raises, or none."""
        digest = hashlib.sha256(struct.pack("<qq", self.sampler.seed,
                                            self.sampler.tokens_per_step))
        digest.update(np.asarray(self.sampler.lengths, dtype=np.int64).tobytes())
        mine = int.from_bytes(digest.digest()[:7], "little")  # fits an int64
        device = self.device if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if t[0].item() != -t[1].item():  # the most and the least differ
            self._c.finish(0)
            raise ValueError("seed, tokens_per_step or lengths: not the same on every rank (each "
                             "rank draws every step's global batch from them); pass the same "
                             "on every rank")

    def _config(self, config, fields):
        if config is not None and fields:
            raise ValueError(f"config: given together with {sorted(fields)}; pass one or the "
                             "other")
        if config is None:
            if "capacity" in fields:
                fields["micro_batch_capacity"] = fields.pop("capacity")
            shape = {name: fields.pop(name) for name in _SHAPE_FIELDS if name in fields}
            if shape:
                if "shape" in fields:
                    raise ValueError(f"shape: given together with {sorted(shape)}")
                fields["shape"] = _C.ModelShape(**shape)
            # A global batch that fits the ranks' tokens may still not pack into micro-batches:
            # documents that do not fit wait for the next step rather than fail it.
            fields.setdefault("overflow", "defer")
            config = _C.PlannerConfig(**fields)
        config.ranks = self.world
        config.validate()
        return config

    def _any_rank(self, flag):
        if self.world == 1:
            return bool(flag)
        device = self.device if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.item() > 0

    def _share_job(self, handle):
        if self.world == 1:
            return handle
        shared = [(handle.job_id, handle.token) if self.rank == 0 else None]
        # src is a global rank: the group's rank 0 is global rank 0 only in the default group
        # (a data-parallel group under tensor or pipeline parallelism may not hold it).
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(shared, src=src, group=self.group)
        return _C.JobHandle(job_id=shared[0][0], token=shared[0][1])

    # -- the step loop ----------------------------------------------------------------------
    @property
    def job(self):
        """The job's JobHandle (job_id, token; empty when offline)."""
        return self._c.job

    @property
    def stats(self):
        """Counters: planned_steps, local_steps, prefetched_steps, plan_wait_seconds (total time
        steps waited for their plans), buffered_reports, dropped_reports, planner_reachable,
        last_error."""
        return self._c.stats

    @property
    def next_step(self):
        """The step batches() starts at: at start the least over the ranks of the first step
        each had not reported (0 for a new job; the same on every rank), then the latest
        planned step + 1, or a checkpoint's (load_state_dict). A step run again that this rank
        had reported is not reported again."""
        return self._c.next_step

    @property
    def carried(self):
        """Documents (Samples) deferred by the latest step, to be trained first in the next."""
        return self._c.carried

    def global_batch(self, step):
        """The global batch of ``step`` as Samples (the same on every rank)."""
        batch = self.sampler.batch(step)
        return [_C.Sample(id=i, length=n) for i, n in zip(batch.ids, batch.lengths)]

    @property
    def held(self):
        """Documents (Samples) drawn while a copy of them was still carried (a new epoch drew a
        document that a step had deferred), to be planned in ``next_step`` after the carried
        ones and before its draw: a batch plans a document id once, so the new draw goes a
        step later rather than merge with the carried copy and be trained once where it was
        drawn twice."""
        return list(self._held.get(self.next_step, []))

    def _step_batch(self, step, carried):
        """The new documents ``step`` plans (the session puts ``carried`` ahead of them): those
        held back for it, then its draw, less any whose id is carried or already in, which wait
        for the step after. The same on every rank: the carried ids come from the plan."""
        taken = {s.id for s in carried}
        batch, later = [], []
        for s in self._held.get(step, []) + self.global_batch(step):
            if s.id in taken:
                later.append(s)
            else:
                batch.append(s)
                taken.add(s.id)
        self._held = {k: v for k, v in self._held.items() if k >= step}
        if later:
            self._held[step + 1] = later
        else:
            self._held.pop(step + 1, None)
        return batch

    def batches(self, dataset, steps=None):
        """This rank's steps, from ``next_step`` on: each a Step (list of MicroBatch) whose
        ``tokens`` hold ``dataset[id]`` concatenated. ``steps``: how many (None: forever).
        Reports the previous step's timings when the next one is asked for (and at close).
        A step plans the documents the step before deferred (``carried``), then its draw
        (``global_batch``); a drawn document whose copy is still carried waits a step
        (``held``)."""
        end = None if steps is None else self.next_step + int(steps)
        step = self.next_step
        batch = self._step_batch(step, self._c.carried)
        while end is None or step < end:
            carried_in = self._c.carried  # deferred by the step before: planned first
            start = time.perf_counter()
            plan = self._c.plan(step, batch)
            plan_seconds = time.perf_counter() - start
            wait = self._c.stats.last_plan_wait_seconds  # the plan itself, not the collective
            if plan.step != step or plan.rank != self.rank:
                raise RuntimeError(f"plan: for step {plan.step} rank {plan.rank}, expected "
                                   f"step {step} rank {self.rank}")
            if end is None or step + 1 < end:
                following = self._step_batch(step + 1, self._c.carried)
                self._c.prefetch(step + 1, following)  # planned while this step trains
            micro_batches = self._micro_batches(step, plan, dataset, carried_in + batch)
            if micro_batches:
                micro_batches[-1].last = True
            self._pending = (step, [(mb, None) for mb in micro_batches], time.perf_counter())
            yield Step(step, plan, micro_batches, wait, plan_seconds)
            self._report_pending()
            step += 1
            if end is None or step < end:
                batch = following

    def _micro_batches(self, step, plan, dataset, full_batch):
        """MicroBatch objects of this rank's plan, with their loss weights: a micro-batch's share
        of the tokens (documents) the whole step trains, times the world size (DDP averages
        gradients over ranks). Every rank knows the step's global batch and its deferred ids,
        so the weights need no communication."""
        deferred, seen = set(plan.deferred_ids), set()
        global_tokens = global_docs = 0
        for s in full_batch:
            if s.id in seen or s.id in deferred:
                continue
            seen.add(s.id)
            global_tokens += s.length
            global_docs += max(1, len(s.segments))
        out = []
        for m, mb in enumerate(plan.micro_batches):
            tokens = sum(s.length for s in mb.samples)
            docs = sum(len(s.documents()) for s in mb.samples)
            out.append(MicroBatch(
                step, m, mb.samples, self._load(dataset, mb.samples), self.device,
                self.world * tokens / max(1, global_tokens),
                self.world * docs / max(1, global_docs), self.config.shape,
                self._recall_rows, self._recall_layers, self.config.selection.label,
                self.config.anchor_threshold))
        return out

    def _load(self, dataset, samples):
        if dataset is None:
            return None
        items = []
        for s in samples:
            item = dataset[s.id]
            n = (len(next(iter(item.values()))) if isinstance(item, dict) else len(item))
            if n != s.length:
                raise ValueError(f"dataset[{s.id}]: {n} tokens where lengths[{s.id}] = "
                                 f"{s.length}")
            items.append(item)
        if not items:
            return None
        if isinstance(items[0], dict):
            return {k: torch.cat([torch.as_tensor(it[k]) for it in items]).to(self.device)
                    for k in items[0]}
        return torch.cat([torch.as_tensor(it) for it in items]).to(self.device)

    @contextlib.contextmanager
    def timed(self, mb):
        """Times the work done inside it (forward and backward of ``mb``) for the report."""
        if self._pending is None or self._pending[0] != mb.step:
            raise ValueError(f"mb: micro-batch of step {mb.step}, but the current step is "
                             f"{None if self._pending is None else self._pending[0]}")
        timer = _Timer(self.device)
        with timer:
            yield mb
        entries = self._pending[1]
        entries[mb.index] = (entries[mb.index][0], timer)

    def _report_pending(self):
        """Reports the finished step's timings. A step whose non-empty micro-batches were not all
        timed is not reported (the planner would refuse a partial report); a warning says so,
        once."""
        if self._pending is None:
            return
        step, entries, started = self._pending
        self._pending = None
        untimed = [mb.index for mb, timer in entries if timer is None and mb.num_tokens]
        if untimed:
            if not self._warned_untimed:
                self._warned_untimed = True
                self._warn(f"step {step}: micro-batches {untimed} were not timed "
                           "(balancer.timed(mb)); steps without timings are not reported, so "
                           "the planner cannot learn this machine's speed")
            self._c.skip_report(step)  # node_reports: the node's other ranks still report
            return
        timings, compute = [], 0.0
        for mb, timer in entries:
            # An empty micro-batch (the plan left it empty) is not reported: the planner refuses
            # a report of one, and would drop the whole step's report with it.
            if timer is None or not mb.num_tokens:
                continue
            documents, measured = mb.document_recall()
            recall_seconds = mb.recall_seconds()
            # Measuring ran inside timed(): it is not the micro-batch's compute.
            seconds = max(0.0, timer.seconds() - recall_seconds)
            compute += seconds + recall_seconds
            if mb.recall is None and measured is not None:
                mb.recall = measured
            density = mb.achieved_density
            if density is None:
                cu = mb.cu_seqlens.tolist()
                weights = [b - a for a, b in zip(cu, cu[1:])]
                density = (sum(d * w for d, w in zip(mb.densities, weights)) /
                           max(1, sum(weights)))
            timings.append(_C.MicroBatchTiming(
                micro_batch=mb.index, compute_seconds=seconds, tokens=mb.num_tokens,
                achieved_density=float(density),
                recall=float(mb.recall) if mb.recall is not None else 0.0,
                documents=documents, recall_seconds=recall_seconds))
        # The rest of the step (gradient all-reduce, optimizer) is this rank's wait.
        wait = max(0.0, time.perf_counter() - started - compute)
        self._c.report(step, timings, wait)

    # -- the trainer's own kernel --------------------------------------------------------------
    def profile(self, attention, linear=None, lengths=None, densities=(1.0, 0.5, 0.25, 0.1),
                **options):
        """Times the trainer's own attention (and linear) callable on this machine over
        ``lengths`` x ``densities`` in the job's shape (sparsebalance.attention.profile: the
        callable gets q, k, v [length, heads, head_dim] and the document's KernelPlan) and, on
        rank 0, uploads the table to the planner as the job's cost prior (the online model
        refines it from the reports). Every rank may call it; only rank 0 measures. Returns the
        table text (None on other ranks). ``lengths`` default: capacity / 8, / 4, / 2, / 1."""
        if self.rank != 0:
            return None
        from .attention import profile

        capacity = self.config.micro_batch_capacity
        if lengths is None:
            lengths = sorted({max(self.config.shape.block_size, capacity // d)
                              for d in (8, 4, 2, 1)})
        options.setdefault("device", self.device)
        text = profile(attention, lengths, densities, self.config.shape, linear=linear,
                       **options)
        if self.job.job_id:
            client = _C.PlannerClient(_C.ClientOptions(
                target=self._target, job_id=self.job.job_id, token=self.job.token,
                call_timeout_seconds=self._call_timeout))
            client.upload_profile(text)
        return text

    # -- checkpoints and the end --------------------------------------------------------------
    def state_dict(self):
        """What a checkpoint needs to resume: the next step, the documents carried into it and
        held back for it, the job and the data order."""
        step = self.next_step
        return {"next_step": step, "job_id": self.job.job_id,
                "carried": [(s.id, s.length) for s in self._c.carried],
                "held": [(s.id, s.length) for s in self._held.get(step, [])],
                "seed": self.sampler.seed, "tokens_per_step": self.sampler.tokens_per_step}

    def load_state_dict(self, state):
        """Resumes at ``state["next_step"]`` with the documents it carried and held back
        (before batches()). A checkpoint without ``held`` (older versions) holds none."""
        for key in ("seed", "tokens_per_step"):
            if state[key] != getattr(self.sampler, key):
                raise ValueError(f"state_dict: {key} {state[key]} differs from this Balancer's "
                                 f"{getattr(self.sampler, key)}: the data order would change")
        step = int(state["next_step"])
        self._c.resume(step, [_C.Sample(id=i, length=n) for i, n in state["carried"]])
        held = [_C.Sample(id=i, length=n) for i, n in state.get("held", [])]
        self._held = {step: held} if held else {}

    def close(self, timeout_seconds=10.0):
        """Reports the last step and delivers what is buffered (waits at most
        ``timeout_seconds``). Returns True when everything reached the planner."""
        self._report_pending()
        return self._c.finish(timeout_seconds)

    def dataset(self, dataset):
        """This rank's micro-batches as a torch IterableDataset (PlannedDataset), for trainers
        built around a DataLoader."""
        return PlannedDataset(self, dataset)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class PlannedDataset(torch.utils.data.IterableDataset):
    """This rank's planned micro-batches, one epoch per iteration, for a DataLoader::

        loader = DataLoader(balancer.dataset(dataset), batch_size=None)   # num_workers=0
        for epoch in range(epochs):
            loader.dataset.set_epoch(epoch)
            for mb in loader:                      # MicroBatch objects, step after step
                with balancer.timed(mb):
                    (model(mb.tokens, ...) * mb.loss_weight).backward()
                if mb.last:                        # the step's last micro-batch
                    optimizer.step(); optimizer.zero_grad()

    ``len()`` counts the micro-batches left in the epoch (every step has the job's
    micro_batches per rank), ``set_epoch`` picks the epoch, ``state_dict``/``load_state_dict``
    are the Balancer's. Iterated in the training process (planning takes part in the process
    group's collectives): a DataLoader with worker processes is an error.
    """

    def __init__(self, balancer, dataset):
        self.balancer, self.data, self.epoch = balancer, dataset, 0

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def _steps_left(self):
        end = self.balancer.sampler.first_step(self.epoch + 1)
        return max(0, end - self.balancer.next_step)

    def __len__(self):
        return self._steps_left() * self.balancer.config.micro_batches

    def __iter__(self):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("PlannedDataset: iterated in a DataLoader worker process; plans "
                               "are agreed over the process group, so use num_workers=0 (load "
                               "the tokens in your dataset's __getitem__)")
        for step in self.balancer.batches(self.data, steps=self._steps_left()):
            yield from step

    def state_dict(self):
        return dict(self.balancer.state_dict(), epoch=self.epoch)

    def load_state_dict(self, state):
        self.epoch = int(state.get("epoch", 0))
        self.balancer.load_state_dict(state)
