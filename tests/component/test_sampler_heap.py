"""A built sampler's start-up heap (engine, model, env, index) is out of the garbage collector's full
collections (actors/heap.py): `runtime/builder.py:make_sampler` freezes it (both wirings)."""

from __future__ import annotations

import gc

from configs.schema import load_config
from runtime.builder import make_sampler


def test_make_sampler_freezes_the_backend_it_built(tiny_model_dir: str) -> None:
    cfg = load_config(overrides=["sampler.backend=hf", "logging.progress=false"])
    before = gc.get_freeze_count()
    sampler = make_sampler(cfg, tiny_model_dir)
    try:
        model = sampler.backend.model  # type: ignore[attr-defined]
        assert gc.get_freeze_count() > before
        assert all(o is not model for o in gc.get_objects())  # frozen: no generation tracks it
    finally:
        sampler.close()
        gc.unfreeze()
