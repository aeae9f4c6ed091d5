"""Optional packages that a process of ours never uses, kept out of it.

transformers imports scikit-learn whenever it is installed (`generation/candidate_generator.py`, for the
confidence threshold of assisted decoding, which no role calls), and scikit-learn imports scipy and pandas.
The retrieval extra installs it: sentence-transformers, the dense encoder, needs it. That import cost
1.3 CPU-s on an idle 2-core machine and 2.7 CPU-s on a loaded one (measured against the same import with
scikit-learn hidden) in every process that loads a model: each learner, rank and sampler actor, each
`treeopsd` and benchmark process — about 150 of them in one run of the test suite.

A `None` entry in `sys.modules` is Python's own way to make a package unimportable: `import sklearn` raises
ImportError and `importlib.util.find_spec("sklearn")` returns None, which is how transformers decides.
`actors/envs/dense.py` takes the entry out again before it imports sentence-transformers, so a process that
builds the dense encoder imports scikit-learn as before.

scipy.optimize, but only while transformers' losses load: its object-detection losses (`transformers/loss/`,
which every model import loads) import scipy.optimize whenever scipy is installed, for a matcher no role
calls: ~0.8 CPU-s of each such process here. bm25s and the statistics need scipy, so those modules alone get
a stand-in whose `linear_sum_assignment` imports the real one if ever called (`ScipyOptimizeStandIn`);
scipy.optimize is imported as ever by anything else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

UNUSED_OPTIONAL = ("sklearn",)
# The Ray workers of a run call it as they start (init_ray's runtime_env), before any actor is built.
WORKER_SETUP_HOOK = f"{__name__}.hide_unused_optional_packages"


SCIPY_FREE_PACKAGE = "transformers.loss."  # its detection losses (6 modules in 5.19) take the stand-in


def hide_unused_optional_packages() -> None:
    """Hides each package in UNUSED_OPTIONAL that this process has not imported yet, and gives
    SCIPY_FREE_PACKAGE's modules the stand-in scipy.optimize (the finder is installed once per process)."""
    for name in UNUSED_OPTIONAL:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    if not any(isinstance(f, ScipyOptimizeStandIn) for f in sys.meta_path):
        sys.meta_path.insert(0, ScipyOptimizeStandIn(SCIPY_FREE_PACKAGE))


class ScipyOptimizeStandIn(importlib.abc.MetaPathFinder):
    """Finds the modules under `prefix` as the other finders do, and runs each with a stand-in scipy.optimize
    unless the real one is imported already."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.prefix):
            return None
        others = [f for f in sys.meta_path if f is not self and hasattr(f, "find_spec")]
        for finder in others:
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _StandInLoader(spec.loader)
                return spec
        return None


class _StandInLoader(importlib.abc.Loader):
    """Runs the module with a stand-in `scipy.optimize` whose `linear_sum_assignment` imports the real one
    when called (transformers decided earlier that scipy is installed, so it must find the name)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if "scipy.optimize" in sys.modules:  # loaded already: nothing to save
            self.loader.exec_module(module)
            return
        stand_in = ModuleType("scipy.optimize")
        stand_in.linear_sum_assignment = _linear_sum_assignment  # type: ignore[attr-defined]
        sys.modules["scipy.optimize"] = stand_in
        try:
            self.loader.exec_module(module)
        finally:
            if sys.modules.get("scipy.optimize") is stand_in:
                del sys.modules["scipy.optimize"]


def _linear_sum_assignment(*args: object, **kwargs: object) -> object:
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(*args, **kwargs)
