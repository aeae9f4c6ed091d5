"""A process of ours loads transformers without scikit-learn or scipy.optimize (runtime/lean_imports.py says
why), the dense encoder still gets scikit-learn, and scipy.optimize is the real one wherever asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import importlib.util, json, sys
from runtime.lean_imports import hide_unused_optional_packages
hide_unused_optional_packages()
from transformers import AutoModelForCausalLM  # what the learner, rank and sampler processes import
import transformers.generation.candidate_generator as cg  # the module that imports scikit-learn if it can
from transformers.utils import is_sklearn_available
import transformers.loss.loss_utils  # every model import loads it: its detection losses want scipy.optimize
unused = ("sklearn", "sklearn.metrics", "scipy.stats", "scipy.optimize", "pandas")
loaded = sorted(n for n in unused if sys.modules.get(n))
import numpy
import transformers.loss.loss_rt_detr as rt  # its matcher still works, importing the real one when called
matched = rt.linear_sum_assignment(numpy.array([[1.0, 2.0], [2.0, 1.0]]))[1].tolist()
import scipy.optimize  # and anything else imports the real module as ever
real = scipy.optimize.linear_sum_assignment.__module__
hidden = dict(transformers=is_sklearn_available(), roc_curve=hasattr(cg, "roc_curve"), loaded=loaded)
hidden |= dict(matched=matched, real=real)
from actors.envs.dense import unhide_sklearn  # what the dense encoder calls before sentence-transformers
unhide_sklearn()
import sklearn.metrics
print(json.dumps({**hidden, "after": importlib.util.find_spec("sklearn") is not None}))
"""


def test_transformers_loads_without_scikit_learn_and_the_encoder_can_still_import_it():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # scikit-learn is installed here (the retrieval extra), yet transformers sees none and loads none of it
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "transformers": False,
        "roc_curve": False,
        "loaded": [],
        "matched": [0, 1],
        "real": "scipy.optimize._lsap",
        "after": True,
    }
