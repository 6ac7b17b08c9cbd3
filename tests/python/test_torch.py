"""sparsebalance.torch.Balancer, the torch adapter, against a real sb-planner: one rank in this
process (prefetch, loss weights, packing, deferred documents, offline start, resume, bad input)
and two gloo ranks in two processes (the job's token shared over the process group, one plan
for all)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import sparsebalance as sb  # noqa: E402
import sparsebalance.torch as sbt  # noqa: E402

LENGTHS = [60 + (i * 7919) % 900 for i in range(300)]
UNREACHABLE = "127.0.0.1:1"


class Tokens(torch.utils.data.Dataset):
    """Item i: LENGTHS[i] tokens, each equal to i (so a packed micro-batch shows its ids)."""

    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        return torch.full((LENGTHS[i],), i)


def small(**fields):
    base = dict(capacity=1024, micro_batches=2, layers=1, heads=2, head_dim=64,
                tokens_per_step=1800, call_timeout_seconds=2)
    base.update(fields)
    return base


def train(balancer, steps, dataset=Tokens()):
    """Runs `steps` steps, timing every micro-batch; returns [(step, [ids per micro-batch])]."""
    trained = []
    for step in balancer.batches(dataset, steps=steps):
        ids = []
        for mb in step:
            with balancer.timed(mb):
                if mb.num_tokens:
                    assert torch.equal(mb.tokens, torch.cat([torch.full((LENGTHS[i],), i)
                                                             for i in mb.ids]))
            ids.append(mb.ids)
        trained.append((step.step, ids))
    return trained


def test_one_rank_trains_each_global_batch_with_prefetched_plans(planner):
    balancer = sbt.Balancer(planner.address, LENGTHS, **small())
    assert (balancer.rank, balancer.world, balancer.next_step) == (0, 1, 0)
    steps = 5
    seen, carried_in = [], []
    for step in balancer.batches(Tokens(), steps=steps):
        assert not step.local and step.plan_wait_seconds >= 0
        # Nothing lost or added: the step trains its batch and what the step before deferred,
        # less what it defers itself (overflow="defer", the adapter's default).
        carried_out = [s.id for s in balancer.carried]
        drawn = carried_in + [s.id for s in balancer.global_batch(step.step)]
        assert sorted(i for mb in step for i in mb.ids) == \
            sorted(i for i in drawn if i not in carried_out)
        carried_in = carried_out
        # Token weights: a micro-batch's share of the step's tokens (one rank: they sum to 1).
        weights = [mb.loss_weight for mb in step if mb.num_tokens]
        assert sum(weights) == pytest.approx(1.0)
        for mb in step:
            with balancer.timed(mb):
                pass
            assert mb.cu_seqlens.tolist()[-1] == mb.num_tokens == sum(LENGTHS[i] for i in mb.ids)
            assert mb.attention.cu_seqlens.tolist() == mb.cu_seqlens.tolist()
        if step.step == 0:
            # Prefetch: while step 0 trains, step 1 reaches the planner and is planned (this
            # long poll returns once the plan exists; without prefetch it would time out).
            probe = sb.connect(planner.address, job_id=balancer.job.job_id,
                               token=balancer.job.token, plan_timeout_seconds=20)
            assert probe.get_rank_plan(1, 0).step == 1
        seen.append(step.step)
    assert seen == list(range(steps))
    assert balancer.close() is True
    stats = balancer.stats
    assert (stats.planned_steps, stats.local_steps) == (steps, 0)
    assert 1 <= stats.prefetched_steps <= steps - 1
    assert stats.buffered_reports == 0 and stats.dropped_reports == 0


def test_deferred_documents_are_trained_once_each(planner):
    # More tokens a step than the ranks can hold: the planner defers some, and they come back
    # first in the next step. Over the run, every document drawn is trained exactly once or is
    # still carried at the end.
    balancer = sbt.Balancer(planner.address, LENGTHS,
                            **small(overflow="defer", tokens_per_step=2600, micro_batches=1))
    steps = 8
    trained = [i for _, ids in train(balancer, steps) for mb in ids for i in mb]
    drawn = [s.id for k in range(steps) for s in balancer.global_batch(k)]
    carried = [s.id for s in balancer.carried]
    # One rank holds 1,024 tokens a step and draws 2,600: deferral happened every step.
    assert carried and len(trained) < len(drawn)
    assert sorted(trained + carried) == sorted(drawn)
    assert len(set(trained)) == len(trained)
    assert balancer.stats.planned_steps == steps
    balancer.close()


def test_an_unreachable_planner_is_an_error_unless_offline_start_is_allowed():
    with pytest.raises(sb.PlannerError) as error:
        sbt.Balancer(UNREACHABLE, LENGTHS, **small(call_timeout_seconds=0.3))
    assert error.value.unreachable and UNREACHABLE in error.value.message
    warnings = []
    balancer = sbt.Balancer(UNREACHABLE, LENGTHS, allow_offline_start=True, warn=warnings.append,
                            **small(call_timeout_seconds=0.3))
    trained = train(balancer, 3)
    assert [s for s, _ in trained] == [0, 1, 2]
    assert balancer.stats.local_steps == 3
    assert 1 <= len(warnings) <= 2 and UNREACHABLE in warnings[0]  # once a minute, not per step
    assert balancer.close() is True  # offline: nothing to deliver


def test_a_checkpoint_resumes_at_its_step_with_its_carried_documents(planner):
    fields = small(overflow="defer", tokens_per_step=2600, micro_batches=1)
    first = sbt.Balancer(planner.address, LENGTHS, **fields)
    before = train(first, 3)
    state = first.state_dict()
    carried = [i for i, _ in state["carried"]]
    job, token = first.job.job_id, first.job.token
    assert first.close()
    second = sbt.Balancer(planner.address, LENGTHS, job=job, token=token, **fields)
    second.load_state_dict(state)
    after = train(second, 2)
    assert [s for s, _ in after] == [3, 4]
    step3 = [i for mb in after[0][1] for i in mb]
    step4 = [i for mb in after[1][1] for i in mb]
    still = [s.id for s in second.carried]
    # Each carried document is trained in step 3 or 4, or still waits; and step 3 starts with
    # them: the planner places what a step deferred before the new documents.
    assert carried and all(i in step3 or i in step4 or i in still for i in carried)
    assert set(step3) & set(carried)
    trained = [i for _, ids in before + after for mb in ids for i in mb]
    assert len(set(trained)) == len(trained)
    second.close()


def test_a_document_drawn_again_while_carried_is_trained_twice(planner):
    # Ten documents, more tokens drawn a step than the rank holds: each epoch is about two
    # steps, and a new epoch draws documents that the step before deferred. The batch plans an
    # id once, so the new draw waits a step (held) instead of merging with the carried copy:
    # every draw is trained once, or still waits, across a checkpoint too.
    lengths = LENGTHS[:10]
    fields = small(overflow="defer", tokens_per_step=2600, micro_batches=1)
    first = sbt.Balancer(planner.address, lengths, **fields)
    before = []
    while not first.held and len(before) < 30:
        before += train(first, 1)
    assert first.held, "no document was drawn again while carried in 30 steps"
    held = {s.id for s in first.held}
    assert held <= {s.id for s in first.carried}  # each held back because its copy waits
    state = first.state_dict()
    job, token = first.job.job_id, first.job.token
    assert first.close()
    second = sbt.Balancer(planner.address, lengths, job=job, token=token, **fields)
    second.load_state_dict(state)
    assert sorted(s.id for s in second.held) == sorted(held)
    after = train(second, 6)
    steps = len(before) + len(after)
    assert [s for s, _ in before + after] == list(range(steps))
    trained = [i for _, ids in before + after for mb in ids for i in mb]
    waiting = [s.id for s in second.carried] + [s.id for s in second.held]
    drawn = [s.id for k in range(steps) for s in second.global_batch(k)]
    assert sorted(trained + waiting) == sorted(drawn)
    for _, ids in before + after:  # a step trains a document once
        step_ids = [i for mb in ids for i in mb]
        assert len(set(step_ids)) == len(step_ids)
    second.close()


def test_bad_input_names_the_field(planner):
    with pytest.raises(ValueError, match="lengths"):
        sbt.Balancer(planner.address, None)
    with pytest.raises(ValueError, match="planner"):
        sbt.Balancer("", LENGTHS, **small())
    with pytest.raises(ValueError, match="tokens_per_step: 5000 tokens a step do not fit"):
        sbt.Balancer(planner.address, LENGTHS, **small(tokens_per_step=5000, overflow="error"))
    with pytest.raises(ValueError, match="config"):
        sbt.Balancer(planner.address, LENGTHS, config=sb.PlannerConfig(), micro_batches=2)
    warnings = []
    balancer = sbt.Balancer(planner.address, LENGTHS + [5000], warn=warnings.append, **small())
    assert len(warnings) == 1 and "1 documents are longer" in warnings[0] and "[300]" in warnings[0]

    class Short(Tokens):
        def __getitem__(self, i):
            return torch.zeros(LENGTHS[i] - 1)

    with pytest.raises(ValueError, match=r"dataset\[\d+\]: \d+ tokens where lengths"):
        next(balancer.batches(Short(), steps=1))
    balancer2 = sbt.Balancer(planner.address, LENGTHS, **small())
    steps = balancer2.batches(Tokens(), steps=2)
    first = next(steps)
    next(steps)
    with pytest.raises(ValueError, match="mb: micro-batch of step 0"):
        with balancer2.timed(first[0]):
            pass
    balancer2.close()
    balancer.close()


def test_a_dataloader_gets_the_micro_batches_epoch_by_epoch(planner):
    warned = []
    balancer = sbt.Balancer(planner.address, LENGTHS, warn=warned.append, **small())
    planned = balancer.dataset(Tokens())
    loader = torch.utils.data.DataLoader(planned, batch_size=None)
    epoch0 = balancer.sampler.steps_in_epoch(0)
    assert len(loader) == len(planned) == epoch0 * 2
    trained, last_flags = [], []
    for mb in loader:
        assert isinstance(mb, sbt.MicroBatch) and mb.step < epoch0
        with balancer.timed(mb):
            trained += mb.ids
        last_flags.append(mb.last)
    # One epoch: every document once (or still carried into the next epoch's first step), a
    # step ends every 2 micro-batches.
    assert sorted(trained + [s.id for s in balancer.carried]) == list(range(len(LENGTHS)))
    assert last_flags == [False, True] * epoch0
    planned.set_epoch(1)
    assert len(planned) == balancer.sampler.steps_in_epoch(1) * 2
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(torch.utils.data.DataLoader(planned, batch_size=None, num_workers=1)))
    assert balancer.close()
    # Every step's report reached the planner: the loop times every micro-batch, empty ones
    # too, and a report that listed an empty micro-batch used to be refused whole.
    assert not [w for w in warned if "dropped" in w], warned


def test_the_trainers_own_attention_is_profiled_and_uploaded(planner):
    # The trainer's kernel here is a block-sparse one whose time follows the kept blocks (our
    # op); the planner fits its cost model to the table and refuses tables whose time does not
    # grow with density (FlexAttention's unfused CPU path, for one, computes every block).
    from sparsebalance.ops import sparse_attention

    balancer = sbt.Balancer(planner.address, LENGTHS, **small())
    calls = []

    def attention(q, k, v, plan):
        calls.append((q.shape[0], float(plan.densities[0])))
        out, _ = sparse_attention(q, k, v, plan.cu_seqlens.tolist(), plan.densities.tolist(),
                                  block_size=plan.block_size, threads=1)
        return out

    text = balancer.profile(attention, lengths=[512, 1024, 2048], densities=[1.0, 0.1],
                            repeats=3)
    table = sb.parse_profile_table(text)
    grid = {(n, d) for n in (512, 1024, 2048) for d in (1.0, 0.1)}
    assert {(r.length, r.density) for r in table.rows} == grid
    assert set(calls) == grid  # the trainer's callable ran at every grid point
    # Measured, not made up; the times are not compared with each other (a test never compares
    # wall-clock times). The upload inside profile() passed the planner's fit, which refuses
    # times that do not grow with the kept blocks.
    assert all(r.seconds > 0 for r in table.rows)
    balancer.close()


RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import sparsebalance.torch as sbt
    lengths = json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    balancer = sbt.Balancer(sys.argv[1], lengths, capacity=1024, micro_batches=2, layers=1,
                            heads=2, head_dim=64, tokens_per_step=3400)
    out = {"job": balancer.job.job_id, "steps": []}
    for step in balancer.batches(None, steps=4):
        for mb in step:
            with balancer.timed(mb):
                pass
        out["steps"].append({"step": step.step, "ids": [i for mb in step for i in mb.ids],
                             "weights": [mb.loss_weight for mb in step],
                             "batch": [s.id for s in balancer.global_batch(step.step)],
                             "local": step.local})
    out["delivered"] = balancer.close()
    print(json.dumps(out))
    dist.destroy_process_group()
    """)


def _run_ranks(script_text, world, planner, tmp_path, timeout=120):
    """Runs `script_text` as `world` gloo ranks (processes) against `planner`; returns each
    one's last line of output, parsed as JSON, in rank order."""
    script = tmp_path / "rank.py"
    script.write_text(script_text)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), planner.address, json.dumps(LENGTHS)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_two_gloo_ranks_share_one_job_and_split_each_batch(planner, tmp_path):
    results = _run_ranks(RANK_SCRIPT, 2, planner, tmp_path)
    assert results[0]["job"] == results[1]["job"] != ""  # rank 0 created it, rank 1 was told
    for k in range(4):
        a, b = results[0]["steps"][k], results[1]["steps"][k]
        assert a["batch"] == b["batch"] and not a["local"] and not b["local"]
        assert not set(a["ids"]) & set(b["ids"])  # each document on one rank
        assert sorted(a["ids"] + b["ids"]) == sorted(a["batch"])
        # Token weights over both ranks sum to the world size (DDP then averages).
        assert sum(a["weights"]) + sum(b["weights"]) == pytest.approx(2.0)
    assert all(r["delivered"] for r in results)


GROUP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import sparsebalance.torch as sbt
    lengths = json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Data-parallel groups {0, 2} and {1, 3}, as under tensor or pipeline parallelism: each
    # group is one job, and {1, 3} does not hold global rank 0.
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    balancer = sbt.Balancer(sys.argv[1], lengths, group=groups[rank % 2], capacity=1024,
                            micro_batches=2, layers=1, heads=2, head_dim=64, tokens_per_step=3400)
    ids = []
    for step in balancer.batches(None, steps=2):
        ids.append([i for mb in step for i in mb.ids])
        for mb in step:
            with balancer.timed(mb):
                pass
    print(json.dumps({"job": balancer.job.job_id, "rank": balancer.rank, "ids": ids,
                      "delivered": balancer.close()}))
    dist.destroy_process_group()
    """)


def test_a_data_parallel_group_without_global_rank_0_shares_its_own_job(planner, tmp_path):
    # The job was broadcast from global rank 0 whatever the group: ranks 1 and 3 raised
    # "Global rank 0 is not part of group".
    results = _run_ranks(GROUP_SCRIPT, 4, planner, tmp_path)
    assert results[0]["job"] == results[2]["job"] != ""
    assert results[1]["job"] == results[3]["job"] != ""
    assert results[0]["job"] != results[1]["job"]
    assert [r["rank"] for r in results] == [0, 0, 1, 1]  # ranks within their groups
    for a, b in ((0, 2), (1, 3)):
        for k in range(2):
            assert not set(results[a]["ids"][k]) & set(results[b]["ids"][k])
    assert all(r["delivered"] for r in results)


MISMATCH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import sparsebalance.torch as sbt
    lengths = json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Rank 1 passes another seed; or (MISMATCH=room) more tokens a step than the ranks hold,
    # which overflow="error" refuses on that rank alone.
    args = dict(seed=rank, tokens_per_step=3400)
    if os.environ.get("MISMATCH") == "room":
        args = dict(overflow="error", tokens_per_step=5000 if rank == 1 else 3400)
    try:
        sbt.Balancer(sys.argv[1], lengths, capacity=1024, micro_batches=2, layers=1, heads=2,
                     head_dim=64, **args)
        print(json.dumps({"error": None}))
    except ValueError as e:
        print(json.dumps({"error": str(e)}))
    dist.destroy_process_group()
    """)


def test_ranks_with_different_seeds_all_raise(planner, tmp_path):
    # Each rank draws the global batches itself: with different seeds they planned different
    # batches, offline without a word. Every rank raises, none trains.
    results = _run_ranks(MISMATCH_SCRIPT, 2, planner, tmp_path)
    for r in results:
        assert r["error"] and "not the same on every rank" in r["error"], r


def test_a_rank_refusing_its_arguments_at_start_stops_every_rank(planner, tmp_path,
                                                                 monkeypatch):
    # Rank 1's tokens_per_step does not fit the ranks under overflow="error". It raised alone,
    # and rank 0 went on into the next collective of the start-up and waited there for it (a
    # hang until gloo's timeout, or a crash when rank 1's process left). The same check decides
    # max_shards, which UpdateJobConfig can change while the ranks join. Now both raise.
    monkeypatch.setenv("MISMATCH", "room")
    results = _run_ranks(MISMATCH_SCRIPT, 2, planner, tmp_path, timeout=90)
    assert "tokens_per_step: 5000 tokens a step do not fit 2 ranks" in results[1]["error"], results
    assert "another rank refused the job's config" in results[0]["error"], results


NODE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import sparsebalance.torch as sbt
    lengths = json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Two "nodes" of two ranks on this one machine, told apart by their host names; plans by
    # node too when NODE_PLANS is set.
    balancer = sbt.Balancer(sys.argv[1], lengths, capacity=1024, micro_batches=2, layers=1,
                            heads=2, head_dim=64, tokens_per_step=6000, node_reports=True,
                            node_plans=os.environ.get("NODE_PLANS") == "1",
                            host_name=f"node-{rank // 2}")
    steps = []
    for step in balancer.batches(None, steps=4):
        steps.append({"ids": [i for mb in step for i in mb.ids],
                      "local": step.local})
        for mb in step:
            if rank == 3 and step.step == 2:
                continue  # untimed: rank 3 does not report step 2, its node's leader goes on
            with balancer.timed(mb):
                pass
    print(json.dumps({"job": balancer.job.job_id, "delivered": balancer.close(),
                      "dropped": balancer.stats.dropped_reports, "steps": steps}))
    dist.destroy_process_group()
    """)


def _metric(metrics_url, series):
    """The value of `series` (name and labels, as the planner's /metrics writes them); None when
    it is not there."""
    import urllib.request
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line[len(series) + 1:])
    return None


def _rpcs(metrics_url, method, code="OK"):
    return _metric(metrics_url,
                   f'sparsebalance_rpcs_total{{code="{code}",method="{method}"}}') or 0.0


def test_node_reports_go_through_each_nodes_first_rank_in_batches(planner, tmp_path):
    results = _run_ranks(NODE_SCRIPT, 4, planner, tmp_path, timeout=180)
    assert all(r["delivered"] and r["dropped"] == 0 for r in results)
    job = results[0]["job"]
    # A step was folded, which takes every rank's report: both leaders sent their members'.
    # (Steps 0, 1 and 3 have every report; step 2 lacks rank 3's.)
    assert _metric(planner.metrics_url,
                   f'sparsebalance_step_imbalance_ratio{{job_id="{job}"}}') is not None
    # The two leaders sent everything by batches, none refused: no rank called ReportStep but
    # for a lone report (node-1's of step 2, or none when it went with another step's).
    assert 2 <= _rpcs(planner.metrics_url, "ReportStepBatch") <= 8
    assert _rpcs(planner.metrics_url, "ReportStepBatch", "INVALID_ARGUMENT") == 0
    assert _rpcs(planner.metrics_url, "ReportStep") <= 1


def test_node_plans_come_through_each_nodes_first_rank_in_one_call(planner, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("NODE_PLANS", "1")
    results = _run_ranks(NODE_SCRIPT, 4, planner, tmp_path, timeout=180)
    assert all(r["delivered"] and r["dropped"] == 0 for r in results)
    for k in range(4):
        assert not any(r["steps"][k]["local"] for r in results)
        ids = [i for r in results for i in r["steps"][k]["ids"]]
        assert ids and len(ids) == len(set(ids))  # each document of the step on one rank
    # Each node's leader took its node's plans in one call a step; no rank asked for its own.
    assert _rpcs(planner.metrics_url, "GetRankPlans") == 2 * 4
    assert _rpcs(planner.metrics_url, "GetRankPlan") == 0
    assert _rpcs(planner.metrics_url, "ReportStep") <= 1


def test_the_jobs_selection_mode_reaches_the_kernel_plan(planner):
    # The job's config (as the planner stored it) sets the mode mb.attention.select runs.
    balancer = sbt.Balancer(planner.address, LENGTHS,
                            **small(selection="anchor", anchor_threshold=0.25))
    assert (balancer.config.selection.label, balancer.config.anchor_threshold) == ("anchor", 0.25)
    step = next(iter(balancer.batches(Tokens(), steps=1)))
    plans = [mb.attention for mb in step if mb.num_tokens]
    assert plans and all((p.selection_mode, p.anchor_threshold) == ("anchor", 0.25)
                         for p in plans)
    default = sbt.Balancer(planner.address, LENGTHS, **small())
    assert default.config.selection == sb.SelectionMode.TOPK
    step = next(iter(default.batches(Tokens(), steps=1)))
    assert all(mb.attention.selection_mode == "topk" for mb in step)


SHARD_SCRIPT = textwrap.dedent("""
    import json, sys
    import grpc
    import torch, torch.distributed as dist
    import sparsebalance as sb
    import sparsebalance.torch as sbt

    def raise_max_shards(address, job, token, max_shards):
        # UpdateJobConfig(job_id, config.max_shards, update_mask ["max_shards"]) with the job
        # token, encoded by hand: the package ships no Python protobuf stubs.
        def field(number, payload):  # length-delimited, payload below 128 bytes
            return bytes([number << 3 | 2, len(payload)]) + payload
        config = b"\\x88\\x01" + bytes([max_shards])  # JobConfig.max_shards (17), a varint
        request = field(1, job.encode()) + field(2, config) + field(3, field(1, b"max_shards"))
        with grpc.insecure_channel(address) as channel:
            update = channel.unary_unary(
                "/sparsebalance.planner.v1.PlannerService/UpdateJobConfig")
            update(request, metadata=[("authorization", f"Bearer {token}")], timeout=10)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Each step holds about one 30,000-token document among short ones: it fits a micro-batch
    # but costs more than a rank's share, so with max_shards 2 it is split over two ranks.
    lengths = [30000] + [2000] * 8
    balancer = sbt.Balancer(sys.argv[1], lengths * 4, capacity=32768, micro_batches=1,
                            layers=1, heads=2, head_dim=64, tokens_per_step=46000,
                            prefetch=False, measure_recall=False)
    out = {"trained": [], "sharded": [], "error": None}
    try:
        for step in balancer.batches(None, steps=4):
            out["trained"].append(step.step)
            for mb in step:
                out["sharded"] += [s.id for s in mb.samples if s.sharded()]
                with balancer.timed(mb):
                    pass
            if step.step == 0:
                dist.barrier()
                if rank == 0:  # raised at run time, after the check at start
                    raise_max_shards(sys.argv[1], balancer.job.job_id, balancer.job.token, 2)
                dist.barrier()
    except sb.PlannerError as e:
        out["error"] = {"code": str(e.code.value), "message": e.message}
    print(json.dumps(out))
    dist.destroy_process_group()
    """)


def test_a_shard_in_a_plan_is_an_error_on_every_rank(planner, tmp_path):
    # max_shards raised with UpdateJobConfig after start: plans hold shards of split documents,
    # which this trainer ran as the whole document on each rank of the shard's group (trained
    # twice, weighted by its whole length). Every rank raises at the same step instead: the
    # ranks holding a shard name it, the others are aborted rather than wait in a collective.
    results = _run_ranks(SHARD_SCRIPT, 3, planner, tmp_path)
    for r in results:
        assert r["error"] is not None, r
        assert r["sharded"] == [], r  # no rank trained a shard
        assert r["trained"] == results[0]["trained"] and 0 in r["trained"], r
    codes = sorted(r["error"]["code"] for r in results)
    assert "FAILED_PRECONDITION" in codes and set(codes) <= {"FAILED_PRECONDITION", "ABORTED"}
    for r in results:
        if r["error"]["code"] == "FAILED_PRECONDITION":
            message = r["error"]["message"]
            assert f"step {len(r['trained'])}: sample " in message, message
            assert "max_shards was raised above 1" in message, message
            assert "runs documents whole" in message, message
