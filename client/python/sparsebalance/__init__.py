"""SparseBalance for PyTorch trainers.

The planner client (Balancer: a rank's whole flow in one object, with plan prefetch; or its
parts PlannerClient and TrainerSession with its offline fallback), the plan types,
the block-sparse attention kernels (``sparsebalance.ops.sparse_attention``, needs torch) and a
global batch sampler that every rank computes alike (``sparsebalance.data``). See README.md::

    import sparsebalance as sb
    client = sb.PlannerClient(sb.ClientOptions(target="planner:50151", job_id=job, token=token))
    config, next_step, _ = client.join_job(rank)
    session = sb.TrainerSession(client, rank, coordinator=(rank == 0), config=config)
    plan = session.plan(step, [sb.Sample(id=i, length=n) for i, n in zip(ids, lengths)])

Errors raise PlannerError / KernelError carrying the gRPC code (``e.code == "NOT_FOUND"``).
"""

from ._errors import Error, KernelError, PlannerError, StatusCode
from ._C import (
    Balancer,
    BalancerOptions,
    BalancerStats,
    ClientOptions,
    DstMode,
    JobHandle,
    MicroBatchPlan,
    MicroBatchTiming,
    ModelShape,
    OverflowPolicy,
    PlannerClient,
    ProfileBreakdown,
    ProfileRow,
    ProfileTable,
    PlannedSample,
    PlannerConfig,
    Policy,
    RankPlan,
    RankStepPlan,
    RankStepReport,
    Sample,
    SelectionMode,
    ShardPolicy,
    StepPlan,
    TrainerSession,
    format_profile_table,
    parse_profile_table,
    plan_step_locally,
    policies,
    validate_batch,
)

__version__ = "0.2.0"

__all__ = [
    "Balancer",
    "BalancerOptions",
    "BalancerStats",
    "ClientOptions",
    "DstMode",
    "Error",
    "JobHandle",
    "KernelError",
    "MicroBatchPlan",
    "MicroBatchTiming",
    "ModelShape",
    "OverflowPolicy",
    "PlannerClient",
    "ProfileBreakdown",
    "ProfileRow",
    "ProfileTable",
    "PlannedSample",
    "PlannerConfig",
    "PlannerError",
    "Policy",
    "RankPlan",
    "RankStepPlan",
    "RankStepReport",
    "Sample",
    "SelectionMode",
    "ShardPolicy",
    "StatusCode",
    "StepPlan",
    "TrainerSession",
    "connect",
    "format_profile_table",
    "parse_profile_table",
    "plan_step_locally",
    "policies",
    "validate_batch",
]


def connect(target, **fields):
    """A PlannerClient for ``target`` ("host:port"); ``fields`` set the other ClientOptions
    (job_id, token, admin_token, call_timeout_seconds, ...)."""
    return PlannerClient(ClientOptions(target=target, **fields))
