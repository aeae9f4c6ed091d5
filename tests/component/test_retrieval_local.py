"""Evaluation outside a run with `env.retriever = service` and no URL (runtime/retrieval_actor.py
`local_retrieval`): the service is started in this process over the run's corpus and stopped after."""

import urllib.error
import urllib.request

import pytest

from actors.sampler_setup import build_env
from configs.schema import parse_config
from runtime.retrieval_actor import local_retrieval


def test_local_retrieval_serves_the_kb_for_the_block_only(tmp_path):
    cfg = parse_config({"run": {"run_dir": str(tmp_path / "run")}, "env": {"retriever": "service"}})
    with local_retrieval(cfg) as served:
        url = served.env.retriever_url
        assert url is not None and url.startswith("http://127.0.0.1:") and cfg.env.retriever_url is None
        env = build_env(served)
        task = env.tasks("eval", per_hop=1)[0]
        first_hop = task.meta["chain"][0]  # the question's start entity: its facts are in the corpus
        assert first_hop in env.search(first_hop)
    with pytest.raises(urllib.error.URLError, match="Connection refused"):
        urllib.request.urlopen(url, data=b"{}", timeout=5)  # stopped when the block ended


def test_local_retrieval_is_a_no_op_without_a_service(tmp_path):
    cfg = parse_config({"run": {"run_dir": str(tmp_path)}})
    with local_retrieval(cfg) as same:
        assert same is cfg
