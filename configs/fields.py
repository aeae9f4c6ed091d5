"""Field types of the configuration schema: constrained scalars, pairs, hosts, the cross-field rule helper.

Each type carries its own "allowed" text (configs/messages.py) so that an error names what a key accepts.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.functional_validators import AfterValidator, BeforeValidator
from pydantic.types import StrictInt, StrictStr
from pydantic_core import PydanticCustomError

from configs.messages import Allowed, finite_number

RHO_ALLOWED, PORT_ALLOWED = "a number in the open interval (0, 1/2)", "a port number in [0, 65535]"
_HOST, _POOL = "a host name or IP address without spaces", "a name of letters, digits, '_' and '-'"
_CLIP = "a list of 2 values [low, high] with 0 < low < 1 and high > 0"
_HOPS = "a list of 2 integers [low, high] with 1 <= low <= high"
_S = TypeVar("_S", bound=BaseModel)
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # the head sizes vLLM's CPU attention runs


class Section(BaseModel):
    """A config section: immutable, unknown keys rejected, defaults validated too."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def pair_of_two(value: Any) -> Any:
    """A tuple field takes a list (or tuple) of exactly two values, nothing else iterable."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise PydanticCustomError("config_pair", "not a list of 2 values")
    return value


def low_le_high(value: tuple[int, int]) -> tuple[int, int]:
    """[low, high] with low <= high."""
    if value[0] > value[1]:
        raise PydanticCustomError("config_order", "low > high")
    return value


Float = Annotated[float, BeforeValidator(finite_number)]
PosFloat = Annotated[Float, Field(gt=0)]
NonNegFloat = Annotated[Float, Field(ge=0)]
PosInt = Annotated[StrictInt, Field(ge=1)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Host = Annotated[StrictStr, Field(pattern=r"^\S+$"), Allowed(_HOST)]
PoolName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]+$"), Allowed(_POOL)]
UnitFloat = Annotated[Float, Field(gt=0, lt=1)]
Clip = Annotated[tuple[UnitFloat, PosFloat], BeforeValidator(pair_of_two), Allowed(_CLIP)]
Hops = Annotated[
    tuple[PosInt, PosInt], BeforeValidator(pair_of_two), AfterValidator(low_le_high), Allowed(_HOPS)
]
_BAND = "a list of 2 values [low, high] with 0 < low < 1 < high"
Band = Annotated[
    tuple[UnitFloat, Annotated[Float, Field(gt=1)]], BeforeValidator(pair_of_two), Allowed(_BAND)
]
Url = Annotated[StrictStr, Field(pattern=r"^https?://\S+$"), Allowed("an http:// or https:// URL")]


def rule(section: _S, ok: bool, name: str, allowed: str) -> _S:
    """A rule across fields: the section back if `ok`, else an error naming field `name` (dotted: a field of
    a sub-section, for rules across sections)."""
    if not ok:
        value: Any = section
        for part in name.split("."):
            value = getattr(value, part)
        ctx = {"field": name, "value": value, "allowed": allowed}
        raise PydanticCustomError("config_rule", "{field} = {value} is invalid: expected {allowed}", ctx)
    return section
