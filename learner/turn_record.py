"""What the learner saw of each turn it trained, for `treeopsd view`: its own token log-probs (π_θ at the
moment the turn's mini-batch was forwarded, first epoch), s_i against the loss's reference, ℓ_i and the
mini-batch's normalizer Z (docs/algorithm.md §5), and the learner/sampler gap on the turn's tokens.

    RUN_DIR/learner_turns/batch_000007.rank0.arrow     one Arrow IPC file per trained batch k and rank

One row per owned turn (each turn is trained once, from its owner's copy, docs/algorithm.md §2.4):

    tree_id string, node_id int32, batch int64, version int64, minibatch int32,
    z float64          Z of the turn's mini-batch (the loss's normalizer: its loss tokens)
    ell int32          loss tokens with a finite learner and reference log-prob
    mass float64       Σ c_t over them: the rollout correction's token weights (§11.1), = ell without one
    s float64          the c-weighted mean of log π_θ − log ref over them (ref: μ, or π_prox under
                       algo.proximal=step_start), as the loss takes it: its contribution is
                       w_i · mass · KL(q_i ‖ σ(s)) / Z (w_i: the depth correction's turn weight, else 1)
    k3_sum float64     Σ (r − 1 − log r), r = π_θ/μ, over the tokens with a finite μ (the mismatch's k3)
    k3_n int32
    offsets list<int32>, logp list<float32>   position in the turn's tokens and log π_θ there

Written with `storage.durable.write_atomic` after the step (a reader sees the whole file or none); a batch
trained again after a rewind replaces its file. `logging.learner_turns=false` turns it off. Only the
learner's own process writes here; `treeopsd view` reads it (viewer/learner_turns.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from learner.packing import PackedBatch
from storage.durable import write_atomic
from storage.tree_codec import table_to_ipc

DIRNAME = "learner_turns"
SCHEMA = pa.schema(
    [
        ("tree_id", pa.string()),
        ("node_id", pa.int32()),
        ("batch", pa.int64()),
        ("version", pa.int64()),
        ("minibatch", pa.int32()),
        ("z", pa.float64()),
        ("ell", pa.int32()),
        ("mass", pa.float64()),
        ("s", pa.float64()),
        ("k3_sum", pa.float64()),
        ("k3_n", pa.int32()),
        ("offsets", pa.list_(pa.int32())),
        ("logp", pa.list_(pa.float32())),
    ]
)


def record_path(run_dir: str | Path, batch: int, rank: int) -> Path:
    return Path(run_dir) / DIRNAME / f"batch_{batch:06d}.rank{rank}.arrow"


class TurnRecorder:
    """Collects one step's owned turns (`add` per micro-batch), then `write`s them as one file."""

    def __init__(self, run_dir: str | Path, batch: int, version: int, rank: int = 0):
        self.path = record_path(run_dir, batch, rank)
        self.batch, self.version = batch, version
        self.rows: list[dict] = []

    def add(
        self,
        packed: PackedBatch,
        logp: torch.Tensor,
        ref: torch.Tensor,
        weights: torch.Tensor | None,
        tree_ids: tuple[str, ...],
        z: float,
        minibatch: int,
    ) -> None:
        """The owned turns of one micro-batch: `logp` its forward, `ref` the loss's reference log-probs,
        `weights` the correction's token weights in the same layout (None: 1), `tree_ids` the mini-batch's
        trees (packed.turn_tree indexes them), `z` its normalizer."""
        on = (packed.owned & (packed.turn_ids >= 0)).cpu().numpy()

        def picked(x: torch.Tensor) -> np.ndarray:  # [B, T] or flattened [B·T]: the owned loss tokens
            return x.detach().cpu().numpy().reshape(on.shape)[on]

        c = np.ones(int(on.sum())) if weights is None else picked(weights).astype(np.float64)
        turn, offset = picked(packed.turn_ids), picked(packed.token_offset)
        lp, rf = picked(logp.float()), picked(ref.float())
        mu = picked(packed.behavior_logp.float())
        tree, node = packed.turn_tree.cpu().numpy(), packed.turn_node.cpu().numpy()
        order = np.argsort(turn, kind="stable")
        bounds = np.flatnonzero(np.diff(turn[order])) + 1
        for idx in np.split(order, bounds) if order.size else []:
            t = int(turn[idx[0]])
            tid, nid = tree_ids[int(tree[t])], int(node[t])
            self.rows.append(turn_row(tid, nid, offset[idx], lp[idx], rf[idx], mu[idx], c[idx]))
            self.rows[-1].update(batch=self.batch, version=self.version, minibatch=minibatch, z=float(z))

    def write(self) -> Path | None:
        """The step's file (None when no turn was recorded: nothing is written)."""
        if not self.rows:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        columns = {name: [r[name] for r in self.rows] for name in SCHEMA.names}
        table = pa.Table.from_pydict(columns, schema=SCHEMA)
        write_atomic(self.path, table_to_ipc(table))
        return self.path


def turn_row(
    tree_id: str,
    node_id: int,
    offsets: np.ndarray,
    logp: np.ndarray,
    ref: np.ndarray,
    mu: np.ndarray,
    c: np.ndarray,
) -> dict:
    """One turn's record: s, the c-weighted mean log-ratio over the tokens where both π_θ and the reference
    are finite (as the loss takes them), k3 over those where π_θ and μ are."""
    both = np.isfinite(logp) & np.isfinite(ref)
    d = logp[both].astype(np.float64) - ref[both]
    w = c[both]
    gap = logp.astype(np.float64) - mu
    ok = np.isfinite(gap)
    k3 = np.expm1(gap[ok]) - gap[ok]
    return {
        "tree_id": tree_id,
        "node_id": node_id,
        "ell": int(both.sum()),
        "mass": float(w.sum()),
        "s": float((w * d).sum() / w.sum()) if w.sum() > 0 else float("nan"),
        "k3_sum": float(k3.sum()),
        "k3_n": int(ok.sum()),
        "offsets": offsets.astype(np.int32).tolist(),
        "logp": logp.astype(np.float32).tolist(),
    }
