#!/usr/bin/env python3
"""Distributed training with SparseBalance: a small decoder-only transformer learns passkey
retrieval (a value planted early in a long document must be recalled at its end) with DDP, its
attention a FlexAttention kernel restricted to the block masks of the planner's densities. See
README.md next to this file.

    build/server/sb-planner --listen=127.0.0.1:50151 &
    PYTHONPATH=build/client/python .venv/bin/torchrun --nproc-per-node=4 \\
        examples/pytorch/train.py --planner=127.0.0.1:50151

The lines that are SparseBalance's end in "# SB" (README counts them): the trainer gives the
Balancer the dataset's lengths, iterates its steps, times each micro-batch, weights the loss,
and hands the model the plan's block masks. Everything else is an ordinary DDP trainer.
"""

import argparse
import contextlib
import json
import os
import sys
import time

# Ranks share the machine's cores: one thread each (set before torch starts its pools).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import sparsebalance.torch as sbt  # noqa: E402  # SB
from sparsebalance.attention import flex_attention  # noqa: E402  # SB (torch's, CPU backward on)


def say(line):
    """One write per line: the ranks share stdout, and a single short write is not interleaved."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# Vocabulary of the passkey task: markers, the values to remember, and filler.
BOS, KEY, QUERY = 0, 1, 2
VALUE_START, NUM_VALUES = 3, 16
FILLER_START = VALUE_START + NUM_VALUES
VOCAB = 64
IGNORE = -100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--planner", default=os.environ.get("SPARSEBALANCE_PLANNER", ""),
                   help="sb-planner host:port (default: $SPARSEBALANCE_PLANNER)")
    p.add_argument("--offline", action="store_true",
                   help="start even when the planner cannot be reached (local plans)")
    p.add_argument("--no_prefetch", action="store_true",
                   help="plan each step when it starts, not while the previous one trains")
    p.add_argument("--by_node", action="store_true",
                   help="each node's first rank fetches the node's plans and sends its reports, "
                        "one call each a step (node_plans, node_reports): less planner CPU")
    p.add_argument("--ranks", type=int, default=4,
                   help="processes to spawn when not started by torchrun")
    p.add_argument("--steps", type=int, default=40, help="training steps")
    p.add_argument("--seed", type=int, default=1, help="data and model seed (same on all ranks)")
    p.add_argument("--docs", type=int, default=20000, help="documents in the synthetic dataset")
    p.add_argument("--min_length", type=int, default=64, help="shortest document (tokens)")
    p.add_argument("--median_length", type=int, default=256, help="median document (tokens)")
    p.add_argument("--capacity", type=int, default=1024,
                   help="micro-batch capacity (tokens); also the longest document")
    p.add_argument("--micro_batches", type=int, default=2, help="micro-batches per rank")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=64, choices=[64, 128])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval_docs", type=int, default=64,
                   help="held-out documents rank 0 evaluates (dense attention) at the end")
    p.add_argument("--out", default="", help="append one JSON line per rank and step here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Data: document lengths (long tail) and each document's tokens, derived from its id.

class PasskeyDataset(torch.utils.data.Dataset):
    """Document i: filler with the pair KEY <value> planted four times in its first half and
    QUERY as its last token; the target there is <value> (IGNORE elsewhere)."""

    def __init__(self, docs, seed, min_length, median_length, capacity, first_id=0):
        g = torch.Generator().manual_seed(seed + first_id)
        logs = torch.randn(docs, generator=g, dtype=torch.float64) * 0.9
        self.lengths = (median_length * torch.exp(logs)).round().long() \
            .clamp(min_length, capacity).tolist()
        self.seed, self.first_id = seed, first_id

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = self.lengths[i]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_id + i)
        tokens = torch.randint(FILLER_START, VOCAB, (n,), generator=g)
        value = VALUE_START + int(torch.randint(NUM_VALUES, (1,), generator=g))
        tokens[0] = BOS
        for _ in range(4):
            at = 1 + int(torch.randint(max(1, n // 2 - 2), (1,), generator=g))
            tokens[at], tokens[at + 1] = KEY, value
        tokens[-1] = QUERY
        targets = torch.full((n,), IGNORE)
        targets[-1] = value
        return {"tokens": tokens, "targets": targets}


# ---------------------------------------------------------------------------------------------
# Model: pre-norm decoder blocks without positional encoding (causal attention orders tokens).
# `mask_of(q, k)` gives each layer's FlexAttention BlockMask for the packed documents.

class Block(nn.Module):
    def __init__(self, dim, head_dim):
        super().__init__()
        self.heads, self.head_dim = dim // head_dim, head_dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask_of):
        n = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(n, 3, self.heads, self.head_dim).unbind(1)
        mask = mask_of(q.detach(), k.detach())
        # FlexAttention's layout: [batch 1, heads, tokens, head_dim].
        out = flex_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                             block_mask=mask)
        x = x + self.proj(out.squeeze(0).transpose(0, 1).reshape(n, -1))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, dim, layers, head_dim):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, head_dim) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens, mask_of):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask_of)
        return self.head(self.ln(x))


def document_mask(cu_seqlens):
    """Dense causal attention inside each packed document (torch's own create_block_mask)."""
    doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (kv <= q)

    n = int(cu_seqlens[-1])
    return lambda q, k: create_block_mask(mask_mod, None, None, n, n, device="cpu")


# ---------------------------------------------------------------------------------------------
# Training.

def train(args):
    torch.manual_seed(args.seed)
    dataset = PasskeyDataset(args.docs, args.seed, args.min_length, args.median_length,
                             args.capacity)
    shape = dict(layers=args.layers, heads=args.dim // args.head_dim, head_dim=args.head_dim)
    balancer = sbt.Balancer(args.planner, dataset.lengths, seed=args.seed, **shape,  # SB
                            capacity=args.capacity, micro_batches=args.micro_batches,  # SB
                            allow_offline_start=args.offline, prefetch=not args.no_prefetch,  # SB
                            node_plans=args.by_node, node_reports=args.by_node)  # SB (optional)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(Decoder(args.dim, args.layers, args.head_dim))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    out = open(args.out, "a") if args.out else None
    start, plan_waits, local_steps = time.perf_counter(), [], 0

    for step in balancer.batches(dataset, steps=args.steps):  # SB
        step_start = time.perf_counter()
        loss_sum = torch.zeros(3)  # loss x documents, correct answers, documents (this rank)
        for i, mb in enumerate(step):
            # DDP all-reduces the gradients with the last micro-batch's backward.
            sync = contextlib.nullcontext() if i == len(step) - 1 else model.no_sync()
            with balancer.timed(mb), sync:  # SB
                logits = model(mb.tokens["tokens"], mb.attention.block_mask)  # SB
                targets = mb.tokens["targets"]
                loss = F.cross_entropy(logits, targets, ignore_index=IGNORE)
                (loss * mb.document_weight).backward()  # SB
            answered = targets != IGNORE
            docs = int(answered.sum())
            loss_sum += torch.tensor([loss.item() * docs, float(
                (logits[answered].argmax(-1) == targets[answered]).sum()), docs])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        plan_waits.append(step.plan_wait_seconds)
        local_steps += step.local

        dist.all_reduce(loss_sum)
        loss, accuracy = (loss_sum[:2] / loss_sum[2].clamp(min=1)).tolist()
        if rank == 0:
            say(f"step {step.step:3d}: loss {loss:.4f} acc {accuracy:.3f} docs "
                f"{int(loss_sum[2])} plan wait {step.plan_wait_seconds * 1e3:.1f} ms"
                f"{' (local plan)' if step.local else ''} "
                f"step {time.perf_counter() - step_start:.3f}s")
        if out:
            out.write(json.dumps({
                "step": step.step, "rank": rank, "loss": loss, "accuracy": accuracy,
                "docs": sum(len(mb.densities) for mb in step),
                "tokens": sum(mb.num_tokens for mb in step),
                "densities": [d for mb in step for d in mb.densities],
                "local": step.local, "plan_wait_seconds": step.plan_wait_seconds}) + "\n")
            out.flush()

    elapsed = time.perf_counter() - start
    delivered = balancer.close()  # SB
    if rank == 0:
        later = sorted(plan_waits[1:]) or [0.0]  # the first step is never prefetched
        say(f"{args.steps} steps in {elapsed:.1f} s: {args.steps / elapsed:.2f} steps/s; a step "
            f"waited {later[len(later) // 2] * 1e3:.2f} ms for its plan (median; the first "
            f"{plan_waits[0] * 1e3 if plan_waits else 0:.1f} ms; "
            f"{'no prefetch' if args.no_prefetch else 'prefetch'}); {local_steps} steps on "
            f"local plans; reports delivered: {delivered}")
    if rank == 0 and args.eval_docs:
        evaluate(model.module, args)
    if out:
        out.close()


@torch.no_grad()
def evaluate(model, args):
    """Held-out accuracy with dense attention (documents the training never saw)."""
    held_out = PasskeyDataset(args.eval_docs, args.seed, args.min_length, args.median_length,
                              args.capacity, first_id=args.docs)
    correct = 0
    for i in range(len(held_out)):
        item = held_out[i]
        cu = torch.tensor([0, len(item["tokens"])], dtype=torch.int32)
        logits = model(item["tokens"], document_mask(cu))
        correct += int(logits[-1].argmax() == item["targets"][-1])
    say(f"eval on {len(held_out)} held-out documents (dense attention): accuracy "
        f"{correct / len(held_out):.3f}")


def run_rank(rank, world, port, args):
    """One process of a run started without torchrun: torchrun's environment, then train."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main_rank(args)


def main_rank(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if args.dim % args.head_dim:
        sys.exit(f"--dim={args.dim} must be a multiple of --head_dim={args.head_dim}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        main_rank(args)
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # Forked, not spawned: the ranks start with this process's torch already imported
        # (spawning imports it again in each); nothing here has started a thread yet.
        mp.start_processes(run_rank, args=(args.ranks, port, args), nprocs=args.ranks,
                           join=True, start_method="fork")


if __name__ == "__main__":
    main()
