"""4 samplers share one retrieval service: each built by `make_sampler` with `env.retriever = service`
(no index of its own), sampling trees at the same time; when the service goes away, searches become
tool-error observations counted in `env/retrieval_errors` and the samplers keep producing trees."""

from __future__ import annotations

import threading

import numpy as np

from actors.envs.retrieval_index import open_index
from actors.envs.retrieval_server import RetrievalServer
from actors.envs.search import Bm25Index
from actors.sampler_setup import load_tokenizer
from actors.tree_sampler import TreeSampler
from configs.schema import load_config
from runtime.builder import make_sampler
from runtime.retrieval_actor import service_corpus
from tests.fakes import ScriptedBackend


class Counting:
    def __init__(self, index):
        self.index, self.queries, self.lock = index, 0, threading.Lock()

    def __len__(self):
        return len(self.index)

    def search(self, queries, topk):
        with self.lock:
            self.queries += len(queries)
        return self.index.search(queries, topk)


def _scripted(tokenizer, tasks, seed: int) -> ScriptedBackend:
    by_question = {t.question: t for t in tasks}

    def qa(context):  # searches for the first hop of the task in the prompt, or answers it
        text = tokenizer.decode(context)
        task = next(t for q, t in by_question.items() if q in text)
        return f"{task.meta['chain'][0]} {task.meta['path'][0]}", task.answers[0]

    return ScriptedBackend(tokenizer, seed=seed, question_answer=qa)


def _sample(sampler: TreeSampler, n: int, seed: int) -> list:
    picks = np.random.default_rng(seed).choice(len(sampler.tasks), size=n, replace=False)
    return sampler.sample_trees([sampler.tasks[int(i)] for i in picks], np.random.default_rng(seed))


def test_four_samplers_share_one_service(tmp_path, tiny_model_dir):
    base = ["env.retriever=service", "algo.M=2", "algo.N=1", "env.max_turns=3", "env.max_turn_tokens=24"]
    corpus, _ = service_corpus(load_config(overrides=[*base, f"run.run_dir={tmp_path}"]))
    index = Counting(open_index(corpus).index)
    server = RetrievalServer(index).start()
    cfg = load_config(overrides=[*base, f"env.retriever_url={server.url}"])
    tokenizer = load_tokenizer(tiny_model_dir)
    samplers = []
    for i in range(4):
        sampler = make_sampler(cfg, tiny_model_dir, i, backend=ScriptedBackend(tokenizer))
        sampler.backend = _scripted(tokenizer, sampler.tasks, seed=i)
        assert not isinstance(sampler.env.index, Bm25Index)  # nothing indexed in the sampler
        samplers.append(sampler)
    results: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.update({i: _sample(samplers[i], 3, i)})) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert sorted(results) == [0, 1, 2, 3] and all(len(trees) == 3 for trees in results.values())
        searched = [s.get_metrics() for s in samplers]
        assert all(m["env/retrieval_errors"] == 0.0 for m in searched)
        assert index.queries >= 4  # every sampler's searches went to the one service
        for i in range(4):
            observations = [
                tokenizer.decode(n.obs_tokens) for t in results[i] for n in t.nodes[1:] if len(n.obs_tokens)
            ]
            assert any("The " in o and " of " in o for o in observations)  # facts came back
    finally:
        server.stop()
    after = _sample(samplers[0], 6, seed=9)  # the service is gone: the sampler goes on
    assert len(after) == 6
    failed = [tokenizer.decode(n.obs_tokens) for t in after for n in t.nodes[1:] if len(n.obs_tokens)]
    assert any("error: search failed" in o for o in failed)
    assert samplers[0].get_metrics()["env/retrieval_errors"] > 0
