"""The learner's parallel plan (learner/parallel_plan.py): one `Learner` class, whatever it runs on, and the
FSDP2 ranks' plan (learner/sharded.py `Fsdp2Ranks`) deciding only which micro-batches a rank runs. The
numerical equivalence of R ranks and one process is tests/component/test_sharded_distributed.py's."""

import ast
from pathlib import Path

from test_microbatch_plan import chain_tree

from learner.minibatch import microbatch_pieces, plan_microbatches
from learner.parallel_plan import RankShare, SingleProcess
from learner.sharded import Fsdp2Ranks

LEARNER = Path(__file__).resolve().parents[2] / "learner"


def test_the_learner_has_no_subclass_the_plan_is_the_only_difference():
    """Every learner module is read: no class derives from `Learner` (the sharded one was a subclass that
    overrode 14 of its methods), and learner.py holds that one class."""
    subclasses = []
    for path in sorted(LEARNER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if "Learner" in bases:
                    subclasses.append(f"{path.name}:{node.name}")
    assert subclasses == []
    classes = [
        n.name for n in ast.parse((LEARNER / "learner.py").read_text()).body if isinstance(n, ast.ClassDef)
    ]
    assert classes == ["Learner"]


def test_one_rank_of_fsdp2_shares_a_minibatch_as_one_process_does():
    trees = [chain_tree(), chain_tree(), chain_tree()]
    for budget, packed in [(0, True), (9, True), (12, False)]:
        single = SingleProcess().share(trees, budget, packed)
        assert single == RankShare(plan_microbatches(trees, budget, packed))
        assert Fsdp2Ranks(0, 1).share(trees, budget, packed) == single  # no padding on one rank


def test_ranks_split_the_pieces_and_pad_to_the_most_passes():
    """Three equal trees over two ranks: every piece on exactly one rank, and the rank with fewer
    micro-batches pads up to the other's count with the mini-batch's smallest piece."""
    trees, budget = [chain_tree(), chain_tree(), chain_tree()], 0  # one micro-batch per rank's pieces
    pieces = microbatch_pieces(trees, budget, True)
    shares = [Fsdp2Ranks(r, 2).share(trees, budget, True) for r in range(2)]
    trained = sorted((p.tree, p.nodes) for s in shares for m in s.micro for p in m)
    assert trained == sorted((p.tree, p.nodes) for p in pieces)
    assert [len(s.micro) + s.padding for s in shares] == [1, 1]  # the same number of passes
    assert [len(s.micro) for s in shares] == [1, 1] and all(s.padding_piece is None for s in shares)

    small = Fsdp2Ranks(1, 4).share(trees, budget, True)  # 3 trees over 4 ranks: the last has none
    last = Fsdp2Ranks(3, 4).share(trees, budget, True)
    assert (len(small.micro), small.padding) == (1, 0)
    assert (len(last.micro), last.padding) == (0, 1)
    assert last.padding_piece == min(pieces, key=lambda p: (p.tokens, p.tree, p.nodes[0]))
