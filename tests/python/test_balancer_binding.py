"""sparsebalance.Balancer (the C++ Balancer's binding) against a real sb-planner: one rank with
prefetch on, start/prefetch/plan/report/finish and resume; the collectives and warn as Python
callables called from C++; an unreachable planner at start; offline start; resume of carried
samples; errors raised by the callables reaching the caller."""

import pytest

import sparsebalance as sb

UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1


def small_config(ranks=1, **fields):
    return sb.PlannerConfig(ranks=ranks, micro_batches=2, micro_batch_capacity=4096,
                            shape=sb.ModelShape(layers=2, heads=2, head_dim=64), **fields)


def batch_of(lengths, first_id=0):
    return [sb.Sample(id=first_id + i, length=n) for i, n in enumerate(lengths)]


def ids_of(plan):
    return sorted(s.id for mb in plan.micro_batches for s in mb.samples)


def timings_of(plan):
    return [sb.MicroBatchTiming(micro_batch=m, compute_seconds=0.01 * (1 + m), tokens=mb.tokens)
            for m, mb in enumerate(plan.micro_batches) if mb.samples]


class Recorder:
    """World-1 collectives and warn that count their calls."""

    def __init__(self):
        self.any_rank_calls = []
        self.shared = []
        self.warnings = []

    fail = None  # an exception any_rank raises

    def any_rank(self, mine):
        if self.fail is not None:
            raise self.fail
        self.any_rank_calls.append(mine)
        return mine

    def share_job(self, job):
        self.shared.append(job)
        return job

    def warn(self, line):
        self.warnings.append(line)

    def options(self, target, **fields):
        return sb.BalancerOptions(
            client=sb.ClientOptions(target=target, call_timeout_seconds=2,
                                    plan_timeout_seconds=20),
            any_rank=self.any_rank, share_job=self.share_job, warn=self.warn, **fields)


def test_round_trip_with_prefetch_then_resume(planner):
    calls = Recorder()
    options = calls.options(planner.address, config=small_config(), job_name="py-balancer",
                            prefetch=True)
    assert options.world == 1 and options.rank == 0 and options.job_id == ""
    balancer = sb.Balancer.start(options)
    job = balancer.job
    assert job.job_id and job.token and balancer.config.ranks == 1 and balancer.next_step == 0
    assert len(calls.shared) == 1 and calls.shared[0].job_id == job.job_id

    steps = 4
    batches = [batch_of([1000, 700, 1500, 300, 2000], first_id=100 * s) for s in range(steps)]
    for step in range(steps):
        if step + 1 < steps:
            balancer.prefetch(step + 1, batches[step + 1])
        plan = balancer.plan(step, batches[step])
        assert isinstance(plan, sb.RankStepPlan) and (plan.step, plan.rank) == (step, 0)
        assert not plan.local_fallback
        assert ids_of(plan) == [s.id for s in batches[step]]  # every sample once
        balancer.report(step, timings_of(plan), 0.0)
    assert balancer.finish(timeout_seconds=20) is True
    # Three collectives at start (errors, unreachable; then the step to start at, one probe:
    # "is any rank's next step below 1", True for a new job), then exactly one per step; nothing
    # fell back.
    assert calls.any_rank_calls == [False, False, True] + [False] * steps
    assert calls.warnings == []
    stats = balancer.stats
    assert isinstance(stats, sb.BalancerStats)
    assert (stats.planned_steps, stats.local_steps) == (steps, 0)
    assert 0 <= stats.prefetched_steps <= steps - 1
    assert (stats.buffered_reports, stats.dropped_reports) == (0, 0)
    assert stats.planner_reachable and stats.plan_wait_seconds >= stats.last_plan_wait_seconds
    assert balancer.next_step == steps and balancer.carried == []
    del balancer

    # A restarted trainer resumes the job where this rank stopped reporting.
    again = Recorder()
    resumed_options = again.options(planner.address, job_id=job.job_id)
    with pytest.raises(sb.PlannerError) as e:  # the job's token is needed
        sb.Balancer.start(resumed_options)
    assert e.value.code in ("PERMISSION_DENIED", "UNAUTHENTICATED")
    resumed_options.client.token = job.token
    resumed = sb.Balancer.start(resumed_options)
    assert resumed.job.job_id == job.job_id and resumed.next_step == steps
    assert resumed.plan(steps, batch_of([100, 200], first_id=1000)).step == steps


def test_unreachable_at_start_raises_unless_offline_start_is_allowed():
    calls = Recorder()
    options = calls.options(UNREACHABLE, config=small_config())
    options.client.call_timeout_seconds = 0.5
    with pytest.raises(sb.PlannerError) as e:
        sb.Balancer.start(options)
    assert e.value.code == "UNAVAILABLE" and UNREACHABLE in e.value.message

    options.allow_offline_start = True
    balancer = sb.Balancer.start(options)
    assert balancer.job.job_id == "" and balancer.config == options.config
    assert len(calls.warnings) == 1 and UNREACHABLE in calls.warnings[0]
    batch = batch_of([1000, 700, 1500, 300])
    balancer.prefetch(0, batch)
    plan = balancer.plan(0, batch)
    assert plan.local_fallback and ids_of(plan) == [s.id for s in batch]
    assert plan.micro_batches == sb.plan_step_locally(batch, options.config).ranks[0].micro_batches
    balancer.report(0, timings_of(plan), 0.0)
    stats = balancer.stats
    assert stats.local_steps == 1 and not stats.planner_reachable and "offline" in stats.last_error
    assert len(calls.warnings) == 2 and "runs on the local plan" in calls.warnings[1]
    assert balancer.finish(timeout_seconds=1) is True  # offline: nothing to send


def test_resume_restores_carried_samples():
    calls = Recorder()
    options = calls.options(UNREACHABLE, config=small_config(overflow="defer"),
                            allow_offline_start=True)
    options.client.call_timeout_seconds = 0.5
    first = sb.Balancer.start(options)
    overfull = batch_of([3000, 3000, 3000, 3000])  # 8192 tokens of room: one is deferred
    plan = first.plan(0, overfull)
    assert plan.deferred_ids
    carried = first.carried
    assert sorted(s.id for s in carried) == sorted(plan.deferred_ids)
    checkpoint = (first.next_step, carried)
    del first

    second = sb.Balancer.start(options)
    assert second.carried == []
    second.resume(*checkpoint)
    assert second.next_step == 1 and second.carried == carried
    fresh = batch_of([500, 600], first_id=50)
    plan = second.plan(1, fresh)
    assert ids_of(plan) == sorted([s.id for s in carried] + [s.id for s in fresh])


def test_an_error_in_a_callable_reaches_the_caller(planner):
    calls = Recorder()
    options = calls.options(planner.address, config=small_config())
    balancer = sb.Balancer.start(options)

    # The collective of step 0 fails: plan raises it, and the step is not final; a retry of the
    # step plans it again (the planner has it already: the same plan).
    calls.fail = RuntimeError("the process group is gone")
    batch = batch_of([100, 200])
    with pytest.raises(RuntimeError, match="process group is gone"):
        balancer.plan(0, batch)
    assert balancer.stats.planned_steps == 0
    calls.fail = None
    plan = balancer.plan(0, batch)
    assert not plan.local_fallback and ids_of(plan) == [0, 1]
    assert balancer.stats.planned_steps == 1

    calls.fail = RuntimeError("the process group is gone")
    with pytest.raises(RuntimeError, match="process group is gone"):
        sb.Balancer.start(options)
    with pytest.raises(sb.PlannerError) as e:
        sb.Balancer.start(sb.BalancerOptions(world=2, rank=1))
    assert e.value.code == "INVALID_ARGUMENT" and "any_rank" in e.value.message


def test_plans_through_a_group_leader_call_the_scatter_from_cpp(planner):
    # A group of one: its leader fetches the group's plans in one GetRankPlans call and hands
    # them out through the Python scatter (its own payload comes back to it).
    calls = Recorder()
    handed = []

    def scatter(payloads):
        handed.append(payloads)
        return payloads[0]

    options = calls.options(planner.address, config=small_config(), prefetch=False,
                            plan_group=[0], scatter_plans=scatter)
    assert options.plan_group == [0] and options.scatter_plans is not None
    balancer = sb.Balancer.start(options)
    for step in range(2):
        plan = balancer.plan(step, batch_of([1000, 700, 1500], first_id=10 * step))
        assert not plan.local_fallback and ids_of(plan) == [10 * step, 10 * step + 1,
                                                            10 * step + 2]
    assert handed == [[b""], [b""]]
    balancer.finish(5)
    with pytest.raises(TypeError, match="scatter_plans"):
        sb.BalancerOptions(scatter_plans=42)
    with pytest.raises(sb.PlannerError) as e:
        sb.Balancer.start(calls.options(planner.address, config=small_config(),
                                        plan_group=[1], scatter_plans=scatter))
    assert e.value.code == "INVALID_ARGUMENT" and "plan_group[0]" in e.value.message
    # The scatter's own errors reach the caller of plan().
    failing = calls.options(planner.address, config=small_config(), prefetch=False,
                            plan_group=[0],
                            scatter_plans=lambda payloads: (_ for _ in ()).throw(
                                RuntimeError("the node group is gone")))
    balancer = sb.Balancer.start(failing)
    with pytest.raises(RuntimeError, match="node group is gone"):
        balancer.plan(0, batch_of([100, 200]))
