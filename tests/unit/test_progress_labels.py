"""Progress labels (actors/envs/progress.py) on hand-built trees over a six-fact KB, labels worked by hand.

The KB and what BM25 top-2 returns for the queries used below (asserted in `test_observations`):

    "Ana Bel employer"  -> The employer of Ana Bel is Cor Labs.   | The birthplace of Ana Bel is Dova.
    "Cor Labs founder"  -> The founder of Cor Labs is Eli Fum.    | The headquarters of Cor Labs is Dova.
    "Dova"              -> The birthplace of Ana Bel is Dova.     | The headquarters of Cor Labs is Dova.
    "qqq zzz"           -> no results

The question is 2-hop: Ana Bel --employer--> Cor Labs --founder--> Eli Fum, so gold fact 0 is "The employer
of Ana Bel is Cor Labs." and gold fact 1 is "The founder of Cor Labs is Eli Fum."
"""

import numpy as np
import pytest

from actors.envs.base import Task
from actors.envs.progress import gold_facts_in, next_fact, progress_labels
from actors.envs.synthetic_kb import KnowledgeBase, SyntheticKBEnv, question_text
from system.tree import RolloutTree, make_node

FACTS = {
    ("Ana Bel", "employer"): "Cor Labs",
    ("Ana Bel", "birthplace"): "Dova",
    ("Cor Labs", "founder"): "Eli Fum",
    ("Cor Labs", "headquarters"): "Dova",
    ("Eli Fum", "employer"): "Gix Corp",
    ("Gix Corp", "founder"): "Ana Bel",
}
ENTITIES = {
    "person": ("Ana Bel", "Eli Fum"),
    "company": ("Cor Labs", "Gix Corp"),
    "city": ("Dova",),
    "country": (),
}
PATH, CHAIN = ["employer", "founder"], ["Ana Bel", "Cor Labs", "Eli Fum"]
TASK = Task(
    "t0",
    question_text("Ana Bel", tuple(PATH)),
    ("Eli Fum",),
    "synthetic_kb",
    {"hops": 2, "path": PATH, "chain": CHAIN},
)
# Turn texts by token id: each hand-built turn is one token whose id indexes this table.
TEXTS = [
    "",  # 0 unused (the root has no turn tokens)
    "search: Ana Bel employer",  # 1 finds gold fact 0
    "search: Cor Labs founder",  # 2 finds gold fact 1
    "answer: Eli Fum",  # 3 right
    "answer: Cor Labs",  # 4 wrong
    "search: Dova",  # 5 no gold fact
    "I am not sure",  # 6 no call at all (ends the episode: malformed)
    "open: kb-0001",  # 7 unknown tool: an error observation
    "search: qqq zzz",  # 8 no results
]


@pytest.fixture(scope="module")
def env():
    return SyntheticKBEnv(kb=KnowledgeBase(ENTITIES, FACTS))


def decode(ids):
    assert len(ids) == 1
    return TEXTS[ids[0]]


def chain_tree(text_ids, branches=()):
    """A trunk of turns with `text_ids`, plus branches (parent node, [text ids]); the last turn of each
    episode is a leaf (reward 0: the labeller replays rewards, it never reads the stored one)."""
    nodes = [make_node(0, -1, 0, obs_tokens=[9])]
    depth = {0: 0}

    def episode(parent, ids):
        for k, tid in enumerate(ids):
            nid = len(nodes)
            last = k == len(ids) - 1
            nodes.append(make_node(nid, parent, depth[parent] + 1, [tid], reward=0.0 if last else None))
            depth[nid], parent = depth[parent] + 1, nid

    episode(0, text_ids)
    for parent, ids in branches:
        episode(parent, ids)
    return RolloutTree.build("tree", nodes, prompt_id="t0")


def test_observations(env):
    assert env.search("Ana Bel employer").splitlines()[0] == "The employer of Ana Bel is Cor Labs."
    assert env.search("Cor Labs founder").splitlines()[0] == "The founder of Cor Labs is Eli Fum."
    assert gold_facts_in(env.search("Ana Bel employer"), CHAIN, PATH) == {0}
    assert gold_facts_in(env.search("Cor Labs founder"), CHAIN, PATH) == {1}
    assert gold_facts_in(env.search("Dova"), CHAIN, PATH) == set()
    assert env.search("qqq zzz") == "no results"
    assert next_fact(frozenset(), 2) == 0 and next_fact(frozenset({0}), 2) == 1
    assert next_fact(frozenset({1}), 2) == 0 and next_fact(frozenset({0, 1}), 2) is None


def test_oracle_trajectory_is_all_progress(env):
    # fact 0 (next: 0) -> True; fact 1 (next: 1) -> True; right answer -> True
    labels = progress_labels(chain_tree([1, 2, 3]), TASK, env, decode)
    assert labels.tolist() == [True, True, True]
    assert [t for t, _ in env.oracle_turns(TASK)] == [TEXTS[1], TEXTS[2], TEXTS[3]]


def test_wrong_answer_is_not_progress(env):
    # fact 0 -> True; "answer: Cor Labs" gets reward 0 -> False
    assert progress_labels(chain_tree([1, 4]), TASK, env, decode).tolist() == [True, False]


def test_repeated_search_is_not_progress(env):
    # fact 0 -> True; the same query again returns fact 0 only, already found (next is 1) -> False;
    # then fact 1 -> True; right answer -> True
    labels = progress_labels(chain_tree([1, 1, 2, 3]), TASK, env, decode)
    assert labels.tolist() == [True, False, True, True]


def test_nothing_new_malformed_unknown_and_empty_results_are_not_progress(env):
    # "search: Dova" states no gold fact; "open:" is an unknown tool; "qqq zzz" finds nothing;
    # then fact 0 (still next) -> True; "I am not sure" has no call -> False (ends the episode)
    labels = progress_labels(chain_tree([5, 7, 8, 1, 6]), TASK, env, decode)
    assert labels.tolist() == [False, False, False, True, False]


def test_out_of_order_fact_is_not_progress_but_counts_as_found(env):
    # fact 1 first: the next fact is 0, so -> False, but fact 1 is now found; fact 0 -> True (next is 0);
    # the fact-1 search again: every fact found, nothing next -> False; right answer -> True
    labels = progress_labels(chain_tree([2, 1, 2, 3]), TASK, env, decode)
    assert labels.tolist() == [False, True, False, True]


def test_branches_see_only_their_own_path(env):
    # trunk: nodes 1 (fact 0, True), 2 (fact 1, True), 3 (right answer, True)
    # branch under node 1: node 4 repeats fact 0 (found above it) -> False, node 5 wrong answer -> False
    # branch under node 2: node 6 right answer -> True
    # second trajectory under the prompt: node 7 fact 1 before fact 0 -> False, node 8 fact 0 -> True
    # (facts found in the trunk do not count on this path), node 9 right answer -> True
    tree = chain_tree([1, 2, 3], branches=[(1, [1, 4]), (2, [3]), (0, [2, 1, 3])])
    assert [n.parent for n in tree.nodes[1:]] == [0, 1, 2, 1, 4, 2, 0, 7, 8]
    labels = progress_labels(tree, TASK, env, decode)
    assert labels.tolist() == [True, True, True, False, False, True, False, True, True]
    assert labels.dtype == np.bool_ and labels.shape == (len(tree.nodes) - 1,)


def test_the_task_must_match_and_carry_its_chain(env):
    tree = chain_tree([1, 3])
    with pytest.raises(ValueError, match="not for task"):
        progress_labels(tree, Task("other", "q", ("a",), "synthetic_kb", TASK.meta), env, decode)
    with pytest.raises(ValueError, match="chain and path"):
        progress_labels(tree, Task("t0", "q", ("a",), "synthetic_kb", {}), env, decode)
