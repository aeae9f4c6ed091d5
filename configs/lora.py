"""The `learner.lora` section: low-rank adapters on the learner's projections (learner/lora.py).

Its own module because configs/schema.py is at the house's 400-line budget; the schema imports it as the
`lora` field of `LearnerConfig`. Any `learner.ranks` takes it: FSDP2 shards the base and the adapters alike
(learner/lora_sharded.py).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic.types import StrictStr

from configs.fields import Float, NonNegInt, PosFloat, Section
from configs.messages import Allowed

# the attention and MLP projections of Llama/Qwen-style decoders (Qwen2, Qwen3, Llama, Mistral, SmolLM2)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SUFFIX = r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$"
_TARGETS = "a non-empty list of module-name suffixes such as [q_proj, v_proj] (names of nn.Linear layers)"


class LoraConfig(Section):
    # 0: off (every weight trains); r > 0: each target keeps its weight frozen and trains B·A of rank r
    rank: NonNegInt = 0
    alpha: PosFloat = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.0  # on the adapter's input, in gradient passes only
    # a Linear is adapted when its dotted module name ends with one of these (at a dot boundary)
    target_modules: Annotated[
        tuple[Annotated[StrictStr, Field(pattern=_SUFFIX)], ...], Field(min_length=1), Allowed(_TARGETS)
    ] = PROJECTIONS
