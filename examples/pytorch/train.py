#!/usr/bin/env python3
"""Distributed training with SparseBalance: a small decoder-only transformer learns passkey
retrieval (a value planted early in a long document must be recalled at its end), with the
global batch of every step planned by sb-planner and attention run block-sparse at the planned
densities. See README.md next to this file.

    PYTHONPATH=build/client/python /usr/bin/python3 examples/pytorch/train.py --ranks=4

Each rank, each step:
  1. draws the same global batch as every other rank (sparsebalance.data.GlobalBatchSampler);
  2. asks TrainerSession for its plan (rank 0 submits the batch); if any rank had to fall back
     to the local plan (planner unreachable), all ranks use the local plan (an all-reduce of the
     fallback flag, as sb-worker does);
  3. runs its micro-batches (forward + backward; documents packed varlen, sparse attention at
     each document's planned density), measuring compute seconds per micro-batch;
  4. all-reduces gradients (the wait: the time spent there, stragglers included) and steps;
  5. reports its timings, recall and achieved density to the planner.
"""

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

# Ranks share the machine's cores: one BLAS thread each (set before torch loads OpenBLAS).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import sparsebalance as sb
except ImportError:  # running from a source checkout with a build tree next to it
    sys.path.insert(0, os.path.join(REPO, "build", "client", "python"))
    try:
        import sparsebalance as sb
    except ImportError as e:
        sys.exit(f"train.py: cannot import sparsebalance ({e}); build it "
                 "(cmake --build build --target sb_python) and set "
                 "PYTHONPATH=build/client/python, or pip install client/python")
from sparsebalance.data import GlobalBatchSampler  # noqa: E402
from sparsebalance.ops import AttentionTimer, sparse_attention, varlen_layout  # noqa: E402


def say(line):
    """One write per line: the ranks share stdout, and a single short write is not interleaved."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# Vocabulary of the passkey task: markers, the values to remember, and filler.
BOS, KEY, QUERY = 0, 1, 2
VALUE_START, NUM_VALUES = 3, 16
FILLER_START = VALUE_START + NUM_VALUES
VOCAB = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--planner", default="",
                   help="sb-planner host:port; empty: rank 0 starts a local sb-planner "
                        "(--planner_binary) for the run")
    p.add_argument("--planner_binary", default="",
                   help="sb-planner to start when --planner is empty (default: $SB_PLANNER, "
                        "PATH, then build/server/sb-planner)")
    p.add_argument("--job", default="", help="join this existing job (with --token_file); "
                   "empty: rank 0 creates one")
    p.add_argument("--token_file", default="", help="file holding the job token (with --job)")
    p.add_argument("--admin_token_file", default="",
                   help="admin token for creating the job, when the planner has one")
    p.add_argument("--ranks", type=int, default=4,
                   help="processes to spawn (ignored under torchrun, which sets WORLD_SIZE)")
    p.add_argument("--steps", type=int, default=40, help="training steps")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="cuda: NCCL and the CUDA kernels (one GPU per rank)")
    p.add_argument("--seed", type=int, default=1, help="data and model seed (same on all ranks)")
    p.add_argument("--docs", type=int, default=20000, help="documents in the synthetic dataset")
    p.add_argument("--min_length", type=int, default=128, help="shortest document (tokens)")
    p.add_argument("--median_length", type=int, default=512, help="median document (tokens)")
    p.add_argument("--capacity", type=int, default=2048,
                   help="micro-batch capacity (tokens); also the longest document")
    p.add_argument("--micro_batches", type=int, default=2, help="micro-batches per rank")
    p.add_argument("--fill", type=float, default=0.75,
                   help="tokens per step as a share of ranks x micro_batches x capacity")
    p.add_argument("--policy", default="sparsebalance", help="planner policy")
    p.add_argument("--density_default", type=float, default=0.3)
    p.add_argument("--density_min", type=float, default=0.1)
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=64, choices=[64, 128])
    p.add_argument("--block_size", type=int, default=64, choices=[64, 128])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--call_timeout", type=float, default=2.0,
                   help="seconds: deadline of planner calls before falling back")
    p.add_argument("--plan_timeout", type=float, default=30.0,
                   help="seconds a rank waits for the coordinator's plan")
    p.add_argument("--eval_docs", type=int, default=64,
                   help="held-out documents rank 0 evaluates at the end (0: none)")
    p.add_argument("--out", default="", help="append one JSON line per rank and step here")
    p.add_argument("--quiet_ranks", action="store_true",
                   help="only rank 0 prints (per-rank timing still goes to --out)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Data: document lengths (long tail) and each document's tokens, derived from its id.

def document_lengths(args):
    g = torch.Generator().manual_seed(args.seed)
    logs = torch.randn(args.docs, generator=g, dtype=torch.float64) * 0.9
    lengths = (args.median_length * torch.exp(logs)).round().long()
    return lengths.clamp(args.min_length, args.capacity).tolist()


def make_document(doc_id, length, seed, repeats=4, part=0):
    """Filler tokens with the pair KEY <value> planted `repeats` times in the first half (the
    passkey is stated a few times, as passkey prompts do) and QUERY as the last token: the model
    must answer <value> there, half a document or more away. `part` numbers the documents of a
    pre-packed sample (0: the sample's first or only document). Returns (tokens, answer)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + doc_id + part * 7_919)
    tokens = torch.randint(FILLER_START, VOCAB, (length,), generator=g)
    value = VALUE_START + int(torch.randint(NUM_VALUES, (1,), generator=g))
    tokens[0] = BOS
    for _ in range(repeats):
        at = 1 + int(torch.randint(max(1, length // 2 - 2), (1,), generator=g))
        tokens[at] = KEY
        tokens[at + 1] = value
    tokens[-1] = QUERY
    return tokens, value


# ---------------------------------------------------------------------------------------------
# Model: pre-norm decoder blocks without positional encoding (causal attention orders tokens).

class Block(nn.Module):
    def __init__(self, dim, head_dim):
        super().__init__()
        self.heads, self.head_dim = dim // head_dim, head_dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cu_seqlens, densities, run):
        tokens = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(tokens, 3, self.heads, self.head_dim).unbind(1)
        attended, recall, selection = sparse_attention(
            q, k, v, cu_seqlens, densities, block_size=run.block_size, threads=run.threads,
            timer=run.timer, return_selection=True)
        run.recalls.append(recall)
        run.densities.append(selection.achieved_density)
        x = x + self.proj(attended.reshape(tokens, -1))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, dim, layers, head_dim):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, head_dim) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens, cu_seqlens, densities, run, positions):
        """Logits at `positions` only (the QUERY tokens): the task's loss needs no others."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cu_seqlens, densities, run)
        return self.head(self.ln(x[positions]))


class RunState:
    """Per micro-batch measurements the attention layers add to."""

    def __init__(self, block_size, threads, clock):
        self.block_size, self.threads = block_size, threads
        self.timer = AttentionTimer(clock)
        self.recalls, self.densities = [], []

    def reset(self):
        self.timer.reset()
        self.recalls, self.densities = [], []


def pack(samples, seed, device):
    """Concatenates planned samples (sb.PlannedSample: id, length, segments, density) varlen,
    every document a sequence of its own (a pre-packed sample's segments included); returns
    tokens, cu_seqlens, answer positions, answers and one density per document."""
    cu, densities = varlen_layout(samples)
    parts, answers = [], []
    for s in samples:
        for part, n in enumerate(s.documents()):
            tokens, answer = make_document(s.id, n, seed, part=part)
            parts.append(tokens)
            answers.append(answer)
    positions = torch.tensor(cu[1:]) - 1
    return (torch.cat(parts).to(device), cu, positions.to(device),
            torch.tensor(answers, device=device), densities)


# ---------------------------------------------------------------------------------------------
# Planner: a local one when none is given; the job; the session.

def find_planner_binary(args):
    for candidate in (args.planner_binary, os.environ.get("SB_PLANNER", ""),
                      shutil.which("sb-planner") or "",
                      os.path.join(REPO, "build", "server", "sb-planner")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("train.py: no sb-planner to start: pass --planner=HOST:PORT, or --planner_binary, "
             "or build it (cmake --build build --target sb-planner)")


def start_local_planner(args):
    state_dir = tempfile.mkdtemp(prefix="sb-example-planner-")
    process = subprocess.Popen(
        [find_planner_binary(args), "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
         f"--state_dir={state_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in process.stdout:
        if "listening on " in line:
            address = line.split("listening on ", 1)[1].split()[0].rstrip(";,")
            break
    else:
        sys.exit("train.py: the local sb-planner did not start")
    # Keep draining its output so that it never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
    return process, address, state_dir


def planner_config(args, world):
    shape = sb.ModelShape(layers=args.layers, heads=args.dim // args.head_dim,
                          head_dim=args.head_dim, block_size=args.block_size, local_blocks=1)
    return sb.PlannerConfig(ranks=world, micro_batches=args.micro_batches,
                            micro_batch_capacity=args.capacity, shape=shape,
                            density_default=args.density_default,
                            density_min=args.density_min, policy=args.policy)


def read_token(path):
    with open(path) as f:
        return f.read().strip()


def setup_job(args, rank, world):
    """Rank 0 starts a planner (when none is given) and creates the job (when none is given);
    everyone learns (address, job id, token). job id None: the planner could not be reached,
    train on local plans."""
    planner_process = state_dir = None
    shared = [None]
    if rank == 0:
        address = args.planner
        if not address:
            planner_process, address, state_dir = start_local_planner(args)
            say(f"train.py: started a local sb-planner on {address}")
        job_id, token = args.job, (read_token(args.token_file) if args.token_file else "")
        if not job_id:
            admin = read_token(args.admin_token_file) if args.admin_token_file else ""
            client = sb.connect(address, admin_token=admin,
                                call_timeout_seconds=args.call_timeout)
            try:
                job = client.create_job(f"pytorch-example-{os.getpid()}",
                                        planner_config(args, world))
                job_id, token = job.job_id, job.token
                say(f"train.py: created job {job_id} on {address}")
            except sb.PlannerError as e:
                if not e.unreachable:
                    raise
                job_id = None
                say(f"train.py: planner {address} unreachable ({e.code}): training on "
                    "local plans")
        shared = [(address, job_id, token)]
    dist.broadcast_object_list(shared, src=0)
    address, job_id, token = shared[0]
    return address, job_id, token, planner_process, state_dir


def make_session(args, rank, world, address, job_id, token):
    """The rank's TrainerSession and config. JoinJob gives the job's config; when the planner is
    unreachable the session starts from the same config built from the flags."""
    client = sb.connect(address, job_id=job_id or "", token=token,
                        call_timeout_seconds=args.call_timeout,
                        plan_timeout_seconds=args.plan_timeout)
    config = planner_config(args, world)
    if job_id:
        try:
            config, _, _ = client.join_job(rank)
        except sb.PlannerError as e:
            if not e.unreachable:
                raise
            say(f"[rank {rank}] JoinJob: planner unreachable ({e.code}); starting on local "
                "plans")
    return client, sb.TrainerSession(client, rank, coordinator=(rank == 0), config=config), config


# ---------------------------------------------------------------------------------------------
# Training.

def all_reduce_max(value, device):
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def train_rank(rank, world, args):
    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # ranks share the machine's cores; kernels use one thread too
    torch.manual_seed(args.seed)
    address, job_id, token, planner_process, state_dir = setup_job(args, rank, world)
    client, session, config = make_session(args, rank, world, address, job_id, token)
    offline = job_id is None

    if config.ranks != world:
        sys.exit(f"train.py: job {job_id} is for {config.ranks} ranks, this run has {world}")
    # The job's config rules (a joined job may differ from the flags): capacity, micro-batches
    # and the attention block size.
    capacity = config.micro_batch_capacity
    lengths = [min(n, capacity) for n in document_lengths(args)]
    tokens_per_step = int(args.fill * world * config.micro_batches * capacity)
    sampler = GlobalBatchSampler(lengths, seed=args.seed, tokens_per_step=tokens_per_step,
                                 max_length=capacity)
    model = Decoder(args.dim, args.layers, args.head_dim).to(device)
    for p in model.parameters():  # identical start on every rank
        dist.broadcast(p.data, src=0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    if device.type == "cuda":
        def clock():
            torch.cuda.synchronize()
            return time.perf_counter()
    else:
        clock = time.thread_time  # this thread's CPU time: fair when ranks share cores
    run = RunState(config.shape.block_size, 1, clock)
    out = open(args.out, "a") if args.out else None
    verbose = rank == 0 or not args.quiet_ranks
    held_out = set(range(args.docs - args.eval_docs, args.docs)) if args.eval_docs else set()

    for step, batch in enumerate(sampler):
        if step >= args.steps:
            break
        step_start = time.perf_counter()
        samples = [s for s in batch.samples() if s.id not in held_out]
        if not samples:  # every rank sees the same batch, so every rank skips it
            continue
        if offline:
            plan = session.local_plan(step, samples)
        else:
            plan = session.plan(step, samples)
            # One plan for all: if any rank fell back, everyone runs the local plan.
            if all_reduce_max(1.0 if plan.local_fallback else 0.0, device) > 0 and \
                    not plan.local_fallback:
                plan = session.local_plan(step, samples)
        plan_seconds = time.perf_counter() - step_start

        timings, loss_sum, correct, docs = [], 0.0, 0, 0
        for m, mb in enumerate(plan.micro_batches):
            if not mb.samples:
                continue
            tokens, cu, positions, answers, densities = pack(mb.samples, args.seed, device)
            run.reset()
            start = clock()
            logits = model(tokens, cu, densities, run, positions)
            loss = F.cross_entropy(logits, answers, reduction="sum")
            loss.backward()  # gradients of the sum; scaled by the global document count below
            compute = clock() - start
            loss_sum += loss.item()
            correct += int((logits.argmax(-1) == answers).sum())
            docs += len(answers)
            timings.append(sb.MicroBatchTiming(
                micro_batch=m, compute_seconds=compute,
                attention_seconds=min(run.timer.seconds, compute), tokens=cu[-1],
                achieved_density=sum(run.densities) / len(run.densities),
                recall=sum(run.recalls) / len(run.recalls)))

        # Gradient all-reduce, with the step's loss figures in the same buffer. Its time is the
        # rank's wait: the slowest rank's compute shows up here.
        wait_start = time.perf_counter()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params] +
                         [torch.tensor([loss_sum, correct, docs], dtype=torch.float32,
                                       device=device)])
        dist.all_reduce(flat)
        wait = time.perf_counter() - wait_start
        total_docs = max(1.0, flat[-1].item())
        global_loss, global_correct = flat[-3].item(), flat[-2].item()
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = (flat[offset:offset + n] / total_docs).view_as(p)
            offset += n
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        reported = False
        if not offline:
            try:
                reported = session.report(step, timings, wait)  # False: kept for later
            except sb.PlannerError as e:
                say(f"[rank {rank}] step {step}: report dropped: {e}")
        compute = sum(t.compute_seconds for t in timings)
        attention = sum(t.attention_seconds for t in timings)
        tokens = sum(t.tokens for t in timings)
        recall = sum(t.recall * t.tokens for t in timings) / tokens if tokens else 1.0
        density = sum(t.achieved_density * t.tokens for t in timings) / tokens if tokens else 1.0
        source = "local" if plan.local_fallback or offline else "planner"
        step_seconds = time.perf_counter() - step_start
        slowest = all_reduce_max(compute, device)
        if verbose:
            say(f"[rank {rank}] step {step:3d} docs {docs:2d} tokens {tokens:5d} "
                f"density {density:.2f} recall {recall:.3f} | compute {compute:.3f}s "
                f"(attention {attention:.3f}s) predicted {plan.predicted_seconds:.3f}s "
                f"wait {wait:.3f}s plan {plan_seconds:.3f}s ({source})")
        if rank == 0:
            say(f"step {step:3d}: loss {global_loss / total_docs:.4f} "
                f"acc {global_correct / total_docs:.3f} docs {int(total_docs)} "
                f"slowest compute {slowest:.3f}s step {step_seconds:.3f}s")
        if out:
            out.write(json.dumps({
                "step": step, "rank": rank, "loss": global_loss / total_docs,
                "accuracy": global_correct / total_docs, "docs": docs, "tokens": tokens,
                "compute_seconds": compute, "attention_seconds": attention,
                "wait_seconds": wait, "plan_seconds": plan_seconds,
                "predicted_seconds": plan.predicted_seconds, "density": density,
                "recall": recall, "local_fallback": source == "local", "reported": reported,
                "step_seconds": step_seconds, "slowest_compute_seconds": slowest}) + "\n")
            out.flush()

    if not offline:
        deadline = time.time() + 10
        while session.buffered_reports > 0 and time.time() < deadline:
            try:
                if not session.flush():
                    time.sleep(0.5)
            except sb.PlannerError:
                break
        if session.buffered_reports > 0:
            say(f"[rank {rank}] {session.buffered_reports} reports not delivered "
                "(planner unreachable)")
    if rank == 0 and held_out:
        evaluate(model, args, config.shape.block_size, sorted(held_out), lengths, device)
    dist.barrier()
    if out:
        out.close()
    if planner_process is not None:
        planner_process.terminate()
        planner_process.wait(timeout=30)
        shutil.rmtree(state_dir, ignore_errors=True)


@torch.no_grad()
def evaluate(model, args, block_size, ids, lengths, device):
    """Held-out accuracy at several fixed densities: what sparsity costs this model."""
    results = []
    for density in (1.0, args.density_default, args.density_min):
        run = RunState(block_size, 1, time.perf_counter)
        correct, recalls = 0, []
        for start in range(0, len(ids), 8):
            chunk = ids[start:start + 8]
            tokens, cu, positions, answers, dens = pack(
                [sb.PlannedSample(id=i, length=lengths[i], density=density) for i in chunk],
                args.seed, device)
            run.reset()
            logits = model(tokens, cu, dens, run, positions)
            correct += int((logits.argmax(-1) == answers).sum())
            recalls.append(sum(run.recalls) / len(run.recalls))
        results.append(f"density {density:.2f}: acc {correct / len(ids):.3f} "
                       f"recall {sum(recalls) / len(recalls):.3f}")
    say(f"eval on {len(ids)} held-out documents: " + "; ".join(results))


def worker(rank, world, args, port):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        train_rank(rank, world, args)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dim % args.head_dim:
        sys.exit(f"--dim={args.dim} must be a multiple of --head_dim={args.head_dim}")
    if args.job and not args.token_file:
        sys.exit("--job needs --token_file (the job token)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            train_rank(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        mp.spawn(worker, args=(args.ranks, args, free_port()), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
