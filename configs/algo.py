"""The `algo` section of the configuration: the method, its tree shape, credit and teacher, and the losses'
settings (docs/configuration.md; docs/algorithm.md for what each means)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, ValidationError
from pydantic.functional_validators import model_validator
from pydantic.types import StrictBool, StrictInt

from configs.fields import RHO_ALLOWED, Band, Clip, Float, NonNegInt, PosInt, Section, rule
from configs.messages import Allowed


class AlgoConfig(Section):
    method: Literal["treeopsd", "grpo", "gspo", "treepo"] = "treeopsd"
    M: PosInt = 4  # initial trajectories per prompt (tree methods)
    N: NonNegInt = 2  # branches per trajectory
    G: Annotated[StrictInt, Field(ge=2)] = 8  # group size (GRPO, GSPO)
    rho: Annotated[Float, Field(gt=0, lt=0.5), Allowed(RHO_ALLOWED)] = 0.1
    teacher: Literal["odds", "logistic"] = "odds"
    credit: Literal["pointwise", "listwise"] = "pointwise"
    backup_weights: Literal["uniform", "geo_likelihood", "seq_likelihood", "leaf_count"] = "uniform"
    tau_mode: Literal["per_tree", "global"] = "per_tree"
    anchor_shortfall: Literal["skip", "reallocate"] = "skip"
    zero_var_trees: Literal["keep", "drop"] = "keep"
    on_verifier_error: Literal["zero", "drop_tree"] = "zero"
    mask_truncated_turn: StrictBool = False
    behavior_logprobs: Literal["sampler", "recompute"] = "sampler"
    # the loss's reference (docs/algorithm.md §11.1): the stored μ, or π_prox = the learner's weights when the
    # step starts (a no-grad forward of each mini-batch but the first, whose own forward it is), the
    # μ → π_prox gap corrected by rollout_correction.
    # auto (resolved at load by `resolve_offpolicy`): step_start with the method's correction in
    # run.mode = async, where turns come from older versions; behavior with none in sync mode
    proximal: Literal["auto", "behavior", "step_start"] = "auto"
    # auto: token_tis in an off-policy run, for every method (the evidence: docs/algorithm.md §11.1)
    rollout_correction: Literal[
        "auto", "none", "token_tis", "token_mask", "geo_tis", "geo_mask", "prod_tis", "prod_mis", "tr_mask"
    ] = "auto"
    is_threshold: Annotated[Float, Field(gt=1)] = (
        2.0  # C: the *_tis weights are min(ratio, C); prod_mis's cut
    )
    mask_band: Band = (0.5, 2.0)  # token_mask keeps tokens whose ratio π_prox/μ is inside [low, high]
    geo_band: Band = (0.9, 1.1)  # geo_mask keeps units whose geometric-mean ratio is inside [low, high]
    # tr_mask drops a unit (a turn, or a path) whose largest token k3 = r − 1 − log r exceeds this bound
    tr_bound: Annotated[Float, Field(gt=0)] = 0.1
    grpo_clip: Clip = (0.2, 0.2)
    gspo_clip: Clip = (3e-4, 4e-4)
    treepo_clip: Clip = (0.2, 0.28)
    treepo_filter_zero_std: StrictBool = False
    dual_clip: StrictBool = False  # GRPO/TreePO dual clip (verl's clip_ratio_c): objective >= c·A where A < 0
    dual_clip_c: Annotated[Float, Field(gt=1)] = 3.0
    depth_correction: StrictBool = (
        False  # TreeOPSD: weight each depth as flat sampling would (algorithm §5.3)
    )
    nonfinite_turn_limit: Annotated[Float, Field(ge=0, lt=1)] = 0.01

    @model_validator(mode="after")
    def _depth_correction_for_treeopsd(self) -> Self:
        ok = not self.depth_correction or self.method == "treeopsd"
        return rule(
            self, ok, "depth_correction", "false unless algo.method = treeopsd (it reweights its loss)"
        )

    @model_validator(mode="after")
    def _proximal(self) -> Self:
        fixed = self.rollout_correction in ("none", "auto") or self.proximal in ("step_start", "auto")
        rule(self, fixed, "rollout_correction", "none unless algo.proximal = step_start (π_prox/μ ≡ 1)")
        one = self.proximal != "step_start" or self.behavior_logprobs == "sampler"
        why = "behavior unless algo.behavior_logprobs = sampler (recompute makes μ the step-start policy)"
        return rule(self, one, "proximal", why)

    @model_validator(mode="after")
    def _correction_fits_method(self) -> Self:
        # docs/algorithm.md §11.1: at real turn lengths the per-token weight gives the step nearest π_prox's
        # on-policy gradient (the product is exact only untruncated, and truncating it selects on credit);
        # the geometric-mean and token-band weights weigh a turn by numbers that are no likelihood ratio of
        # anything. The PPO-family losses centred on π_prox with μ's samples left uncorrected are worse
        # than centring them on μ (proximal = behavior).
        mode = self.rollout_correction
        if self.method == "treeopsd":
            ok = mode in ("auto", "none", "token_tis", "prod_tis", "prod_mis", "tr_mask")
            why = (
                "none, token_tis, prod_tis, prod_mis or tr_mask with algo.method = treeopsd (geometric-mean "
                "and token-band weights are biased on turns of more than one token)"
            )
            return rule(self, ok, "rollout_correction", why)
        ok = not (self.proximal == "step_start" and mode == "none")
        why = f"a correction with algo.proximal = step_start and algo.method = {self.method}"
        why += ", or algo.proximal = behavior"
        return rule(self, ok, "rollout_correction", why)

    @model_validator(mode="after")
    def _listwise_rho(self) -> Self:
        # |V_c − V_parent| is not bounded by the ρ calibration (system/teacher.py)
        listwise_ok = self.credit != "listwise" or self.rho < 0.25
        return rule(self, listwise_ok, "rho", "< 0.25 with algo.credit = listwise, so q stays in (0, 1)")

    def resolved(self, off_policy: bool) -> dict[str, str]:
        """The `auto` values (the keys to replace; {} when none is auto): step_start and the method's
        correction when the run's turns come from another policy than the learner's (`off_policy`), else
        behavior."""
        out: dict[str, str] = {}
        proximal = self.proximal
        if proximal == "auto":
            stale = off_policy and self.behavior_logprobs == "sampler"
            proximal = out["proximal"] = "step_start" if stale else "behavior"
        if self.rollout_correction == "auto":
            out["rollout_correction"] = "none" if proximal == "behavior" else "token_tis"
        return out

    @property
    def is_tree_method(self) -> bool:
        return self.method in ("treeopsd", "treepo")

    @property
    def nominal_leaves(self) -> int:
        """K = M(1+N) for tree methods, G for flat ones."""
        return self.M * (1 + self.N) if self.is_tree_method else self.G

    @property
    def expected_cost(self) -> float:
        """Full-trajectory equivalents per prompt, docs/algorithm.md §2.3: M(1 + N/2), or G."""
        return self.M * (1 + self.N / 2) if self.is_tree_method else float(self.G)


def resolve_offpolicy(data: Any) -> Any:
    """`data` (a Config's input) with the algo section's `auto` values filled in; unchanged when nothing is
    auto or a section is malformed (its own validation then names the problem). Off-policy: run.mode = async
    (samplers run ahead of the learner), run.sampler_lag > 0, or a learner.temperature apart from the
    sampler's."""
    if not isinstance(data, dict):
        return data
    algo = data.get("algo", {})
    mode, lag = _raw(data, "run", "mode", "async"), _raw(data, "run", "sampler_lag", 0)
    t_learner, t_sampler = (
        _raw(data, "learner", "temperature", None),
        _raw(data, "sampler", "temperature", 1.0),
    )
    off_policy = mode == "async" or lag != 0 or (t_learner is not None and t_learner != t_sampler)
    try:  # a section given as a model is taken as it is; a malformed one is left to its own validation
        section = (
            algo if isinstance(algo, AlgoConfig) else AlgoConfig(**algo) if isinstance(algo, dict) else None
        )
    except ValidationError:
        return data
    update = section.resolved(off_policy) if section is not None else {}
    if not update:
        return data
    raw = algo if isinstance(algo, dict) else algo.model_dump()
    return {**data, "algo": {**raw, **update}}


def _raw(data: dict[str, Any], section: str, key: str, default: Any) -> Any:
    """data[section][key] whether the section is still a mapping or already a model; `default` if unset."""
    value = data.get(section, {})
    return value.get(key, default) if isinstance(value, dict) else getattr(value, key, default)
