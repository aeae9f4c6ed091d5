"""Answer metrics of the official SQuAD / HotpotQA evaluation (``hotpot_evaluate_v1.py``).

``normalize_answer`` lower-cases, removes punctuation, removes the articles a/an/the and collapses
whitespace, in that order. EM and F1 take the max over all gold strings. As in hotpot_evaluate_v1, F1 is 0
when either side normalizes to yes/no/noanswer and the two differ (no partial credit for "no" vs "no way").
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_SPECIAL = frozenset({"yes", "no", "noanswer"})


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold, else 0.0 (0.0 for no golds)."""
    norm = normalize_answer(pred)
    return float(any(norm == normalize_answer(g) for g in _golds(golds)))


def precision_recall_f1(pred: str, gold: str) -> tuple[float, float, float]:
    """Token-level precision, recall and F1 against one gold string."""
    p, g = normalize_answer(pred), normalize_answer(gold)
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0, 0.0, 0.0
    p_tokens, g_tokens = p.split(), g.split()
    same = sum((Counter(p_tokens) & Counter(g_tokens)).values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = same / len(p_tokens), same / len(g_tokens)
    return precision, recall, 2 * precision * recall / (precision + recall)


def f1(pred: str, golds: str | Iterable[str]) -> float:
    """Max token F1 over the golds (0.0 for no golds)."""
    return max((precision_recall_f1(pred, g)[2] for g in _golds(golds)), default=0.0)
