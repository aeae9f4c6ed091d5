"""The `weights` section (the ZeroMQ weight broadcast from the learner to the samplers) and the loopback rule
every socket's section shares (docs/configuration.md)."""

from __future__ import annotations

import contextlib
import ipaddress
from typing import Annotated, Literal, Self

from pydantic import Field
from pydantic.functional_validators import model_validator
from pydantic.types import StrictInt

from configs.fields import PORT_ALLOWED, Host, PosFloat, PosInt, Section, rule
from configs.messages import Allowed

__all__ = ["WeightsConfig", "is_loopback"]


class WeightsConfig(Section):
    bind_host: Host = "127.0.0.1"
    port: Annotated[
        StrictInt, Field(ge=0, le=65535, description="0: pick a free port"), Allowed(PORT_ALLOWED)
    ] = 0
    chunk_mb: PosInt = 4
    auth: Literal["none", "curve"] = "none"  # must be "curve" when bind_host is not loopback
    # dtype of the broadcast tensors; auto: bfloat16 when learner.precision is bfloat16, else float32
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    fetch_timeout_s: PosFloat = 30.0  # a sampler gives up a version whose chunks do not all arrive in this
    apply_timeout_s: PosFloat = 300.0  # loading a version into a sampler's engine workers (vLLM RPC)
    sync_wait_s: PosFloat = 60.0  # run.mode = sync: how long a sampler waits for the newest version

    @model_validator(mode="after")
    def _auth_off_loopback(self) -> Self:
        ok = is_loopback(self.bind_host) or self.auth == "curve"
        return rule(self, ok, "auth", "'curve' when weights.bind_host is not loopback")


def is_loopback(host: str) -> bool:
    """localhost, ::1 or any 127.x.y.z (as learner/weight_publisher.py decides); not wildcards, not names."""
    with contextlib.suppress(ValueError):
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    return False
