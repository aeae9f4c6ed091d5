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
"""

from __future__ import annotations

import sys

UNUSED_OPTIONAL = ("sklearn",)
# The Ray workers of a run call it as they start (init_ray's runtime_env), before any actor is built.
WORKER_SETUP_HOOK = f"{__name__}.hide_unused_optional_packages"


def hide_unused_optional_packages() -> None:
    """Hides each package in UNUSED_OPTIONAL that this process has not imported yet."""
    for name in UNUSED_OPTIONAL:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
