"""The `algo` section of the configuration: the method, its tree shape, credit and teacher, and the losses'
settings (docs/configuration.md; docs/algorithm.md for what each means)."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import Field
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
    # step starts (one no-grad forward per batch); the μ → π_prox gap is then corrected by rollout_correction
    proximal: Literal["behavior", "step_start"] = "behavior"
    rollout_correction: Literal["none", "token_tis", "seq_is", "token_mask", "seq_mask"] = "none"
    is_threshold: Annotated[Float, Field(gt=1)] = 2.0  # C: token_tis / seq_is weights are min(ratio, C)
    mask_band: Band = (0.5, 2.0)  # token_mask / seq_mask keep ratios π_prox/μ inside [low, high]
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
        fixed = self.rollout_correction == "none" or self.proximal == "step_start"
        rule(self, fixed, "rollout_correction", "none unless algo.proximal = step_start (π_prox/μ ≡ 1)")
        one = self.proximal == "behavior" or self.behavior_logprobs == "sampler"
        why = "behavior unless algo.behavior_logprobs = sampler (recompute makes μ the step-start policy)"
        return rule(self, one, "proximal", why)

    @model_validator(mode="after")
    def _listwise_rho(self) -> Self:
        # |V_c − V_parent| is not bounded by the ρ calibration (system/teacher.py)
        listwise_ok = self.credit != "listwise" or self.rho < 0.25
        return rule(self, listwise_ok, "rho", "< 0.25 with algo.credit = listwise, so q stays in (0, 1)")

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
