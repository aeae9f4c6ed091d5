"""One tree as the page draws it: read from its segment rows alone, decoded, credited, its turns as text.

    detail = tree_detail(index, "s0i0-000003", cfg, text=TokenText(path), parse_call=fn)

Credit: a credited copy carries z, V, q, τ (storage/tree_codec.py columns); they are shown as stored. A raw
copy (not yet credited by the backup) gets them from `system.credit.credit_rollout_tree` with the run's
algo config, marked "computed". A credited copy is recomputed too, and a difference (a config changed
since) is said in a note. The student: where the learner recorded the turn (learner/turn_record.py),
p = σ(s_i) and the turn's loss share w·m_i·KL(q_i ‖ p_i)/Z as trained; elsewhere the values at θ = μ
(s = 0, p = ½, before any update). A tree that fails to decode is returned as {"error": one line}.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from configs.schema import Config
from storage.store_files import BAD_SEGMENT, read_segment
from storage.tree_codec import decode_trees
from system.credit import credit_rollout_tree
from system.teacher import student_kl
from system.tree import RolloutTree
from viewer.summaries import finishes
from viewer.tree_index import TreeIndex

ParseCall = Callable[[str], dict[str, Any] | None]


def finite(x: Any) -> float | None:
    """JSON has no NaN: a missing or undefined value is null."""
    return float(x) if x is not None and math.isfinite(float(x)) else None


class TokenText:
    """Token ids → text with the run's tokenizer, loaded on first use (transformers is slow to import)."""

    def __init__(self, path: Path | None):
        self.path, self._tok, self.problem = path, None, None if path else "no tokenizer found in the run"
        self._mu = threading.Lock()

    def _load(self) -> Any:
        with self._mu:
            if self._tok is None and self.problem is None:
                try:
                    from transformers import AutoTokenizer

                    self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
                except (OSError, ValueError) as e:
                    self.problem = f"{self.path}: cannot load the tokenizer ({e}); token ids only"
            return self._tok

    def text(self, ids: np.ndarray, plain: bool = False) -> str | None:
        """The decoded ids; `plain` leaves out special tokens (chat markers), as a call parser sees them."""
        tok = self._load()
        return None if tok is None else tok.decode(ids.tolist(), skip_special_tokens=plain)

    def pieces(self, ids: np.ndarray) -> list[str] | None:
        tok = self._load()
        return None if tok is None else tok.batch_decode([[int(t)] for t in ids])


def read_tree(index: TreeIndex, tree_id: str) -> tuple[RolloutTree | None, int | None, str | None]:
    """(tree, batch that trained it, None) or (None, None, the error line)."""
    where = index.location(tree_id)
    if where is None:
        return None, None, f"no tree {tree_id!r} in the store (not indexed yet, or moved to quarantine)"
    path, (_, bi, r0, r1), batch = where
    try:
        rows = read_segment(path)[1][bi].slice(r0, r1 - r0)
        (tree,) = decode_trees(rows, path.name)
    except (*BAD_SEGMENT, ValueError, KeyError, IndexError) as e:
        line = f"tree {tree_id} in {path.name} rows {r0}..{r1 - 1} fails to decode: {type(e).__name__}: {e}"
        return None, batch, line.replace("\n", " ")
    return tree, batch, None


def credit_of(tree: RolloutTree, cfg: Config | None) -> tuple[dict[str, np.ndarray] | None, str, list[str]]:
    """(z, V, q arrays and tau, where they come from, notes)."""
    notes: list[str] = []
    computed = None
    if cfg is not None:
        try:
            computed = credit_rollout_tree(tree, cfg.algo).credit
        except ValueError as e:
            notes.append(f"credit cannot be computed with this run's config: {e}")
    stored = tree.credit
    if stored is not None and computed is not None:
        gap = np.nanmax(np.abs(np.concatenate([stored.V - computed.V, stored.q - computed.q])), initial=0.0)
        if gap > 1e-9:
            notes.append(f"stored credit differs from this config's recomputation (max |Δ| = {gap:.3g})")
    use, source = (stored, "stored") if stored is not None else (computed, "computed from config.yaml")
    if use is None:
        return None, "none", notes
    return {"z": use.z, "V": use.V, "q": use.q, "tau": use.tau}, source, notes  # type: ignore[dict-item]


def _student(q: float | None, ell: int, rec: dict[str, Any] | None) -> dict[str, Any]:
    if rec is not None:
        s = rec["s"]
        kl = float(student_kl(q, s)) if q is not None and s == s else None
        loss = kl * rec["mass"] / rec["z"] if kl is not None and rec["z"] > 0 else None
        return {
            "source": "learner",
            "s": finite(s),
            "p": finite(1 / (1 + math.exp(-s))) if s == s else None,
            "kl": finite(kl),
            "loss": finite(loss),
            "Z": rec["z"],
            "mass": rec["mass"],
            "minibatch": rec["minibatch"],
            "version": rec["version"],
        }
    kl = float(student_kl(q, 0.0)) if q is not None else None
    return {"source": "behaviour", "s": 0.0, "p": 0.5, "kl": finite(kl), "ell_kl": finite(kl and kl * ell)}


def _learner_lp(n_tokens: int, rec: dict[str, Any] | None) -> list[float | None] | None:
    if rec is None:
        return None
    out: list[float | None] = [None] * n_tokens
    for off, lp in zip(rec["offsets"], rec["logp"], strict=True):
        if 0 <= off < n_tokens:
            out[off] = finite(lp)
    return out


def _node(
    tree: RolloutTree,
    i: int,
    credit: dict[str, Any] | None,
    rec: dict[str, Any] | None,
    text: TokenText,
    parse_call: ParseCall | None,
) -> dict[str, Any]:
    n = tree.nodes[i]
    q = finite(credit["q"][i]) if credit else None
    turn_text = text.text(n.tokens) if len(n.tokens) else ""
    plain = text.text(n.tokens, plain=True) if parse_call and turn_text else None
    ell = int(tree.effective_mask(i).sum()) if i else 0
    return {
        "id": i,
        "parent": n.parent,
        "depth": n.depth,
        "children": list(tree.children[i]),
        "version": n.policy_version,
        "reward": finite(n.reward),
        "tokens": n.tokens.tolist(),
        "mask": n.loss_mask.astype(int).tolist(),
        "behaviour_lp": [finite(x) for x in n.behavior_logprobs.tolist()],
        "learner_lp": _learner_lp(len(n.tokens), rec),
        "pieces": text.pieces(n.tokens) if len(n.tokens) else [],
        "text": turn_text,
        "obs_tokens": len(n.obs_tokens),
        "obs_text": text.text(n.obs_tokens) if len(n.obs_tokens) else "",
        "call": parse_call(plain) if parse_call and plain else None,
        "ell": ell,
        "z": finite(credit["z"][i]) if credit else None,
        "V": finite(credit["V"][i]) if credit else None,
        "q": q,
        "student": _student(q, ell, rec) if i else None,
    }


def tree_detail(
    index: TreeIndex,
    tree_id: str,
    cfg: Config | None,
    text: TokenText,
    parse_call: ParseCall | None = None,
) -> dict[str, Any]:
    tree, batch, error = read_tree(index, tree_id)
    if tree is None:
        return {"id": tree_id, "error": error}
    credit, source, notes = credit_of(tree, cfg)
    records = index.turns.of_tree(tree_id, batch)
    if text.problem:
        notes.append(text.problem)
    if records and cfg is not None and cfg.algo.depth_correction:
        notes.append("algo.depth_correction: each turn's loss share leaves out its depth weight w_d")
    nodes = [_node(tree, i, credit, records.get(i), text, parse_call) for i in range(len(tree.nodes))]
    return {
        "id": tree.tree_id,
        "prompt_id": tree.prompt_id,
        "meta": {k: v for k, v in tree.meta.items() if k != "finish"},
        "finish": finishes(tree.meta),
        "step": None if batch is None else batch + 1,
        "batch": batch,
        "credit_source": source,
        "tau": finite(credit["tau"]) if credit else None,
        "learner_record": bool(records),
        "leaves": [int(x) for x in tree.leaves],
        "branch_points": [i for i, kids in enumerate(tree.children) if len(kids) >= 2],
        "nodes": nodes,
        "notes": notes,
    }


def tree_json(detail: dict[str, Any]) -> str:
    return json.dumps(detail, allow_nan=False, separators=(",", ":"))


__all__ = ["TokenText", "finite", "read_tree", "tree_detail", "tree_json"]
