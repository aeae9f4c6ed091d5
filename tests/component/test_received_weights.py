"""A version received through the publisher's sealed memfd keeps that memfd open in the receiving process
(actors/received_weights.py), so a vLLM sampler's workers can map it with no copy; an unsealed one has
none."""

from __future__ import annotations

import numpy as np
import pytest

from learner.weight_publisher import WeightPublisher
from tests import weight_fixtures
from tests.weight_fixtures import CHUNK_MB, WAIT_MS, assert_weights, memfds, weights

subscriber = weight_fixtures.subscriber


def test_a_sealed_version_stays_readable_here_after_the_publisher_is_gone(subscriber):
    before = memfds()
    pub = WeightPublisher(chunk_mb=CHUNK_MB, keep=1)
    try:
        sub = subscriber(pub.endpoint)
        pub.publish(weights(3), 3)
        got = sub.poll(WAIT_MS)
        assert_weights(got, 3)
        assert sub.stats()["transport"] == "shm" and sub.stats()["verified"] == "sealed"
        memfd = got[1].memfd
        assert memfd is not None
        desc = memfd.describe(["embed", "norm"])
    finally:
        pub.close()  # every descriptor of the publisher's is closed: what is left is ours
    # embed: 64 x 160 float32 = 40,960 bytes at 0; norm: 7 bfloat16 = 14 bytes at 40,960 (a multiple of 64)
    embed_at, norm_at = ["embed", "float32", [64, 160], 0, 40960], ["norm", "bfloat16", [7], 40960, 14]
    assert desc["tensors"] == [embed_at, norm_at]
    assert desc["sealed"] is True and memfds() - before == {memfd.ino}
    with open(desc["path"], "rb") as f:
        embed = np.frombuffer(f.read(40960), dtype="<f4")
    assert embed.shape == (10240,) and set(embed.tolist()) == {3.0}  # weights(3) fills embed with 3.0
    del got, memfd
    assert memfds() <= before  # dropping the version closes the descriptor


def test_describe_refuses_a_closed_memfd_and_an_unsealed_version_has_none(subscriber):
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=1) as pub:
        sub = subscriber(pub.endpoint)
        pub.publish(weights(1), 1)
        got = sub.poll(WAIT_MS)
        assert_weights(got, 1)
        got[1].memfd.close()
        with pytest.raises(ValueError, match="the weight memfd is closed"):
            got[1].memfd.describe(["embed"])
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=1, seal=False) as pub:
        sub = subscriber(pub.endpoint)
        pub.publish(weights(2), 2)
        got = sub.poll(WAIT_MS)
        assert_weights(got, 2)
        assert sub.stats()["verified"] == "checksums"  # unsealed: hashed, and not offered to other readers
        assert got[1].memfd is None
