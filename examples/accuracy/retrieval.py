#!/usr/bin/env python3
"""Does SparseBalance cost accuracy? A tiny decoder learns multi-key retrieval three times on the
same batches in the same order, with the same initial weights; only attention differs:

- dense: every causal key inside the document (FlexAttention, a document mask);
- fixed: our block top-k at the job's default density (0.3) for every document;
- sparsebalance: the densities the real planner (sb-planner, policy sparsebalance) gives each
  document, through sparsebalance.torch.Balancer, which also reports the measured recall.

A document's first half is filler with one key:value pair token (PAIR + k * VALUES + v) for
each of --keys keys (2) at uniformly random places; its second half is all query tokens, each
asking one of the document's keys, with the key's value as target. Every query is supervised
(the loss is the mean over documents of each document's mean); the last query, at least half
the document away from any pair, is the held-out answer, so it needs attention back to wherever
the pair is, content-based (no positions; chance 1 / VALUES = 1/8). Lengths are log-uniform over
[min_length, capacity] (16..2048), so the planner's four length buckets ([1, C/64), [C/64, C/16),
[C/16, C/4), [C/4, C]) all hold documents (the longest ones 8-32 blocks of 64). Held-out
accuracy is per bucket, with a 95% Wilson interval; the held-out documents are packed and given
densities by the same planner (the fixed and dense arms run the same packing at their own
attention). AdamW, linear warmup, cosine decay, gradient clipping at 1, the same in every arm.

    build/server/sb-planner ... is started by the script on a free port (or --planner=host:port)
    PYTHONPATH=build/client/python .venv/bin/python examples/accuracy/retrieval.py \\
        --out=examples/accuracy/results

writes results.json, table.md and accuracy.svg into --out. ``--steps``, ``--eval_docs`` make a
shorter run (tests/python/test_accuracy.py runs one).
"""

import argparse
import json
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

import sparsebalance.torch as sbt  # noqa: E402
from sparsebalance import _C  # noqa: E402
from sparsebalance.attention import flex_attention, kernel_plan  # noqa: E402
from sparsebalance.local_planner import LocalPlanner  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
ARMS = ("dense", "fixed", "sparsebalance")

# Vocabulary: BOS, filler, pair tokens (key k, value v: PAIR + k * VALUES + v), query tokens
# (QUERY + k), answers (ANSWER + v).
KEYS, VALUES, FILLERS = 2, 8, 32
BOS, FILLER = 0, 1
PAIR = FILLER + FILLERS
IGNORE = -100


def set_keys(keys):
    """The vocabulary for `keys` keys (--keys): sets KEYS, QUERY, ANSWER, VOCAB."""
    global KEYS, QUERY, ANSWER, VOCAB
    KEYS = keys
    QUERY = PAIR + KEYS * VALUES
    ANSWER = QUERY + KEYS
    VOCAB = ANSWER + VALUES


set_keys(KEYS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--planner", default="", help="sb-planner host:port (default: start one)")
    p.add_argument("--planner_binary", default=str(REPO / "build" / "server" / "sb-planner"))
    p.add_argument("--out", default="accuracy-results", help="directory for the results")
    p.add_argument("--steps", type=int, default=400, help="training steps per arm")
    p.add_argument("--eval_docs", type=int, default=512, help="held-out documents (>= 500)")
    p.add_argument("--docs", type=int, default=20000, help="training documents")
    p.add_argument("--capacity", type=int, default=2048, help="micro-batch capacity (tokens)")
    p.add_argument("--micro_batches", type=int, default=2)
    p.add_argument("--min_length", type=int, default=16)
    p.add_argument("--keys", type=int, default=KEYS, help="key:value pairs per document")
    p.add_argument("--density", type=float, default=0.3, help="the job's default density")
    p.add_argument("--block_size", type=int, default=64, choices=[64, 128])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=2, help="of head_dim dim / heads: 64 or 128")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3, help="peak (AdamW, linear warmup, cosine "
                   "decay to a tenth)")
    p.add_argument("--warmup", type=int, default=30, help="warmup steps")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernel", default="sdpa", choices=["sdpa", "flex"],
                   help="sdpa: the block masks applied document by document with torch's "
                   "scaled_dot_product_attention (fast on CPU); flex: FlexAttention with "
                   "the plan's BlockMask as examples/pytorch/train.py (slow on CPU)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " +
                   ",".join(ARMS) + " (sparsebalance always runs: it makes the batches)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Data.

class RetrievalDataset:
    """Document i (ids from first_id): BOS, then its first half holds filler and one
    key:value pair token (PAIR + k * VALUES + v) for each of KEYS keys (min(KEYS, half - 1) in
    short documents) at uniformly random places, the values drawn at random; its second half is
    all query tokens (QUERY + k), each asking one of the document's keys at random, with the
    key's answer (ANSWER + v) as target (IGNORE elsewhere). Every query is supervised; held-out
    accuracy is the last query's, at least half the document away from any pair, so it needs
    attention back to wherever the pair is (chance: 1 / VALUES)."""

    def __init__(self, docs, seed, min_length, capacity, first_id=0):
        g = torch.Generator().manual_seed(seed * 7919 + first_id)
        logs = torch.rand(docs, generator=g, dtype=torch.float64) * math.log(capacity /
                                                                             min_length)
        self.lengths = (min_length * torch.exp(logs)).floor().long().clamp(
            min_length, capacity).tolist()
        self.seed, self.first_id = seed, first_id

    def __len__(self):
        return len(self.lengths)

    @staticmethod
    def layout(n):
        """(pairs, queries) of a document of n >= 4 tokens."""
        half = n // 2
        return min(KEYS, half - 1), n - half

    def __getitem__(self, i):
        n = self.lengths[i]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_id + i)
        pairs, queries = self.layout(n)
        half = n // 2
        tokens = FILLER + torch.randint(FILLERS, (n,), generator=g)
        tokens[0] = BOS
        keys = torch.randperm(KEYS, generator=g)[:pairs]
        values = torch.randint(VALUES, (pairs,), generator=g)
        tokens[1 + torch.randperm(half - 1, generator=g)[:pairs]] = PAIR + keys * VALUES + values
        asked = torch.randint(pairs, (queries,), generator=g)
        targets = torch.full((n,), IGNORE)
        tokens[half:] = QUERY + keys[asked]
        targets[half:] = ANSWER + values[asked]
        return {"tokens": tokens, "targets": targets}


def bucket_of(length, capacity):
    return _C.recall_bucket(int(length), int(capacity))


# ---------------------------------------------------------------------------------------------
# Model: pre-norm decoder blocks without positions; `mask_of(q, k)` gives a layer's BlockMask.

class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        n = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(n, 3, self.heads, self.head_dim).unbind(1)
        x = x + self.proj(attend(q, k, v).reshape(n, -1))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, dim, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens, attend):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.ln(x))


def document_mask(cu):
    """Dense causal attention inside each packed document (a FlexAttention BlockMask)."""
    cu = torch.as_tensor(cu)
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    n = int(cu[-1])

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (kv <= q)

    return create_block_mask(mask_mod, None, None, n, n, device="cpu")


def flex_attend(mask_of):
    """attend(q, k, v) of FlexAttention with mask_of(q, k)'s BlockMask (as
    examples/pytorch/train.py)."""
    def attend(q, k, v):
        mask = mask_of(q.detach(), k.detach())
        out = flex_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                             block_mask=mask)
        return out.squeeze(0).transpose(0, 1)
    return attend


def sdpa_attend(cu, select=None):
    """attend(q, k, v) computing, document by document, exactly what the FlexAttention block
    mask keeps (causal, and the selection's kept blocks when `select(q, k)` gives a Selection)
    with torch's scaled_dot_product_attention and an explicit mask: the same attention, one
    document's L^2 at a time instead of FlexAttention's unfused CPU path over the whole packed
    micro-batch (5-10x faster here)."""
    def attend(q, k, v):
        selection = select(q.detach(), k.detach()) if select is not None else None
        out = []
        for d in range(len(cu) - 1):
            s, n = cu[d], cu[d + 1] - cu[d]
            qd, kd, vd = (t[s:s + n].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
            if selection is None:
                od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
            else:
                block = selection.block_size
                index = torch.arange(n) // block
                kept = torch.stack([torch.from_numpy(selection.block_mask(d, h)).bool()
                                    for h in range(q.shape[1])])  # [H, blocks, blocks]
                mask = kept[:, index][:, :, index] & torch.ones(n, n, dtype=torch.bool).tril()
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
            out.append(od.transpose(0, 1))
        return torch.cat(out)
    return attend


# ---------------------------------------------------------------------------------------------
# The planner.

# ---------------------------------------------------------------------------------------------
# Training and evaluation.

def document_loss(logits, targets, cu):
    """The mean over a micro-batch's documents of each document's mean cross entropy over its
    supervised tokens (a short document counts as much as a long one)."""
    per_token = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    supervised = (targets != IGNORE).float()
    losses = [per_token[s:e].sum() / supervised[s:e].sum().clamp(min=1)
              for s, e in zip(cu[:-1], cu[1:])]
    return torch.stack(losses).mean()


def cu_of(dataset, ids):
    cu = [0]
    for i in ids:
        cu.append(cu[-1] + dataset.lengths[i])
    return cu


def micro_batch_tokens(dataset, ids):
    items = [dataset[i] for i in ids]
    return (torch.cat([it["tokens"] for it in items]), torch.cat([it["targets"] for it in items]))


def arm_attention(arm, samples, args, plan=None):
    """attend(q, k, v) of a micro-batch (samples: (id, length, planned density)) for an arm;
    `plan`: the micro-batch's own KernelPlan (the Balancer's: it measures recall)."""
    cu = [0]
    for _, n, _ in samples:
        cu.append(cu[-1] + n)
    if plan is None and arm != "dense":
        density = {"fixed": lambda d: args.density, "sparsebalance": lambda d: d}[arm]
        plan = kernel_plan([_C.PlannedSample(id=i, length=n, density=density(d))
                            for i, n, d in samples], block_size=args.block_size,
                           local_blocks=1)
    if args.kernel == "flex":
        return flex_attend((lambda q, k, m=document_mask(cu): m) if arm == "dense" else
                           plan.block_mask)
    return sdpa_attend(cu, None if arm == "dense" else plan.select)


def make_optimizer(model, args):
    """AdamW with a linear warmup over --warmup steps and a cosine decay to lr / 10 at --steps
    (the same in every arm)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def factor(step):
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        return min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * cosine)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_step(model, optimizer, schedule):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)


def train_sparsebalance(args, dataset, planner):
    """The sparsebalance arm through sbt.Balancer; returns the model, the micro-batches it ran
    (the other arms replay them), the held-out packing, and the reported recall."""
    torch.manual_seed(args.seed)
    model = Decoder(args.dim, args.heads, args.layers)
    optimizer, schedule = make_optimizer(model, args)
    balancer = sbt.Balancer(planner, dataset.lengths, seed=args.seed, layers=args.layers,
                            heads=args.heads, head_dim=args.dim // args.heads,
                            block_size=args.block_size, capacity=args.capacity,
                            micro_batches=args.micro_batches, policy="sparsebalance",
                            density_default=args.density, prefetch=False)
    record, losses, recall_seconds, compute_seconds, recall = [], [], 0.0, 0.0, []
    for step in balancer.batches(dataset, steps=args.steps):
        for mb in step:
            if not mb.num_tokens:
                continue
            with balancer.timed(mb):
                tokens, targets = micro_batch_tokens(dataset, mb.ids)
                samples = [(s.id, s.length, s.density) for s in mb.samples]
                logits = model(tokens, arm_attention("sparsebalance", samples, args,
                                                     mb.attention))
                loss = document_loss(logits, targets, cu_of(dataset, mb.ids))
                (loss * mb.document_weight).backward()
            documents, _ = mb.document_recall()
            recall += [(s.length, d.recall) for s, d in zip(mb.samples, documents)]
            recall_seconds += mb.recall_seconds()
            record.append({"step": step.step, "weight": mb.document_weight,
                           "samples": [(s.id, s.length, s.density) for s in mb.samples]})
            losses.append((step.step, loss.item()))
        optimizer_step(model, optimizer, schedule)
    step_number = balancer.next_step
    balancer.close()
    # The held-out documents as the planner packs and densifies them (no training, no reports).
    held_out = held_out_plan(args, balancer, step_number)
    return model, record, losses, held_out, {"recall_seconds": recall_seconds,
                                             "documents": recall}


def held_out_plan(args, balancer, first_step):
    """Micro-batches of the held-out documents, planned by the job (ids after the training
    set's): [[(id, length, density)], ...]."""
    held = RetrievalDataset(args.eval_docs, args.seed, args.min_length, args.capacity,
                            first_id=args.docs)
    client = _C.PlannerClient(_C.ClientOptions(target=balancer._target,
                                               job_id=balancer.job.job_id,
                                               token=balancer.job.token))
    session_step = first_step
    pending = [_C.Sample(id=args.docs + i, length=n) for i, n in enumerate(held.lengths)]
    room = int(0.8 * args.micro_batches * args.capacity)
    out = []
    while pending:
        batch, tokens = [], 0
        while pending and tokens + pending[0].length <= room:
            tokens += pending[0].length
            batch.append(pending.pop(0))
        if not batch:
            batch.append(pending.pop(0))
        client.submit_batch(session_step, batch)
        plan = client.get_rank_plan(session_step, 0)
        placed = set()
        for mb in plan.micro_batches:
            if mb.samples:
                out.append([(s.id, s.length, s.density) for s in mb.samples])
                placed.update(s.id for s in mb.samples)
        pending = [s for s in batch if s.id not in placed] + pending  # deferred
        session_step += 1
    return out


def train_replay(arm, args, dataset, record):
    torch.manual_seed(args.seed)
    model = Decoder(args.dim, args.heads, args.layers)
    optimizer, schedule = make_optimizer(model, args)
    losses = []
    for n, entry in enumerate(record):
        tokens, targets = micro_batch_tokens(dataset, [i for i, _, _ in entry["samples"]])
        logits = model(tokens, arm_attention(arm, entry["samples"], args))
        loss = document_loss(logits, targets, cu_of(dataset, [i for i, _, _ in
                                                              entry["samples"]]))
        (loss * entry["weight"]).backward()
        losses.append((entry["step"], loss.item()))
        if n + 1 == len(record) or record[n + 1]["step"] != entry["step"]:
            optimizer_step(model, optimizer, schedule)
    return model, losses


@torch.no_grad()
def evaluate(arm, model, args, held_out_batches):
    """Per held-out document: (length, correct) of its last query."""
    held = RetrievalDataset(args.eval_docs, args.seed, args.min_length, args.capacity,
                            first_id=args.docs)
    out = []
    for samples in held_out_batches:
        ids = [i - args.docs for i, _, _ in samples]
        tokens, targets = micro_batch_tokens(held, ids)
        logits = model(tokens, arm_attention(arm, samples, args))
        end = 0
        for i in ids:
            end += held.lengths[i]
            out.append((held.lengths[i], int(logits[end - 1].argmax() == targets[end - 1])))
    return out


# ---------------------------------------------------------------------------------------------
# Results: table, plot.

def wilson(correct, n, z=1.96):
    if n == 0:
        return 0.0, 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, max(0.0, centre - half), min(1.0, centre + half)


def summarize(per_arm, capacity):
    rows = {}
    for arm, results in per_arm.items():
        for b in range(_C.RECALL_BUCKETS):
            hits = [c for n, c in results if bucket_of(n, capacity) == b]
            p, lo, hi = wilson(sum(hits), len(hits))
            rows.setdefault(arm, []).append({"bucket": b, "n": len(hits), "correct": sum(hits),
                                             "accuracy": p, "low": lo, "high": hi})
        p, lo, hi = wilson(sum(c for _, c in results), len(results))
        rows[arm].append({"bucket": "all", "n": len(results),
                          "correct": sum(c for _, c in results), "accuracy": p, "low": lo,
                          "high": hi})
    return rows


def bucket_label(b, capacity):
    lo, hi = _C.recall_bucket_range(b, capacity)
    return f"{lo}-{hi}"


def table_markdown(summary, capacity):
    arms = list(summary)
    head = "| length (tokens) | documents | " + " | ".join(arms) + " |"
    lines = [head, "|" + "---|" * (2 + len(arms))]
    for b in range(_C.RECALL_BUCKETS + 1):
        label = "all" if b == _C.RECALL_BUCKETS else bucket_label(b, capacity)
        n = summary[arms[0]][b]["n"]
        cells = [f"{r['accuracy']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"
                 for r in (summary[a][b] for a in arms)]
        lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def svg_plot(summary, capacity, title):
    arms = list(summary)
    colours = {"dense": "#4c72b0", "fixed": "#dd8452", "sparsebalance": "#55a868"}
    width, height, left, bottom, top = 640, 360, 60, 60, 40
    plot_w, plot_h = width - left - 20, height - top - bottom
    groups = _C.RECALL_BUCKETS
    group_w = plot_w / groups
    bar_w = group_w * 0.8 / len(arms)

    def y(v):
        return top + plot_h * (1 - v)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    for t in range(6):
        v = t / 5
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   'stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
    chance = 1 / VALUES
    out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(chance):.1f}" '
               f'y2="{y(chance):.1f}" stroke="#999" stroke-dasharray="4,3"/>')
    out.append(f'<text x="{left + plot_w - 4}" y="{y(chance) - 4:.1f}" text-anchor="end" '
               f'fill="#666">chance</text>')
    for b in range(groups):
        x0 = left + b * group_w + group_w * 0.1
        for a, arm in enumerate(arms):
            r = summary[arm][b]
            x = x0 + a * bar_w
            out.append(f'<rect x="{x:.1f}" y="{y(r["accuracy"]):.1f}" width="{bar_w - 2:.1f}" '
                       f'height="{plot_h * r["accuracy"]:.1f}" fill="{colours.get(arm, "#888")}"/>')
            cx = x + (bar_w - 2) / 2
            out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(r["low"]):.1f}" '
                       f'y2="{y(r["high"]):.1f}" stroke="black"/>')
            for v in (r["low"], r["high"]):
                out.append(f'<line x1="{cx - 4:.1f}" x2="{cx + 4:.1f}" y1="{y(v):.1f}" '
                           f'y2="{y(v):.1f}" stroke="black"/>')
        n = summary[arms[0]][b]["n"]
        out.append(f'<text x="{left + (b + 0.5) * group_w:.1f}" y="{top + plot_h + 18}" '
                   f'text-anchor="middle">{bucket_label(b, capacity)} tokens</text>')
        out.append(f'<text x="{left + (b + 0.5) * group_w:.1f}" y="{top + plot_h + 32}" '
                   f'text-anchor="middle" fill="#666">n = {n}</text>')
    out.append(f'<text x="16" y="{top + plot_h / 2}" transform="rotate(-90 16 '
               f'{top + plot_h / 2})" text-anchor="middle">held-out accuracy (95% Wilson)</text>')
    for a, arm in enumerate(arms):
        x = left + 10 + a * 130
        out.append(f'<rect x="{x}" y="{height - 16}" width="12" height="12" '
                   f'fill="{colours.get(arm, "#888")}"/>')
        out.append(f'<text x="{x + 16}" y="{height - 6}">{arm}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    set_keys(args.keys)
    torch.set_num_threads(args.threads)
    arms = [a for a in args.arms.split(",") if a]
    if any(a not in ARMS for a in arms):
        sys.exit(f"--arms: {args.arms} names an arm not in {ARMS}")
    if args.eval_docs < 1 or args.steps < 1:
        sys.exit("--steps and --eval_docs must be positive")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    planner = None
    if not args.planner:
        try:
            planner = LocalPlanner(args.planner_binary)
        except (FileNotFoundError, RuntimeError) as e:
            sys.exit(f"--planner_binary: {e}")
        args.planner = planner.address
    dataset = RetrievalDataset(args.docs, args.seed, args.min_length, args.capacity)
    results, timings, losses, batches = {}, {}, {}, {}
    try:
        t = time.perf_counter()
        model, record, losses["sparsebalance"], held_out, recall = train_sparsebalance(
            args, dataset, args.planner)
        timings["sparsebalance_train"] = time.perf_counter() - t
        batches["sparsebalance"] = [[i for i, _, _ in e["samples"]] for e in record]
        t = time.perf_counter()
        results["sparsebalance"] = evaluate("sparsebalance", model, args, held_out)
        timings["sparsebalance_eval"] = time.perf_counter() - t
        print(f"sparsebalance: trained {timings['sparsebalance_train']:.0f} s, evaluated "
              f"{timings['sparsebalance_eval']:.0f} s", flush=True)
    finally:
        if planner is not None:
            planner.stop()
    for arm in (a for a in ARMS if a in arms and a != "sparsebalance"):
        t = time.perf_counter()
        model, losses[arm] = train_replay(arm, args, dataset, record)
        timings[f"{arm}_train"] = time.perf_counter() - t
        batches[arm] = [[i for i, _, _ in e["samples"]] for e in record]
        t = time.perf_counter()
        results[arm] = evaluate(arm, model, args, held_out)
        timings[f"{arm}_eval"] = time.perf_counter() - t
        print(f"{arm}: trained {timings[f'{arm}_train']:.0f} s, evaluated "
              f"{timings[f'{arm}_eval']:.0f} s", flush=True)
    ordered = {a: results[a] for a in ARMS if a in results}
    summary = summarize(ordered, args.capacity)
    table = table_markdown(summary, args.capacity)
    densities = [d for e in record for _, _, d in e["samples"]]
    held_densities = [d for mb in held_out for _, _, d in mb]
    recall_by_bucket = {}
    for n, r in recall["documents"]:
        recall_by_bucket.setdefault(bucket_of(n, args.capacity), []).append(r)
    timings["total"] = time.perf_counter() - started
    report = {
        "args": vars(args), "summary": summary, "timings_seconds": timings,
        "losses": losses, "batches_identical": all(b == batches["sparsebalance"]
                                                    for b in batches.values()),
        "train_micro_batches": len(record), "held_out_documents": len(results["sparsebalance"]),
        "sparsebalance_density": {"train_mean": sum(densities) / max(1, len(densities)),
                                  "train_min": min(densities, default=0.0),
                                  "train_max": max(densities, default=0.0),
                                  "held_out_mean": sum(held_densities) /
                                  max(1, len(held_densities))},
        "measured_recall_by_bucket": {str(b): sum(v) / len(v)
                                      for b, v in sorted(recall_by_bucket.items())},
        "recall_seconds": recall["recall_seconds"],
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=1))
    (out_dir / "table.md").write_text(table)
    title = (f"{args.keys}-key retrieval, {args.layers} layers d={args.dim}, block {args.block_size}, "
             f"capacity {args.capacity}, {args.steps} steps")
    (out_dir / "accuracy.svg").write_text(svg_plot(summary, args.capacity, title))
    print(table, end="")
    print(f"total {timings['total']:.0f} s; results in {out_dir}")


if __name__ == "__main__":
    main()
