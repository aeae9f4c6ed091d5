"""Paired significance for every table the experiments print (pure): per-seed (or per-question) paired
differences, their mean and standard error, t with n − 1 degrees of freedom, the two-sided p-value, and a
verdict by that test at 5 %.

    test = paired_test([0.05, 0.06, 0.07])     # mean 0.06, se 0.00577, t 10.4, df 2, p 0.009 -> "holds"

A negative mean stays negative in every figure (nothing is clamped), and the verdict says "reversed" when it
is significant. With one pair there is no test ("one pair: no test"); differences that are all zero are a
"tie".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scipy import stats as scipy_stats

ALPHA = 0.05


@dataclass(frozen=True)
class PairedTest:
    n: int
    mean: float
    se: float  # sample sd (ddof 1) / √n
    t: float
    df: int
    p: float  # two-sided
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def sd(self) -> float:
        """The sample sd (ddof 1) of one difference, se·√n (NaN below two pairs)."""
        return self.se * math.sqrt(self.n)

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        """The two-sided confidence interval of the mean difference, mean ± t(1 − (1 − level)/2, df)·se
        (NaN without a standard error)."""
        if self.n < 2 or not math.isfinite(self.se):
            return (math.nan, math.nan)
        half = float(scipy_stats.t.isf((1 - level) / 2, self.df)) * self.se
        return (self.mean - half, self.mean + half)

    def line(self) -> str:
        """`+0.060 ± 0.006 (t = 10.39, df 2, p = 0.009): holds` — the figures behind a verdict."""
        if self.n == 0:
            return "no data"
        if self.n == 1:
            return f"{self.mean:+.3f} (one pair: no test)"
        figures = f"t = {self.t:.2f}, df {self.df}, p = {self.p:.3f}"
        return f"{self.mean:+.3f} ± {self.se:.3f} ({figures}): {self.verdict}"


def paired_test(diffs: Sequence[float], alpha: float = ALPHA) -> PairedTest:
    """The test of mean(diffs) = 0 against two sides (diffs: better − worse, one per paired unit)."""
    xs = [float(d) for d in diffs if d == d]
    n = len(xs)
    if n == 0:
        return PairedTest(0, math.nan, math.nan, math.nan, 0, math.nan, "no data")
    mean = sum(xs) / n
    if n == 1:
        return PairedTest(1, mean, math.nan, math.nan, 0, math.nan, "one pair: no test")
    if all(abs(x) < 1e-12 for x in xs):
        return PairedTest(n, 0.0, 0.0, 0.0, n - 1, 1.0, "tie")
    se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)
    t = mean / se if se > 0 else math.copysign(math.inf, mean)
    p = float(2 * scipy_stats.t.sf(abs(t), n - 1)) if math.isfinite(t) else 0.0
    verdict = ("holds" if mean > 0 else "reversed") if p < alpha else "not significant"
    return PairedTest(n, mean, se, t, n - 1, p, verdict)


def pairs_needed(sd: float, effect: float, alpha: float = ALPHA, power: float = 0.8) -> int:
    """Paired units needed to detect a true mean difference `effect` with this power, given the sd of one
    difference (normal approximation, then the t correction of one extra unit per ~z²/2)."""
    if effect <= 0 or sd <= 0:
        return 0
    z_a, z_b = scipy_stats.norm.isf(alpha / 2), scipy_stats.norm.isf(1 - power)
    n = ((z_a + z_b) * sd / effect) ** 2
    return math.ceil(n + z_a**2 / 2)
