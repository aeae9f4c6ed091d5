"""An asynchronous run on local Ray with a proximal policy and the rollout correction (docs/algorithm.md
§11.1): every metric of the staleness view reaches tensorboard."""

import pytest

from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import TensorboardSink, read_scalars
from tests.ray.test_train_e2e import small_cfg

pytestmark = pytest.mark.ray

MISMATCH_TAGS = [f"mismatch/{k}" for k in ("k1", "k3", "tokens", "k3_lag0")]
CORRECTION_TAGS = [f"correction/{k}" for k in ("weight_mean", "weight_max", "clipped_token_frac")]
CORRECTION_TAGS += [f"correction/{k}" for k in ("turn_kl", "turn_ess")]
CORRECTION_TAGS += [f"correction/{k}" for k in ("masked_token_frac", "masked_seq_frac")]
STALENESS_TAGS = [*MISMATCH_TAGS, *CORRECTION_TAGS, "tree/truncated_frac", "sampler/truncated_frac"]


def test_the_async_default_step_start_with_token_tis_logs_the_staleness_view(
    ray_cluster, tmp_path, tiny_model_dir
):
    # one sampler: the learner's view of staleness is what is logged (a second sampler cost ~14 CPU-s)
    cfg = small_cfg(tmp_path, **{"store.eta": 2, "sampler.num_samplers": 1})
    assert (cfg.algo.proximal, cfg.algo.rollout_correction) == ("step_start", "token_tis")  # run.mode = async
    topo = start_topology(cfg, tiny_model_dir)
    sink = TensorboardSink(tmp_path / "tb")
    try:
        assert Driver(cfg, topo, sink).run(3)["steps"] == 3
    finally:
        stop_topology(topo)
        sink.close()
    scalars = read_scalars(tmp_path / "tb")
    assert not [t for t in STALENESS_TAGS if t not in scalars], sorted(scalars)
    weights = [v for _, v in scalars["correction/weight_max"]]
    assert all(0 < w <= 2.0 for w in weights)  # token_tis truncates at algo.is_threshold = 2
    assert all(0 < v <= 1.0 for _, v in scalars["correction/turn_ess"])  # Kish: (Σw)² / (n Σw²) ≤ 1
    assert all(v >= 0 for _, v in scalars["mismatch/k3"])  # k3 ≥ 0 by construction
    # the samplers `treeopsd train` starts on Ray froze their long-lived heap (runtime/sampler_role.py); the
    # code before this check skipped it there, so the count stayed 0 (gc.freeze never called in the actor)
    frozen = [v for tag, points in scalars.items() if tag.endswith("sampler/gc_frozen") for _, v in points]
    assert frozen and min(frozen) > 1000
