"""Initialize–expand trees from the agent loop: each turn once, K = M + completed branches, branch prefixes
identical to their source, observations masked, every node stamped (issue 4 acceptance, scripted backend)."""

import itertools
import json

import numpy as np
import pytest

from actors.agent_loop import LoopLimits
from actors.chat import ChatFormat
from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv, tokenizer_texts
from actors.policy.tiny_model import build_tokenizer
from actors.tree_sampler import TreeSampler, TreeShape
from tests.fakes import ScriptedBackend


@pytest.fixture(scope="module")
def kb_env():
    return SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))


@pytest.fixture(scope="module")
def tokenizer(kb_env):
    return build_tokenizer(tokenizer_texts(kb_env, n_questions=200, n_oracle=20))


def tree_invariants(tree, chat):
    """Checks the acceptance invariants on one tree and returns (num_initial, num_branch_leaves)."""
    children = tree.children
    for n in tree.nodes[1:]:
        assert n.policy_version == 0 and len(n.tokens) > 0  # no weight sink: the backend's first version
        assert n.loss_mask.all()  # turn tokens are all sampled tokens (mask_truncated_turn off)
        assert np.isfinite(n.behavior_logprobs).all()
        if children[n.node_id]:  # a continued turn ends with the stop token and carries its observation
            assert n.tokens[-1] in chat.stop_token_ids and len(n.obs_tokens) > 0
    # every stored sequence = prompt + (turn, obs)*: observations never enter the loss (no mask on obs)
    first_turns = children[0]
    return len(first_turns), tree.num_leaves - len(first_turns)


def test_trees_from_scripted_backend(kb_env, tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    tasks = kb_env.tasks("train", n=6)
    by_q = {t.question: t for t in tasks}

    def qa(context):
        text = tokenizer.decode(context)
        task = next(t for q, t in by_q.items() if q in text)
        return f"{task.meta['chain'][0]} {task.meta['path'][0]}", task.answers[0]

    backend = ScriptedBackend(tokenizer, seed=3, question_answer=qa)
    limits = LoopLimits(max_turns=4, max_turn_tokens=24, token_budget=400)
    sampler = TreeSampler(backend, kb_env, chat, TreeShape(M=4, N=2), limits)
    trees = sampler.sample_trees(tasks, np.random.default_rng(0))
    assert len(trees) == 6
    total_branches = 0
    for tree in trees:
        m, branches = tree_invariants(tree, chat)
        assert m == 4  # M initial trajectories hang under the prompt
        total_branches += branches
        # K = M + completed branches; each branch adds exactly one leaf, at most N per trajectory
        assert tree.num_leaves == 4 + branches and branches <= 4 * 2
        finish = json.loads(tree.meta["finish"])
        assert sorted(int(k) for k in finish) == tree.leaves.tolist()
        assert set(finish.values()) <= {"answer", "malformed", "truncated", "max_turns", "token_budget"}
        # rewards: 1 only for the right answer
        for leaf in tree.leaves:
            r = tree.nodes[leaf].reward
            assert r in (0.0, 1.0)
            if r == 1.0:
                assert finish[str(leaf)] == "answer"
    assert total_branches > 0  # the menu yields multi-turn trunks, so anchors exist


def test_branch_prefix_is_byte_identical_to_its_source(kb_env, tokenizer):
    """A branch continues from the anchor's stored ids: its context = the source trajectory's prefix."""
    chat = ChatFormat.from_tokenizer(tokenizer)
    tasks = kb_env.tasks("train", n=3)
    seen = []

    class Recording(ScriptedBackend):
        def sample(self, requests):
            seen.extend(list(r.context) for r in requests)
            return super().sample(requests)

    backend = Recording(tokenizer, seed=5)
    sampler = TreeSampler(backend, kb_env, chat, TreeShape(M=3, N=2), LoopLimits(max_turns=5))
    for tree in sampler.sample_trees(tasks, np.random.default_rng(1)):
        for node in tree.nodes[1:]:
            # the context sampled for this turn = prompt + every (turn, obs) on its path, as stored
            expected = list(tree.prompt_tokens)
            for i in tree.path(node.node_id)[:-1]:
                expected += [*tree.nodes[i].tokens, *tree.nodes[i].obs_tokens]
            assert expected in seen


def test_flat_groups_are_trees_without_branches(kb_env, tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    backend = ScriptedBackend(tokenizer, seed=7)
    sampler = TreeSampler(backend, kb_env, chat, TreeShape(M=8, N=0), LoopLimits())
    [tree] = sampler.sample_trees(kb_env.tasks("train", n=1), np.random.default_rng(2))
    assert tree.num_leaves == 8 and len(tree.children[0]) == 8
    assert all(len(c) <= 1 for c in tree.children[1:])  # chains only


@pytest.mark.parametrize("loop", ["lockstep", "async"])
def test_versions_are_stamped_between_turns(kb_env, tokenizer, loop):
    chat = ChatFormat.from_tokenizer(tokenizer)

    class VersionInLogprobs(ScriptedBackend):  # each sampled token's log-prob says the version that drew it
        def sample(self, requests):
            out = super().sample(requests)
            for res in out:
                res.logprobs[:] = [-0.125 * (self.version + 1)] * len(res.logprobs)  # exact in float32
            return out

    backend = VersionInLogprobs(tokenizer, seed=11)

    class EveryPoll:  # a WeightSink with a new version at every poll: a weight update between turns
        def poll(self, timeout_ms=0):
            return backend.version + 1, {}

    shape, limits = TreeShape(M=2, N=1), LoopLimits()
    sampler = TreeSampler(backend, kb_env, chat, shape, limits, weights=EveryPoll(), loop=loop)
    [tree] = sampler.sample_trees(kb_env.tasks("train", n=1), np.random.default_rng(3))
    for node in tree.nodes[1:]:
        # the stamp is the version whose weights sampled the turn: lp = -(v + 1) / 8  =>  v = -8 lp - 1
        drawn_by = {round(-8.0 * float(lp) - 1.0) for lp in node.behavior_logprobs}
        assert drawn_by == {node.policy_version}
    for leaf in tree.leaves:
        versions = [tree.nodes[i].policy_version for i in tree.path(leaf)]
        if loop == "lockstep":  # a poll before every round of turns, each a new version: +1 per turn
            assert versions[0] == 1 and all(b > a for a, b in itertools.pairwise(versions))
        else:  # episodes share one gate, each boundary takes what the poller has: never older along a path
            assert versions == sorted(versions)
