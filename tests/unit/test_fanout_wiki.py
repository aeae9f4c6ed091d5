"""The real demo's data: which FanOutQA leaves are kept, their golds, the split by page, the files."""

import json

import pytest

from actors.envs.fanout_wiki import FanoutWikiError, build_fanout_wiki, golds_of, is_heldout, package_file
from actors.envs.multihop_qa import load_corpus, load_dataset


def _leaf(i, question, answer, title):
    return {"id": f"q{i}", "question": question, "answer": answer, "evidence": {"title": title}}


SUMMARIES = {
    "Apple Inc.": {"extract": "Apple Inc. is headquartered in Cupertino, California."},
    "Taj Mahal": {"extract": "The Taj Mahal was built from 1631 to 1648."},
    "Nowhere": {"extract": ""},
}
DEV = [
    {
        "id": "top1",
        "decomposition": [
            _leaf(1, "What is the headquarter of Apple?", "Cupertino, California", "Apple Inc."),
            _leaf(2, "When was the Taj Mahal built?", 1631, "Taj Mahal"),
            _leaf(3, "Who owns Apple?", "Its shareholders", "Apple Inc."),  # not in the summary: dropped
            _leaf(4, "Is it big?", True, "Apple Inc."),  # a bool is no readable answer: dropped
            {
                "id": "mid",
                "question": "x",
                "decomposition": [_leaf(5, "WHEN was the Taj Mahal built", 1631, "Taj Mahal")],
            },
            _leaf(6, "Where is Atlantis?", "Sea", "Atlantis"),  # no summary for the page: dropped
        ],
    }
]


def test_kept_questions_golds_split_and_corpus():
    ds = build_fanout_wiki(DEV, SUMMARIES)
    rows = ds.train + ds.heldout
    # leaves 1 and 2 kept; 5 repeats 2 once normalized ("when was taj mahal built"), 3/4/6 not readable
    assert sorted(r["id"] for r in rows) == ["q1", "q2"]
    by_id = {r["id"]: r for r in rows}
    assert by_id["q1"]["golden_answers"] == ["Cupertino, California", "Cupertino"]
    assert by_id["q2"]["golden_answers"] == ["1631"]
    for r in rows:  # each on the side its page hashes to
        assert (r in ds.heldout) == is_heldout(r["metadata"]["page"])
    # the empty summary is left out of the corpus, the two others are in, sorted by title
    assert [p["id"] for p in ds.corpus] == ["Apple Inc.", "Taj Mahal"]


def test_golds_keep_numbers_whole():
    assert golds_of("8,848.86 m") == ["8,848.86 m"]  # no ", ": one gold
    assert golds_of("Washington, D.C.") == ["Washington, D.C.", "Washington"]
    assert golds_of("1, 2") == ["1, 2"]  # a head without a letter is no answer on its own


def test_written_files_read_back_as_multihop_qa(tmp_path):
    from actors.envs.fanout_wiki import write_fanout_wiki

    ds = build_fanout_wiki(DEV, SUMMARIES)
    manifest = write_fanout_wiki(ds, tmp_path)
    assert manifest == {"train": len(ds.train), "heldout": len(ds.heldout), "corpus": 2}
    passages = load_corpus(tmp_path / "corpus.jsonl")
    assert [(p.title, p.text) for p in passages][1] == (
        "Taj Mahal",
        "The Taj Mahal was built from 1631 to 1648.",
    )
    for split in ("train", "heldout"):
        if getattr(ds, split):
            tasks = load_dataset(tmp_path / f"{split}.jsonl").tasks
            assert [t.question for t in tasks] == [r["question"] for r in getattr(ds, split)]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest


def test_a_missing_package_is_one_line():
    with pytest.raises(FanoutWikiError, match="package 'no_such_pkg_xyz' is not installed"):
        package_file("no_such_pkg_xyz", "data/x.json")


def test_the_real_demo_config_loads_and_a_missing_package_model_is_one_line():
    from configs.schema import load_config
    from runtime.model_setup import ModelPathError, check_model_path

    cfg = load_config("configs/real_smollm2.yaml", [])
    assert (cfg.env.name, cfg.env.protocol, cfg.learner.lora.rank, cfg.algo.method) == (
        "multihop_qa",
        "plain",
        16,
        "treeopsd",
    )
    with pytest.raises(ModelPathError, match=r"^model.path = 'pkg:no_such_pkg_xyz/m.gguf': package"):
        check_model_path("pkg:no_such_pkg_xyz/m.gguf")
