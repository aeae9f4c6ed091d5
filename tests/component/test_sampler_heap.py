"""A built sampler's start-up heap (engine, model, env, index) is out of the garbage collector's full
collections (actors/heap.py): `build_sampler` freezes it."""

from __future__ import annotations

import gc

from actors.sampler_setup import build_sampler
from configs.schema import load_config


def test_build_sampler_freezes_the_backend_it_built(tiny_model_dir: str) -> None:
    cfg = load_config(overrides=["sampler.backend=hf", "logging.progress=false"])
    before = gc.get_freeze_count()
    sampler = build_sampler(cfg, tiny_model_dir)
    try:
        model = sampler.backend.model  # type: ignore[attr-defined]
        assert gc.get_freeze_count() > before
        assert all(o is not model for o in gc.get_objects())  # frozen: no generation tracks it
    finally:
        sampler.close()
        gc.unfreeze()
