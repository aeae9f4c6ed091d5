"""SFT warm-start: turn rendering shared with the agent loop, loss mask, short run, caching, full run."""

from __future__ import annotations

import json

import pytest
import torch

from actors.envs.synthetic_kb import SyntheticKBEnv, tokenizer_texts
from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import IM_END, build_tiny_model, build_tokenizer, set_threads
from actors.policy.warmstart import (
    DEFAULT_STEPS,
    assistant_ids,
    collate,
    evaluate_greedy,
    initial_context,
    lr_factor,
    oracle_examples,
    render_observation,
    run_episode,
    sft_train,
    warmstart,
)
from system.policy import SampleRequest, SampleResult


@pytest.fixture(scope="module")
def env():
    set_threads(1)
    return SyntheticKBEnv()


@pytest.fixture(scope="module")
def tok(env):
    return build_tokenizer(tokenizer_texts(env))


@pytest.fixture(scope="module")
def tasks(env):
    return env.tasks("train", n=200, hops=(2, 4))


@pytest.fixture(scope="module")
def examples(tok, env, tasks):
    return oracle_examples(tok, env, tasks)


def test_rendering_equals_chat_template_of_the_conversation(tok, env, tasks, examples):
    # Appending turn ids (what the agent loop does) == templating the whole conversation at once.
    for task, ex in zip(tasks, examples, strict=True):
        msgs = [
            {"role": "system", "content": env.system_prompt()},
            {"role": "user", "content": task.question},
        ]
        for action, obs in env.oracle_turns(task):
            msgs.append({"role": "assistant", "content": action})
            if obs is not None:
                msgs.append({"role": "tool", "content": obs})
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert ex.ids == tok.encode(text.removesuffix("\n"), add_special_tokens=False)


def test_rendering_pieces(tok):
    ctx = initial_context(tok, "S", "U")
    assert (
        tok.decode(ctx)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    obs = render_observation(tok, "The capital of Zor is Bim.")
    assert (
        tok.decode(obs) == "\n<|im_start|>tool\nThe capital of Zor is Bim.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert assistant_ids(tok, "answer: Bim")[-1] == tok.convert_tokens_to_ids(IM_END)


def test_loss_mask_covers_exactly_the_assistant_tokens(tok, env, tasks, examples):
    im_end = tok.convert_tokens_to_ids(IM_END)
    for task, ex in zip(tasks[:50], examples[:50], strict=True):
        turns = env.oracle_turns(task)
        runs, cur = [], []  # maximal runs of masked positions
        for t, m in zip(ex.ids, ex.mask, strict=True):
            if m:
                cur.append(t)
            elif cur:
                runs, cur = [*runs, cur], []
        runs += [cur] if cur else []
        assert [tok.decode(r) for r in runs] == [a + IM_END for a, _ in turns]
        assert all(r[-1] == im_end for r in runs)
        assert sum(ex.mask) == sum(len(assistant_ids(tok, a)) for a, _ in turns)
        # everything else (system, question, observations, generation prompts) is context only
        unmasked = tok.decode([t for t, m in zip(ex.ids, ex.mask, strict=True) if not m])
        assert task.question in unmasked and all(o in unmasked for _, o in turns if o is not None)


def test_collate_shifts_and_pads():
    from actors.policy.warmstart import Example

    ids, labels = collate([Example([5, 6, 7], [0, 1, 1]), Example([8, 9], [0, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    # labels[t] is the target for position t (predicting ids[t+1]); -100 = not in the loss
    assert labels.tolist() == [[6, 7], [9, -100]]


def test_lr_schedule_hand_worked():
    # warmup 50: step 0 -> 1/50, step 49 -> 1; cosine over the remaining 950: halfway (step 525) -> 0.5
    assert lr_factor(0, 1000, 50, "cosine") == pytest.approx(0.02)
    assert lr_factor(49, 1000, 50, "cosine") == pytest.approx(1.0)
    assert lr_factor(525, 1000, 50, "cosine") == pytest.approx(0.5)
    assert lr_factor(1000, 1000, 50, "cosine") == pytest.approx(0.0)
    assert lr_factor(700, 1000, 50, "constant") == 1.0


def test_short_sft_lowers_the_loss(tok, examples):
    model = build_tiny_model(tok, seed=0)
    losses = sft_train(model, examples, steps=60, warmup=10, progress=False)
    first, last = losses[0], sum(losses[-10:]) / 10
    assert first == pytest.approx(
        torch.log(torch.tensor(float(len(tok)))).item(), rel=0.1
    )  # ~uniform at init
    assert last < 0.7 * first, (first, last)
    assert not model.training


class OracleBackend:
    """Emits the oracle turns as token ids: checks the eval loop's bookkeeping against build_example."""

    def __init__(self, tok, turns):
        self.tokenizer, self.turns, self.seen = tok, list(turns), []

    def sample(self, requests):
        [req] = requests
        self.seen.append(list(req.context))
        action, _ = self.turns[len(self.seen) - 1]
        ids = assistant_ids(self.tokenizer, action)
        return [SampleResult(ids, [0.0] * len(ids), "stop")]

    def evict(self, *keys):
        pass


def test_episode_loop_reproduces_the_training_ids(tok, env, tasks, examples):
    for task, ex in zip(tasks[:10], examples[:10], strict=True):
        backend = OracleBackend(tok, env.oracle_turns(task))
        step, ids = run_episode(backend, env, task)  # type: ignore[arg-type]
        assert step.done and step.reward == 1.0
        assert ids == ex.ids  # token-in/token-out: the loop's sequence is exactly what SFT trained on
        assert all(ex.ids[: len(c)] == c for c in backend.seen)  # each turn's context is a prefix


def test_evaluate_greedy_on_a_random_model(tok, env):
    model = build_tiny_model(tok, seed=0)
    res = evaluate_greedy(HFBackend(model, tok), env, env.tasks("eval", per_hop=1))
    assert res["n"] == 3 and set(res["per_hop"]) == {"2", "3", "4"}
    assert res["success"] == 0.0 and sum(res["finish"].values()) == 3
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate_greedy(model, env, [])


def test_eval_loop_reuses_the_kv_cache_across_turns(tok, env):
    # A random model would end the episode on turn 1 (no tool call), so the spy swaps its sampled turn for
    # the oracle's: the backend still sees real requests, and each turn's context extends the cached one.
    task = env.tasks("eval", per_hop=1)[0]
    turns = env.oracle_turns(task)
    backend = HFBackend(build_tiny_model(tok, seed=0), tok)
    contexts, cached = [], []
    orig = backend.sample

    def spy(requests: list[SampleRequest]) -> list[SampleResult]:
        [res] = orig(requests)
        contexts.append(len(requests[0].context))
        cached.append(res.cached_prefix_tokens)
        ids = assistant_ids(tok, turns[len(cached) - 1][0])
        return [SampleResult(ids, [0.0] * len(ids), "stop")]

    backend.sample = spy  # type: ignore[method-assign]
    step, _ = run_episode(backend, env, task, max_new_tokens=8)
    assert step.reward == 1.0 and len(cached) == len(turns)
    assert cached[0] == 0
    # the stored cache holds the previous context plus sampled tokens that the oracle turn replaced
    assert all(c >= prev for c, prev in zip(cached[1:], contexts, strict=False))
    assert backend.cached_sessions == 0  # the episode's cache is freed at the end


def test_warmstart_writes_folder_and_reuses_it(tmp_path):
    kw = {"steps": 5, "n_train": 32, "eval_per_hop": 1, "progress": False}
    first = warmstart(tmp_path, **kw)
    assert not first["cached"] and first["n"] == 3 and first["n_train"] == 32
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "tokenizer.json", "config.json", "warmstart.json"} <= names
    saved = json.loads((tmp_path / "warmstart.json").read_text())
    assert saved["settings"]["steps"] == 5 and saved["settings_hash"] == first["settings_hash"]
    again = warmstart(tmp_path, **kw)
    assert again["cached"]
    assert again["success"] == first["success"] and again["per_hop"] == first["per_hop"]
    HFBackend(tmp_path)  # the folder loads as a policy
    assert not warmstart(tmp_path, **{**kw, "steps": 6})["cached"]  # other settings: retrain


@pytest.mark.slow
def test_full_warmstart_reaches_30_percent(tmp_path):
    """The default recipe clears 30% greedy success (the time is reported by `treeopsd warmstart`, not
    asserted here: timing goals live in benchmarks, and this suite shares 2 cores with Ray and vLLM)."""
    res = warmstart(tmp_path, progress=False)
    assert res["settings"]["steps"] == DEFAULT_STEPS and res["n"] == 120
    assert res["success"] >= 0.30, res
