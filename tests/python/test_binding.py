"""The sparsebalance binding against a real sb-planner: job round trip, the plan types, errors
with their gRPC codes, the TrainerSession fallback, the GIL released while calls block, and the
module living in one process with the `grpc` and `torch` packages."""

import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import sparsebalance as sb

UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1


def small_config(ranks=2):
    return sb.PlannerConfig(ranks=ranks, micro_batches=2, micro_batch_capacity=4096,
                            shape=sb.ModelShape(layers=2, heads=2, head_dim=64))


def batch_of(lengths, first_id=0):
    return [sb.Sample(id=first_id + i, length=n) for i, n in enumerate(lengths)]


def placed_ids(plans):
    return sorted(s.id for p in plans for mb in p.micro_batches for s in mb.samples)


def test_plan_types_read_like_dataclasses():
    s = sb.Sample(id=7, length=4096, sensitivity=0.5)
    assert (s.id, s.length, s.sensitivity, s.group, s.segments) == (7, 4096, 0.5, 0, [])
    assert s == sb.Sample(id=7, length=4096, sensitivity=0.5) and s != sb.Sample(id=8)
    assert repr(s).startswith("Sample(id=7, length=4096")
    config = sb.PlannerConfig(ranks=4, policy="tokens", dst_mode="max", overflow="defer")
    assert config.policy == sb.Policy.TOKENS and config.policy.label == "tokens"
    assert config.dst_mode == sb.DstMode.MAX and config.overflow == sb.OverflowPolicy.DEFER
    config.shape.layers = 3  # nested records edit in place
    assert config.shape.layers == 3
    assert pickle.loads(pickle.dumps(config)) == config
    assert "secret" not in repr(sb.ClientOptions(token="secret", admin_token="secret"))
    with pytest.raises(TypeError, match="unknown field 'lenght'"):
        sb.Sample(lenght=3)
    with pytest.raises(sb.PlannerError) as e:
        sb.PlannerConfig(policy="fastest")
    assert e.value.code == "INVALID_ARGUMENT"
    assert sb.policies()[-1] == sb.Policy.SPARSEBALANCE
    p = sb.PlannedSample(id=3, length=100, density=0.5, segments=[60, 40])
    assert (p.id, p.length, p.density, p.segments, p.layer_densities) == (3, 100, 0.5, [60, 40], [])
    assert p.documents() == [60, 40] and sb.PlannedSample(length=7).documents() == [7]
    assert sb.MicroBatchPlan(samples=[p]).samples == [p]


def test_shard_fields_read_and_set_like_the_other_fields():
    # A shard of a document split over ranks [2, 0, 3]: this rank (0) runs tokens [384, 768).
    p = sb.PlannedSample(id=5, length=1000, density=0.25, shard_begin=384, shard_end=768,
                         shard_index=1, shard_group=[2, 0, 3])
    assert (p.shard_begin, p.shard_end, p.shard_index, p.shard_group) == (384, 768, 1, [2, 0, 3])
    assert p.sharded() and p.query_tokens() == 384 and p.documents() == [1000]
    whole = sb.PlannedSample(id=6, length=200, density=0.5)
    assert not whole.sharded() and whole.query_tokens() == 200 and whole.shard_group == []
    assert pickle.loads(pickle.dumps(p)) == p and p != whole
    assert "shard_group=[2, 0, 3]" in repr(p)
    config = sb.PlannerConfig(ranks=4, max_shards=4, shard_policy="static", shard_min_length=2048)
    assert (config.max_shards, config.shard_min_length) == (4, 2048)
    assert config.shard_policy == sb.ShardPolicy.STATIC and config.shard_policy.label == "static"
    config.shard_policy = "dense"
    assert config.shard_policy == sb.ShardPolicy.DENSE
    assert sb.PlannerConfig().max_shards == 1 and sb.PlannerConfig().shard_policy.label == "sparse"
    config.validate()
    config.max_shards = 5  # above the world size
    with pytest.raises(sb.PlannerError, match="config.max_shards") as e:
        config.validate()
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(sb.PlannerError):
        sb.PlannerConfig(shard_policy="ring")
    t = sb.MicroBatchTiming(compute_seconds=1.0, exchange_seconds=0.25)
    assert t.exchange_seconds == 0.25 and sb.MicroBatchTiming().exchange_seconds == 0.0


def test_shard_settings_and_exchange_times_cross_the_wire(planner):
    client = sb.connect(planner.address, call_timeout_seconds=5)
    config = small_config(ranks=2)
    config.max_shards = 2
    config.shard_policy = "static"
    config.shard_min_length = 4096  # no document of the batch below is that long: none split
    job = client.create_job("cp-binding-test", config)
    assert (job.config.max_shards, job.config.shard_policy.label,
            job.config.shard_min_length) == (2, "static", 4096)
    joined, _, _ = client.join_job(0)
    assert joined == job.config
    rank1 = sb.connect(planner.address, job_id=job.job_id, token=job.token)
    rank1.join_job(1)
    assert client.submit_batch(0, batch_of([1000, 500, 300])) == []
    plans = [client.get_rank_plan(0, 0, world_size=2, block_size=64), rank1.get_rank_plan(0, 1)]
    for rank, (c, plan) in enumerate(zip((client, rank1), plans)):
        timings = [sb.MicroBatchTiming(micro_batch=m, compute_seconds=0.5, tokens=mb.tokens)
                   for m, mb in enumerate(plan.micro_batches) if mb.samples]
        assert not any(s.sharded() for mb in plan.micro_batches for s in mb.samples)
        # An exchange time where no shard was planned is refused, naming the field; the rank
        # stays unreported and its good report is then accepted.
        timings[0].exchange_seconds = 0.1
        with pytest.raises(sb.PlannerError, match=r"micro_batches\[0\]\.exchange_seconds") as e:
            c.report_step(0, rank, timings, wait_seconds=0.0)
        assert e.value.code == "INVALID_ARGUMENT"
        timings[0].exchange_seconds = 0.0
        assert c.report_step(0, rank, timings, wait_seconds=0.0) is False
    config.max_shards = 3  # above the world size
    with pytest.raises(sb.PlannerError, match="config.max_shards") as e:
        client.create_job("too-wide", config)
    assert e.value.code == "INVALID_ARGUMENT"


def test_round_trip_create_join_submit_plan_report(planner):
    client = sb.connect(planner.address, call_timeout_seconds=5)
    job = client.create_job("binding-test", small_config(), history_steps=16)
    assert job.job_id and job.token and job.config.ranks == 2
    assert client.options.job_id == job.job_id  # the client now speaks for the job
    config, next_step, rank_next_step = client.join_job(0)
    assert (config, next_step, rank_next_step) == (job.config, 0, 0)
    # A second process-like client per rank, as a trainer would have.
    rank1 = sb.connect(planner.address, job_id=job.job_id, token=job.token)
    rank1.join_job(1)

    batch = batch_of([3000, 1000, 500, 2500, 800, 1200, 300, 2000])
    batch[3].segments = [500, 1500, 500]  # a pre-packed sample
    by_id = {s.id: s for s in batch}
    assert client.submit_batch(0, batch) == []
    plans = [client.get_rank_plan(0, 0), rank1.get_rank_plan(0, 1)]
    assert placed_ids(plans) == [s.id for s in batch]  # every sample exactly once
    for rank, plan in enumerate(plans):
        assert (plan.step, plan.rank, plan.local_fallback) == (0, rank, False)
        assert len(plan.micro_batches) == 2
        for mb in plan.micro_batches:
            for s in mb.samples:  # a planned sample carries what the rank needs to run it
                assert config.density_min <= s.density <= config.density_max
                assert (s.length, s.segments) == (by_id[s.id].length, by_id[s.id].segments)
                assert s.documents() == (s.segments or [s.length])
            assert mb.tokens == sum(s.length for s in mb.samples) <= 4096
    # Resubmitting the same batch is harmless and returns the same answer.
    assert client.submit_batch(0, batch) == []
    assert client.get_rank_plan(0, 0) == plans[0]

    for rank, (c, plan) in enumerate(zip((client, rank1), plans)):
        timings = [sb.MicroBatchTiming(micro_batch=m, compute_seconds=0.5, attention_seconds=0.2,
                                       tokens=mb.tokens, achieved_density=0.3, recall=0.9)
                   for m, mb in enumerate(plan.micro_batches) if mb.samples]
        assert c.report_step(0, rank, timings, wait_seconds=0.1) is False
        assert c.report_step(0, rank, timings, wait_seconds=0.1) is True  # a repeat
    # Both ranks' plans in one call, and both reports again in one call (repeats).
    assert client.get_rank_plans(0, [1, 0]) == [plans[1], plans[0]]
    node = [sb.RankStepReport(step=0, rank=rank, wait_seconds=0.1, micro_batches=[
        sb.MicroBatchTiming(micro_batch=m, compute_seconds=0.5, attention_seconds=0.2,
                            tokens=mb.tokens, achieved_density=0.3, recall=0.9)
        for m, mb in enumerate(plan.micro_batches) if mb.samples]) for rank, plan in enumerate(plans)]
    assert client.report_step_batch(node) == [True, True]
    node[1].rank = 5
    with pytest.raises(sb.PlannerError, match=r"reports\[1\] \(step 0, rank 5\): rank: 5"):
        client.report_step_batch(node)

    # The step helper: coordinator submits, both get plans, both report.
    config = job.config
    sessions = [sb.TrainerSession(client, 0, True, config), sb.TrainerSession(rank1, 1, False,
                                                                               config)]
    step1 = batch_of([1000, 2000, 3000, 400], first_id=100)
    plans = [s.plan(1, step1) for s in sessions]
    assert placed_ids(plans) == [s.id for s in step1]
    assert not any(p.local_fallback for p in plans)
    for s, plan in zip(sessions, plans):
        timings = [sb.MicroBatchTiming(micro_batch=m, compute_seconds=0.1, tokens=mb.tokens)
                   for m, mb in enumerate(plan.micro_batches) if mb.samples]
        assert s.report(1, timings, 0.0) is True and s.buffered_reports == 0
    with pytest.raises(sb.PlannerError) as e:  # a profile table that does not parse
        client.upload_profile("not a profile")
    assert e.value.code == "INVALID_ARGUMENT"
    client.delete_job(job.job_id)
    with pytest.raises(sb.PlannerError) as e:
        rank1.get_rank_plan(1, 1)
    assert e.value.code in ("NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED")


def test_errors_carry_the_grpc_code_and_name_the_field(planner):
    client = sb.connect(planner.address, call_timeout_seconds=5)
    job = client.create_job("errors-test", small_config())
    client.join_job(0)

    with pytest.raises(sb.PlannerError) as e:  # a bad batch: names the sample and field
        client.submit_batch(0, [sb.Sample(id=1, length=100), sb.Sample(id=2, length=0)])
    assert e.value.code == sb.StatusCode.INVALID_ARGUMENT == "INVALID_ARGUMENT"
    assert e.value.code_number == 3 and int(e.value.code) == 3
    assert "samples[1]" in e.value.message and not e.value.unreachable

    with pytest.raises(sb.PlannerError) as e:  # a sample longer than the micro-batch capacity
        client.submit_batch(0, [sb.Sample(id=1, length=5000)])
    assert e.value.code == "INVALID_ARGUMENT" and "samples[0]" in e.value.message

    with pytest.raises(sb.PlannerError) as e:  # out of order: step 5 before step 0
        client.submit_batch(5, batch_of([100, 200]))
    assert e.value.code == "FAILED_PRECONDITION" and "out of order" in e.value.message

    wrong = sb.connect(planner.address, job_id=job.job_id, token="not-the-token")
    with pytest.raises(sb.PlannerError) as e:
        wrong.join_job(0)
    assert e.value.code in ("PERMISSION_DENIED", "UNAUTHENTICATED")

    unknown = sb.connect(planner.address, job_id="no-such-job", token=job.token)
    with pytest.raises(sb.PlannerError) as e:
        unknown.join_job(0)
    assert e.value.code in ("NOT_FOUND", "PERMISSION_DENIED")

    with pytest.raises(sb.PlannerError) as e:  # an invalid config is refused before the wire
        client.create_job("bad", sb.PlannerConfig(ranks=0))
    assert e.value.code == "INVALID_ARGUMENT" and "world_size" in e.value.message

    # Exceptions pickle (e.g. across torch.multiprocessing) with their code.
    again = pickle.loads(pickle.dumps(e.value))
    assert isinstance(again, sb.PlannerError) and again.code == "INVALID_ARGUMENT"


def test_unreachable_planner_falls_back_to_the_local_plan():
    client = sb.connect(UNREACHABLE, job_id="j", token="t", call_timeout_seconds=1)
    with pytest.raises(sb.PlannerError) as e:
        client.join_job(0)
    assert e.value.code == "UNAVAILABLE" and e.value.unreachable

    config = small_config()
    batch = batch_of([3000, 1000, 500, 2500, 800, 1200])
    expected = sb.plan_step_locally(batch, config)
    assert expected.planned_locally
    for rank in range(2):
        session = sb.TrainerSession(client, rank, rank == 0, config)
        plan = session.plan(0, batch)
        assert plan.local_fallback
        assert plan.micro_batches == expected.ranks[rank].micro_batches
        assert session.local_plan(0, batch) == plan
        assert session.report(0, [sb.MicroBatchTiming(micro_batch=0, tokens=1)], 0.0) is False
        assert session.buffered_reports == 1
        assert session.flush() is False  # still away: kept
    with pytest.raises(sb.PlannerError) as e:  # a bad batch fails locally too
        sb.TrainerSession(client, 0, True, config).plan(0, [sb.Sample(id=1, length=-1)])
    assert e.value.code == "INVALID_ARGUMENT"


def test_a_session_without_a_client_is_a_type_error_not_a_crash():
    # None for the client was a null PlannerClient* in C++: the first call crashed the process.
    with pytest.raises(TypeError):
        sb.TrainerSession(None, 0, True, small_config())
    with pytest.raises(TypeError):
        sb.TrainerSession(client=None, rank=0, coordinator=True, config=small_config())


def test_blocking_calls_release_the_gil(planner):
    client = sb.connect(planner.address, plan_timeout_seconds=1.5)
    client.create_job("gil-test", small_config())
    client.join_job(0)
    ticks = [0]
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(sb.PlannerError) as e:  # step 0 is never submitted: waits, times out
            client.get_rank_plan(0, 0)
    finally:
        done.set()
        thread.join()
    assert e.value.code == "DEADLINE_EXCEEDED" and e.value.unreachable
    assert time.monotonic() - start >= 1.0
    # Holding the GIL for 1.5 s would have left the counter near zero.
    assert ticks[0] > 10000


IMPORT_ORDERS = [
    ("grpc", "torch", "sparsebalance"),
    ("sparsebalance", "grpc", "torch"),
    ("torch", "sparsebalance", "grpc"),
]


@pytest.mark.parametrize("order", IMPORT_ORDERS, ids=["-".join(o) for o in IMPORT_ORDERS])
def test_shares_a_process_with_grpc_and_torch(planner, order):
    for name in order:
        if name != "sparsebalance" and importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (python3-grpcio, python3-torch)")
    script = textwrap.dedent(f"""
        {"; ".join(f"import {name}" for name in order)}
        import sparsebalance as sb
        # Python gRPC (its own core) and the C++ client (system gRPC) in one process.
        channel = grpc.insecure_channel("{planner.address}")
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"", timeout=5) is not None
        client = sb.connect("{planner.address}")
        job = client.create_job("import-order", sb.PlannerConfig(ranks=1))
        client.join_job(0)
        client.submit_batch(0, [sb.Sample(id=1, length=500)])
        assert [s.id for s in client.get_rank_plan(0, 0).micro_batches[0].samples] == [1]
        from sparsebalance.ops import sparse_attention
        q = torch.randn(130, 1, 64, requires_grad=True)
        out, recall = sparse_attention(q, q, q, [0, 130], [1.0])
        out.sum().backward()
        assert recall == 1.0 and q.grad is not None
        channel.close()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_a_session_carries_deferred_samples_into_the_next_step():
    # overflow=defer: what does not fit step 0 is planned first in step 1, never dropped.
    config = sb.PlannerConfig(ranks=1, micro_batches=1, micro_batch_capacity=1000,
                              overflow="defer")
    client = sb.connect("127.0.0.1:1", call_timeout_seconds=0.2)
    session = sb.TrainerSession(client, 0, coordinator=True, config=config)
    first = session.local_plan(0, [sb.Sample(id=i, length=400) for i in range(4)])
    kept = [s.id for mb in first.micro_batches for s in mb.samples]
    assert len(kept) == 2 and sorted(first.deferred_ids) == sorted({0, 1, 2, 3} - set(kept))
    assert sorted(s.id for s in session.carried) == sorted(first.deferred_ids)
    second = session.local_plan(1, [sb.Sample(id=9, length=100)])
    trained = [s.id for mb in second.micro_batches for s in mb.samples]
    assert sorted(trained) == sorted(list(first.deferred_ids) + [9]) and not session.carried
