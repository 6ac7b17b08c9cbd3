#!/usr/bin/env python3
"""Anchor-guided thresholding vs top-k on a trained model's real attention (issue 14, item 4).

Trains the accuracy example's decoder (retrieval.py: 2 layers, d=128, 2 heads of 64, 2-key
retrieval) with dense attention for --steps steps (or loads --checkpoint), then, on held-out
documents of the four planner length buckets, takes each layer's q and k (of the dense forward
pass) and measures, for every budget (density) in --budgets:

- top-k: each query block keeps its budget's k_i best-scoring key blocks;
- anchor at tau in --taus: of those, only blocks whose pooled score is >= the best anchor
  block's + ln(tau) (sparsebalance.attention.select_blocks(..., selection="anchor"));
- top-k at the anchor run's achieved density (the budget chosen per length bucket so that
  top-k keeps as many blocks as anchor did): the same-cost comparison.

For each: achieved density (kept / causal key blocks, all rows and heads of the bucket's
documents), true recall (the exact softmax mass inside the kept blocks on every query row,
averaged over all tokens and heads: from each row's dense mass per key block, computed once per
layer; checked against sparsebalance.attention.measure_recall on all rows at the first budget) and recall per unit of
density (recall / achieved density: recall per active block, relative to dense).

    PYTHONPATH=build/client/python .venv/bin/python examples/accuracy/selection_compare.py \\
        --out=examples/accuracy/results

writes selection.md (and selection.json) into --out.
"""

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import retrieval as rt  # noqa: E402

from sparsebalance import _C  # noqa: E402
from sparsebalance.attention import kernel_plan, measure_recall, select_blocks  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="selection-results", help="directory for selection.md/json")
    p.add_argument("--checkpoint", default="",
                   help="model state: loaded when the file exists, else trained and saved there")
    p.add_argument("--steps", type=int, default=200, help="dense training steps")
    p.add_argument("--eval_docs", type=int, default=256, help="held-out documents")
    p.add_argument("--capacity", type=int, default=2048, help="micro-batch capacity (tokens)")
    p.add_argument("--micro_batches", type=int, default=2, help="per step")
    p.add_argument("--min_length", type=int, default=16)
    p.add_argument("--keys", type=int, default=2)
    p.add_argument("--block_size", type=int, default=64, choices=[64, 128])
    p.add_argument("--local_blocks", type=int, default=1)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.5")
    p.add_argument("--taus", default="0.05,0.3,0.5")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The model: retrieval.py's, trained densely on packed micro-batches of its dataset.

def pack(lengths, capacity, first=0):
    """Greedy packing of documents first, first+1, ... into micro-batches of <= capacity tokens:
    lists of dataset indices."""
    out, current, tokens = [], [], 0
    for i, n in enumerate(lengths):
        if current and tokens + n > capacity:
            out.append(current)
            current, tokens = [], 0
        current.append(first + i)
        tokens += n
    if current:
        out.append(current)
    return out


def train(args):
    dataset = rt.RetrievalDataset(args.steps * args.micro_batches * args.capacity // 64 + 64,
                                  args.seed, args.min_length, args.capacity)
    batches = pack(dataset.lengths, args.capacity)
    torch.manual_seed(args.seed)
    model = rt.Decoder(args.dim, args.heads, args.layers)
    optimizer, schedule = rt.make_optimizer(model, args)
    losses, n = [], 0
    for step in range(args.steps):
        step_loss = 0.0
        for _ in range(args.micro_batches):
            ids = batches[n % len(batches)]
            n += 1
            tokens, targets = rt.micro_batch_tokens(dataset, ids)
            cu = rt.cu_of(dataset, ids)
            loss = rt.document_loss(model(tokens, rt.sdpa_attend(cu)), targets, cu)
            (loss / args.micro_batches).backward()
            step_loss += loss.item() / args.micro_batches
        rt.optimizer_step(model, optimizer, schedule)
        losses.append(step_loss)
        if (step + 1) % 25 == 0:
            print(f"step {step + 1}: loss {sum(losses[-25:]) / 25:.3f}", flush=True)
    return model, losses


def held_out(args):
    # Held-out ids start far beyond the training set's (a different generator seed).
    return rt.RetrievalDataset(args.eval_docs, args.seed, args.min_length, args.capacity,
                               first_id=10_000_000)


@torch.no_grad()
def collect(model, args, held):
    """Per held-out micro-batch: (cu, [(q, k) per layer], [block_mass per layer]) of the dense
    forward pass, and the
    dense last-query accuracy per document [(length, correct)]."""
    out, accuracy = [], []
    for ids in pack(held.lengths, args.capacity):
        tokens, targets = rt.micro_batch_tokens(held, ids)
        cu = rt.cu_of(held, ids)
        layers = []
        dense = rt.sdpa_attend(cu)

        def attend(q, k, v):
            layers.append((q.detach().contiguous(), k.detach().contiguous()))
            return dense(q, k, v)

        logits = model(tokens, attend)
        for d in range(len(ids)):
            accuracy.append((cu[d + 1] - cu[d],
                             int(logits[cu[d + 1] - 1].argmax() == targets[cu[d + 1] - 1])))
        out.append((cu, layers, [block_mass(q, k, cu, args.block_size) for q, k in layers]))
    return out, accuracy


# ---------------------------------------------------------------------------------------------
# Measurements.

def budget_per_row(length, density, args):
    return _C.kept_blocks_per_row(int(length), float(density), args.block_size,
                                  args.local_blocks)


def topk_density(lengths, density, args):
    """Top-k's achieved density over documents of `lengths` at `density` (data-independent:
    top-k keeps exactly k_i blocks per row)."""
    kept = sum(int(budget_per_row(n, density, args).sum()) for n in lengths)
    causal = sum(b * (b + 1) // 2 for b in ((n + args.block_size - 1) // args.block_size
                                            for n in lengths))
    return kept / causal


def matched_budget(lengths, target, args):
    """The top-k density whose achieved density over `lengths` is closest to `target`."""
    lo, hi = 1.0 / 65536, 1.0
    for _ in range(30):  # smallest density reaching the target
        mid = (lo + hi) / 2
        if topk_density(lengths, mid, args) >= target:
            hi = mid
        else:
            lo = mid
    below = lo if topk_density(lengths, lo, args) < target else hi
    return min((hi, below), key=lambda d: abs(topk_density(lengths, d, args) - target))


def block_mass(q, k, cu, block_size):
    """Per document of a micro-batch: float64 [heads, length, blocks], the dense causal softmax
    mass each query row puts in each key block (one layer)."""
    scale = 1.0 / q.shape[2] ** 0.5
    out = []
    for a, b in zip(cu, cu[1:]):
        n = b - a
        logits = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        blocks = (n + block_size - 1) // block_size
        mass = torch.zeros(q.shape[1], n, blocks, dtype=torch.float64)
        mass.index_add_(2, torch.arange(n) // block_size, p)
        out.append(mass)
    return out


def kept_mask(sel, d, heads):
    """bool [heads, blocks, blocks]: query block i of document d keeps key block j."""
    cu_blocks, row_ptr, col_idx = sel.cu_blocks, sel.row_ptr, sel.col_idx
    blocks = int(cu_blocks[d + 1] - cu_blocks[d])
    mask = torch.zeros(heads * blocks * blocks, dtype=torch.bool)
    first, last = int(cu_blocks[d]) * heads, int(cu_blocks[d + 1]) * heads
    rows = torch.repeat_interleave(torch.arange(last - first),
                                   torch.from_numpy(row_ptr[first + 1:last + 1] -
                                                    row_ptr[first:last]).long())
    cols = torch.from_numpy(col_idx[row_ptr[first]:row_ptr[last]]).long()
    mask[rows * blocks + cols] = True
    return mask.view(heads, blocks, blocks)


def measure(batches, layer, densities_of, args, selection="topk", tau=0.05, check=False):
    """Per held-out document (in order): (length, kept blocks, causal blocks, recall) of one
    layer's selection, densities_of(length) the document's budget. The recall is the exact
    mass over every query row and head, from the dense block masses; with `check`, also
    sparsebalance.attention.measure_recall on all rows, which must agree."""
    out = []
    for cu, layers, masses in batches:
        q, k = layers[layer]
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        densities = [densities_of(n) for n in lengths]
        sel = select_blocks(q, k, cu, densities, args.block_size, args.local_blocks,
                            selection=selection, anchor_threshold=tau, threads=args.threads)
        heads = sel.heads
        recall = []
        for d, n in enumerate(lengths):
            kept = kept_mask(sel, d, heads)[:, torch.arange(n) // args.block_size]  # [H, n, nb]
            recall.append(float((masses[layer][d] * kept).sum(-1).mean()))
        if check:
            plan = kernel_plan([_C.PlannedSample(id=d, length=n, density=densities[d])
                                for d, n in enumerate(lengths)], args.block_size,
                               args.local_blocks)
            exact = measure_recall(q, k, plan, max(lengths), selection=sel).recall
            gap = float((exact - torch.tensor(recall, dtype=torch.float64)).abs().max())
            if gap > 1e-4:
                raise AssertionError(f"recall differs from measure_recall's by {gap}")
        row_ptr, cu_blocks = sel.row_ptr, sel.cu_blocks.tolist()
        for d, n in enumerate(lengths):
            blocks = cu_blocks[d + 1] - cu_blocks[d]
            kept = int(row_ptr[cu_blocks[d + 1] * heads] - row_ptr[cu_blocks[d] * heads])
            out.append((n, kept, heads * blocks * (blocks + 1) // 2, recall[d]))
    return out


def aggregate(docs, capacity):
    """Per length bucket: density (kept / causal blocks), recall (token-weighted: the mean over
    every query token and head), documents."""
    out = {}
    for b in range(_C.RECALL_BUCKETS):
        mine = [d for d in docs if rt.bucket_of(d[0], capacity) == b]
        if not mine:
            continue
        kept, causal = sum(d[1] for d in mine), sum(d[2] for d in mine)
        tokens = sum(d[0] for d in mine)
        recall = sum(d[0] * d[3] for d in mine) / tokens
        out[b] = {"density": kept / causal, "recall": recall, "docs": len(mine)}
    return out


def compare(batches, args):
    budgets = [float(x) for x in args.budgets.split(",")]
    taus = [float(x) for x in args.taus.split(",")]
    lengths_by_bucket = {}
    for cu, _, _ in batches:
        for a, b in zip(cu, cu[1:]):
            lengths_by_bucket.setdefault(rt.bucket_of(b - a, args.capacity), []).append(b - a)
    rows = []
    for layer in range(args.layers):
        for budget in budgets:
            topk = aggregate(measure(batches, layer, lambda n: budget, args,
                                     check=budget == budgets[0]), args.capacity)
            for tau in taus:
                anchor = aggregate(measure(batches, layer, lambda n: budget, args, "anchor", tau),
                                   args.capacity)
                matched_density = {b: matched_budget(lengths_by_bucket[b],
                                                     anchor[b]["density"], args)
                                   for b in anchor}
                matched = aggregate(measure(
                    batches, layer,
                    lambda n: matched_density[rt.bucket_of(n, args.capacity)], args),
                    args.capacity)
                for b in sorted(anchor):
                    rows.append({"layer": layer, "bucket": b, "docs": anchor[b]["docs"],
                                 "budget": budget, "tau": tau, "topk": topk[b],
                                 "anchor": anchor[b], "matched": matched[b],
                                 "matched_budget": matched_density[b]})
            print(f"layer {layer} budget {budget}: done", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Report.

def per_block(r):
    return r["recall"] / r["density"]


def full_table(rows, capacity):
    lines = ["| layer | length (tokens) | budget | tau | top-k density | top-k recall | "
             "anchor density | anchor recall | anchor recall/density | top-k@same density: "
             "density | recall | recall/density | anchor - top-k@same |",
             "|" + "---|" * 13]
    for r in rows:
        t, a, m = r["topk"], r["anchor"], r["matched"]
        lines.append(
            f"| {r['layer']} | {rt.bucket_label(r['bucket'], capacity)} | {r['budget']:.2f} | "
            f"{r['tau']:.2f} | {t['density']:.3f} | {t['recall']:.3f} | {a['density']:.3f} | "
            f"{a['recall']:.3f} | {per_block(a):.2f} | {m['density']:.3f} | {m['recall']:.3f} | "
            f"{per_block(m):.2f} | {a['recall'] - m['recall']:+.3f} |")
    return "\n".join(lines) + "\n"


def summary_table(rows, capacity):
    """Per (budget, tau), over layers and the buckets where selection has a choice (top-k
    density < 1): ranges of anchor's density / top-k's, and of anchor's recall minus top-k's at
    the same density."""
    lines = ["| budget | tau | anchor density / budget's top-k density | anchor recall - top-k "
             "recall (same budget) | anchor recall - top-k recall (same density) | cells "
             "anchor wins / ties / loses (same density, +-0.005) |", "|" + "---|" * 6]
    keys = sorted({(r["budget"], r["tau"]) for r in rows})
    for budget, tau in keys:
        cells = [r for r in rows if (r["budget"], r["tau"]) == (budget, tau) and
                 r["topk"]["density"] < 0.999]
        if not cells:
            continue
        ratio = [r["anchor"]["density"] / r["topk"]["density"] for r in cells]
        same_budget = [r["anchor"]["recall"] - r["topk"]["recall"] for r in cells]
        same_density = [r["anchor"]["recall"] - r["matched"]["recall"] for r in cells]
        wins = sum(d > 0.005 for d in same_density)
        losses = sum(d < -0.005 for d in same_density)
        lines.append(f"| {budget:.2f} | {tau:.2f} | {min(ratio):.2f}..{max(ratio):.2f} | "
                     f"{min(same_budget):+.3f}..{max(same_budget):+.3f} | "
                     f"{min(same_density):+.3f}..{max(same_density):+.3f} | "
                     f"{wins} / {len(cells) - wins - losses} / {losses} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rt.set_keys(args.keys)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    checkpoint = pathlib.Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None and checkpoint.exists():
        model = rt.Decoder(args.dim, args.heads, args.layers)
        model.load_state_dict(torch.load(checkpoint))
        losses = []
        print(f"loaded {checkpoint}")
    else:
        model, losses = train(args)
        if checkpoint is not None:
            torch.save(model.state_dict(), checkpoint)
    train_seconds = time.perf_counter() - start
    model.eval()
    held = held_out(args)
    batches, accuracy = collect(model, args, held)
    rows = compare(batches, args)
    seconds = time.perf_counter() - start
    correct = sum(c for _, c in accuracy)
    summary = summary_table(rows, args.capacity)
    full = full_table(rows, args.capacity)
    trivial = sorted({rt.bucket_label(r["bucket"], args.capacity) for r in rows
                      if r["topk"]["density"] >= 0.999})
    command = "selection_compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"# Anchor-guided thresholding vs top-k on the trained model's attention\n\n"
        f"`{command}`: retrieval.py's model ({args.layers} layers, d={args.dim}, {args.heads} "
        f"heads, {args.keys}-key retrieval), dense training for {args.steps} steps"
        + (f" (final loss {sum(losses[-25:]) / max(1, len(losses[-25:])):.3f})" if losses
           else " (loaded)")
        + f"; {len(accuracy)} held-out documents (dense last-query accuracy "
        f"{correct / max(1, len(accuracy)):.3f}, chance {1 / rt.VALUES:.3f}); block size "
        f"{args.block_size}, {args.local_blocks} local block(s); {seconds:.0f} s "
        f"({train_seconds:.0f} s training). Density: kept / causal key blocks over every row and "
        f"head of a bucket's documents; recall: exact softmax mass in the kept blocks over "
        f"every query token and head (equal to measure_recall on all rows: checked on each layer's "
        f"first budget); recall/density: recall per "
        f"active block relative to dense. 'top-k@same density': top-k at the budget whose "
        f"achieved density in that bucket is closest to anchor's.\n\n"
        f"Buckets where every row keeps all its blocks at every budget (documents of at most "
        f"{args.local_blocks + 1} blocks; both modes dense, recall 1): "
        f"{', '.join(trivial) or 'none'}; left out of the summary.\n\n"
        f"## Summary (ranges over layers and length buckets)\n\n{summary}\n"
        f"## Every layer and bucket\n\n{full}")
    (out / "selection.md").write_text(text)
    (out / "selection.json").write_text(json.dumps(
        {"args": vars(args), "losses": losses, "accuracy": accuracy, "rows": rows,
         "seconds": seconds}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
