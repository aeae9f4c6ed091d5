"""The default offline task: multi-hop lookups over a generated knowledge base (docs/design.md §9.2).

Entities have made-up pronounceable names, so no pretrained model knows the answers. Eight functional
relations give one passage per fact, ``"The {relation} of {subject} is {object}."``; the default sizes
(300 persons, 60 companies, 80 cities, 20 countries) give 300*3 + 60*2 + 80 + 20*2 = 1,140 passages.
A question follows a relation path from a start entity, e.g. "What is the country of the birthplace of
Tavo Mirel?", and its single answer is the end of the chain.

Two choices keep the oracle (``"search: {E_i} {r_{i+1}}"``) exact under BM25 top-2:
- every name word is unique across the KB and is neither a stop word nor a relation word, and
- mentor is one cycle over all persons, so a person is the mentor of exactly one other person. The query
  "X mentor" then ties exactly two passages ("The mentor of X is Y" and "The mentor of W is X"); with a
  free mentor relation a popular mentor would push the right passage out of the top 2.
Chains that revisit an entity are excluded, so an answer never appears in its own question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import pairwise, product

from bm25s.stopwords import STOPWORDS_EN

from actors.envs.base import Task, Tool, ToolEnv
from actors.envs.search import Bm25Index, Passage
from actors.envs.thinking import think_text, with_budget

RELATIONS: dict[str, tuple[str, str]] = {  # relation -> (subject type, object type)
    "birthplace": ("person", "city"),
    "employer": ("person", "company"),
    "mentor": ("person", "person"),
    "headquarters": ("company", "city"),
    "founder": ("company", "person"),
    "country": ("city", "country"),
    "capital": ("country", "city"),
    "leader": ("country", "person"),
}
ENTITY_TYPES = ("person", "company", "city", "country")
SYSTEM_PROMPT = "Use search: <query> or answer: <answer>."
COMPANY_SUFFIXES = ("Corp", "Labs", "Group", "Works")
TRAIN_SEED, EVAL_SEED = 1, 2
HELD_OUT_PER_HOP = 500  # questions per hop count the eval and the validation split can each hold
DATASET = "synthetic_kb"

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "st")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s", "m")
# Words a name may not be: relation/type words, company suffixes, stop words bm25s drops, yes/no.
_RESERVED = {*RELATIONS, *(s.lower() for s in COMPANY_SUFFIXES), *ENTITY_TYPES}
_RESERVED |= {*STOPWORDS_EN, "yes", "no", "noanswer"}


@dataclass(frozen=True)
class KBConfig:
    n_persons: int = 300
    n_companies: int = 60
    n_cities: int = 80
    n_countries: int = 20
    seed: int = 0


@dataclass(frozen=True)
class KnowledgeBase:
    """Entities by type and the facts ``(subject, relation) -> object`` in passage order."""

    entities: dict[str, tuple[str, ...]]
    facts: dict[tuple[str, str], str]

    def passages(self) -> list[Passage]:
        return [
            Passage(f"kb-{i:04d}", "", fact_text(s, r, o)) for i, ((s, r), o) in enumerate(self.facts.items())
        ]

    def follow(self, start: str, path: tuple[str, ...]) -> tuple[str, ...]:
        """The chain E0..Ek of entities visited along ``path``."""
        chain = [start]
        for rel in path:
            chain.append(self.facts[(chain[-1], rel)])
        return tuple(chain)


def fact_text(subject: str, relation: str, obj: str) -> str:
    return f"The {relation} of {subject} is {obj}."


class _Namer:
    """Draws pronounceable words, each unique (case-insensitively) across the whole KB."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set(_RESERVED)

    def word(self, min_syl: int = 2, max_syl: int = 3) -> str:
        while True:
            n = self.rng.randint(min_syl, max_syl)
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(n))
            w += self.rng.choice(_CODAS)
            if w not in self.used:
                self.used.add(w)
                return w.capitalize()


def generate_kb(config: KBConfig | None = None) -> KnowledgeBase:
    """Deterministic in ``config.seed``."""
    cfg = config or KBConfig()
    if min(cfg.n_persons, cfg.n_companies, cfg.n_cities, cfg.n_countries) < 1 or cfg.n_persons < 5:
        raise ValueError(f"KB sizes too small: {cfg}")
    if cfg.n_cities < cfg.n_countries or cfg.n_persons < cfg.n_countries:
        raise ValueError("need at least one city and one distinct leader per country")
    rng = random.Random(cfg.seed)
    namer = _Namer(rng)
    persons = tuple(f"{namer.word(2, 2)} {namer.word()}" for _ in range(cfg.n_persons))
    companies = tuple(f"{namer.word()} {rng.choice(COMPANY_SUFFIXES)}" for _ in range(cfg.n_companies))
    cities = tuple(namer.word() for _ in range(cfg.n_cities))
    countries = tuple(namer.word() for _ in range(cfg.n_countries))
    # every country gets at least one city, so its capital can be one of its own cities
    country_of = {
        c: countries[i] if i < len(countries) else rng.choice(countries) for i, c in enumerate(cities)
    }
    order = list(persons)
    rng.shuffle(order)
    mentor_of = {p: order[(i + 1) % len(order)] for i, p in enumerate(order)}  # one cycle, see module doc
    leaders = rng.sample(persons, len(countries))
    facts: dict[tuple[str, str], str] = {}
    for p in persons:
        facts[(p, "birthplace")] = rng.choice(cities)
        facts[(p, "employer")] = rng.choice(companies)
        facts[(p, "mentor")] = mentor_of[p]
    for c in companies:
        facts[(c, "headquarters")] = rng.choice(cities)
        facts[(c, "founder")] = rng.choice(persons)
    for city in cities:
        facts[(city, "country")] = country_of[city]
    for i, country in enumerate(countries):
        facts[(country, "capital")] = rng.choice([c for c in cities if country_of[c] == country])
        facts[(country, "leader")] = leaders[i]
    entities = {"person": persons, "company": companies, "city": cities, "country": countries}
    return KnowledgeBase(entities, facts)


def relation_paths(hops: int) -> list[tuple[str, ...]]:
    """All relation paths of length ``hops`` whose types chain (each hop starts where the last ended)."""
    return [
        path
        for path in product(RELATIONS, repeat=hops)
        if all(RELATIONS[a][1] == RELATIONS[b][0] for a, b in pairwise(path))
    ]


def question_text(start: str, path: tuple[str, ...]) -> str:
    return "What is the " + " of the ".join(reversed(path)) + f" of {start}?"


def _chains(kb: KnowledgeBase, hops: int) -> list[tuple[str, tuple[str, ...]]]:
    """Every (start, path) with ``hops`` hops whose chain visits distinct entities, in a fixed order."""
    out = []
    for path in relation_paths(hops):
        for start in kb.entities[RELATIONS[path[0]][0]]:
            chain = kb.follow(start, path)
            if len(set(chain)) == len(chain):
                out.append((start, path))
    return out


def _task(kb: KnowledgeBase, task_id: str, start: str, path: tuple[str, ...]) -> Task:
    chain = kb.follow(start, path)
    meta = {"hops": len(path), "path": list(path), "chain": list(chain)}
    return Task(task_id, question_text(start, path), (chain[-1],), DATASET, meta)


def _held_out_pool(kb: KnowledgeBase, k: int, seed: int = EVAL_SEED) -> list[tuple[str, tuple[str, ...]]]:
    """Every k-hop (start, path), shuffled once: the first `held_out_size` are the eval split's, the next
    as many the validation split's; training never sees either (`train_questions`)."""
    pool = _chains(kb, k)
    random.Random(seed * 1000 + k).shuffle(pool)
    return pool


def held_out_size(pool_size: int) -> int:
    """Questions each held-out split reserves per hop count: HELD_OUT_PER_HOP, or a quarter of the k-hop
    questions of a small knowledge base (half of them then stays for training)."""
    return min(HELD_OUT_PER_HOP, pool_size // 4)


def held_out_questions(
    kb: KnowledgeBase, split: str, per_hop: int = 40, hops: tuple[int, ...] = (2, 3, 4), seed: int = EVAL_SEED
) -> list[Task]:
    """``per_hop`` questions per hop count of the eval split ("eval") or the validation split ("val");
    disjoint from each other and from training, and prefix-stable (a smaller per_hop is a subset)."""
    if split not in ("eval", "val") or not 1 <= per_hop <= HELD_OUT_PER_HOP:
        raise ValueError(f"held-out split {split!r} with {per_hop} per hop: eval|val, 1..{HELD_OUT_PER_HOP}")
    tasks = []
    for k in hops:
        pool = _held_out_pool(kb, k, seed)
        size = held_out_size(len(pool))
        if per_hop > size:
            raise ValueError(
                f"{per_hop} {k}-hop questions asked of the {split} split, which holds {size} "
                f"(a quarter of the knowledge base's {len(pool)}, at most {HELD_OUT_PER_HOP})"
            )
        offset = 0 if split == "eval" else size
        picked = pool[offset : offset + per_hop]
        tasks += [_task(kb, f"kb-{split}-{k}hop-{i:03d}", s, p) for i, (s, p) in enumerate(picked)]
    return tasks


def eval_questions(
    kb: KnowledgeBase, per_hop: int = 40, hops: tuple[int, ...] = (2, 3, 4), seed: int = EVAL_SEED
) -> list[Task]:
    """The held-out evaluation split: ``per_hop`` questions per hop count (120 by default)."""
    return held_out_questions(kb, "eval", per_hop, hops, seed)


def train_questions(
    kb: KnowledgeBase,
    n: int | None = None,
    hops: tuple[int, int] = (2, 2),
    seed: int = TRAIN_SEED,
    exclude: list[Task] | None = None,
) -> list[Task]:
    """Training questions with hop counts in ``hops`` (inclusive), none sharing (start, path) with
    ``exclude`` (default: every question the eval and validation splits can hold, at any size). Hop counts
    are interleaved round-robin; ``n=None`` takes every available question."""
    pools = []
    for k in range(hops[0], hops[1] + 1):
        every = _held_out_pool(kb, k)
        held = every[: 2 * held_out_size(len(every))] if exclude is None else []
        banned = set(held) | {(t.meta["chain"][0], tuple(t.meta["path"])) for t in exclude or []}
        pool = [c for c in _chains(kb, k) if c not in banned]
        random.Random(seed * 1000 + k).shuffle(pool)
        pools.append(pool)
    mixed = [c for group in _round_robin(pools) for c in group]
    if n is not None and n > len(mixed):
        raise ValueError(f"asked for {n} training questions, only {len(mixed)} exist for hops {hops}")
    picked = mixed if n is None else mixed[:n]
    return [_task(kb, f"kb-train-{i:05d}", s, p) for i, (s, p) in enumerate(picked)]


def _round_robin(pools: list[list[tuple[str, tuple[str, ...]]]]) -> list[list[tuple[str, tuple[str, ...]]]]:
    longest = max((len(p) for p in pools), default=0)
    return [[p[i] for p in pools if i < len(p)] for i in range(longest)]


def read_fact(observation: str, subject: str, relation: str) -> str | None:
    """The object of ``relation`` for ``subject`` if one line of a search observation states it."""
    prefix = f"The {relation} of {subject} is "
    for line in observation.splitlines():
        if line.startswith(prefix) and line.endswith("."):
            return line[len(prefix) : -1]
    return None


class SyntheticKBEnv(ToolEnv):
    """search (BM25 top-k passages, one per line) + answer; reward = EM against the end entity."""

    name = "synthetic_kb"

    def __init__(
        self,
        kb: KnowledgeBase | None = None,
        config: KBConfig | None = None,
        topk: int = 2,
        max_turns: int = 6,
        index: Bm25Index | None = None,
        think_chunks: int = 0,
    ) -> None:
        self.kb = kb if kb is not None else generate_kb(config)
        self.index = index if index is not None else Bm25Index.from_passages(self.kb.passages())
        self.topk, self.think_chunks = topk, think_chunks
        search = Tool("search", "Search the knowledge base; returns matching facts.", "query", self.search)
        super().__init__([search], SYSTEM_PROMPT, max_turns)

    @property
    def inline_tools(self) -> bool:
        """A local index of this small KB answers in microseconds: the async loop calls it on its event
        loop (`sampler.tool_calls=auto`). A retrieval-service client waits on HTTP: threads."""
        return isinstance(self.index, Bm25Index)

    def search(self, query: str) -> str:
        """The tool: the hits, then (with thinking) the budget of the span the next turn writes."""
        return with_budget(self.hits(query), self.think_chunks)

    def hits(self, query: str) -> str:
        hits = self.index.search_one(query, self.topk)
        return "\n".join(h["contents"] for h in hits) if hits else "no results"

    def user_prompt(self, task: Task) -> str:
        return with_budget(task.question, self.think_chunks)

    def tasks(self, split: str, **kwargs: object) -> list[Task]:
        """``split`` is "train" (kwargs of ``train_questions``), "eval" or "val" (validation; kwargs of
        ``held_out_questions``: per_hop, hops)."""
        if split == "train":
            return train_questions(self.kb, **kwargs)  # type: ignore[arg-type]
        if split in ("eval", "val"):
            return held_out_questions(self.kb, split, **kwargs)  # type: ignore[arg-type]
        raise ValueError(f"unknown split {split!r}; use 'train', 'eval' or 'val'")

    def oracle_turns(
        self, task: Task, rng: random.Random | None = None, chunks: int | None = None
    ) -> list[tuple[str, str | None]]:
        """SFT trajectory: (assistant text, tool observation) per turn; the last turn answers (obs None).
        With thinking (`chunks`, default `think_chunks`) each turn opens with a span drawn from `rng`
        (actors/envs/thinking.py).

        Each next entity is read from the real search observation, not the KB, so a retrieval miss
        raises instead of producing a trajectory the tool could not support.
        """
        rng = rng or random.Random(task.task_id)
        chunks = self.think_chunks if chunks is None else chunks
        return [
            (action + think_text(chunks, rng), None if obs is None else with_budget(obs, chunks))
            for action, obs in self._oracle_calls(task)
        ]

    def _oracle_calls(self, task: Task) -> list[tuple[str, str | None]]:
        entity = task.meta["chain"][0]
        turns: list[tuple[str, str | None]] = []
        for rel in task.meta["path"]:
            query = f"{entity} {rel}"
            obs = self.hits(query)
            nxt = read_fact(obs, entity, rel)
            if nxt is None:
                raise RuntimeError(f"{task.task_id}: search {query!r} did not retrieve the fact: {obs!r}")
            turns.append((f"search: {query}", obs))
            entity = nxt
        turns.append((f"answer: {entity}", None))
        return turns


def tokenizer_texts(
    env: SyntheticKBEnv, n_questions: int = 2000, n_oracle: int = 200, system_repeats: int = 50, seed: int = 0
) -> list[str]:
    """Text to train a tokenizer on: passages, sample questions, oracle turns and the system prompt
    (repeated so its words become single tokens)."""
    texts = [p.text for p in env.kb.passages()]
    questions = train_questions(env.kb, n=None, hops=(2, 4), seed=seed + 100, exclude=[])
    questions = questions[:n_questions]
    texts += [t.question for t in questions]
    for task in questions[:n_oracle]:
        for action, obs in env.oracle_turns(task):
            texts.append(action)
            if obs is not None:
                texts.append(obs)
    texts += [SYSTEM_PROMPT] * system_repeats
    return texts
