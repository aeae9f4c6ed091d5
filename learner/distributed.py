"""torch.distributed for the sharded learner (docs/design.md §12): the process group, FSDP2 sharding, and the
few collectives the learner adds. Everything that crosses ranks is a tensor: bytes go as uint8 tensors,
stats as UTF-8 JSON in uint8 tensors (never `broadcast_object_list`, which pickles).

    init_process_group(rank, world, address, port, timeout_s, device)   # gloo on CPU, NCCL on CUDA
    scorer = shard_model(model, device_mesh(device), precision)   # fully_shard per layer, then the root
    buf = broadcast_bytes(buf if rank == 0 else None)  # the rollout batch's Arrow IPC bytes
    parts = gather_json(parts)                          # every rank's list, in rank order
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA, gloo for the CPU. Chosen at run time: the combined string "cpu:gloo,cuda:nccl" fails
    on CPU builds of torch."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    rank: int, world: int, address: str, port: int, timeout_s: float, device: torch.device
) -> None:
    """Joins the learner's process group (rank 0 hosts the TCP store at address:port). LOCAL_RANK is 0: Ray
    sets CUDA_VISIBLE_DEVICES to the one GPU it gave the actor. Every collective then fails after
    `timeout_s` instead of waiting forever for a lost rank."""
    env = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}
    os.environ.update({**env, "LOCAL_RANK": "0"})
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def device_mesh(device: torch.device) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards over, given explicitly: without one, fully_shard puts the model on CUDA
    whenever a GPU is visible (pytorch#132471), also for a CPU learner."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF causal LM (model.model.layers for Llama/Qwen-style models)."""
    hf: Any = model  # an HF PreTrainedModel
    layers = getattr(hf.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder `layers` to shard")
    return list(layers)


class Scorer(nn.Module):
    """FSDP2's root module. The learner computes log-probs through the decoder and then the LM head
    (learner/forward.py), never through the model's own forward, so the root is this wrapper: each
    micro-batch is one forward of it, which gathers the root group (embeddings, final norm, LM head) before
    and reduces its gradients after backward. `compute(model)` runs inside (a callable, so FSDP's input
    casting leaves the packed batch alone)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, compute: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        return compute(self.model)


def shard_model(model: nn.Module, mesh: DeviceMesh, precision: str) -> Scorer:
    """FSDP2: `fully_shard` per decoder layer, then the root (Scorer). bfloat16: the layers all-gather bf16
    copies of the fp32 master shards and reduce-scatter gradients in fp32; they leave their inputs alone
    (the learner's autocast scope does the bf16 compute, on one rank and many alike: learner/device.py); the
    root group stays fp32 (the LM head and log-softmax run in fp32). Gradients are *summed* over ranks: each
    rank's loss is its share of the mini-batch loss over the global normalizer."""
    layer_mp = MixedPrecisionPolicy()
    if precision == "bfloat16":
        layer_mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=layer_mp)
    scorer = Scorer(model)
    fully_shard(scorer, mesh=mesh)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):
            # default: an average over ranks; a factor of 1 with sum-only comms is a plain sum (gloo has
            # no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return scorer


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of `tensors` (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def clip_global_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """`clip_grad_norm_` over sharded gradients: the norm over every rank's shards (DTensor → full value),
    then the same scale on every rank. max_norm ≤ 0: no clipping, the norm only."""
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return float(total)


# ---- collectives on bytes ----------------------------------------------------------------------------------
def _comm_device() -> torch.device:
    """Where collective buffers live: the current CUDA device under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes | None:
    """`data` of rank `src` on every rank (None stays None): its length, then the bytes as a uint8 tensor."""
    dev = _comm_device()
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    n = int(size.item())
    if n <= 0:
        return None if n < 0 else b""
    if dist.get_rank() == src:
        assert data is not None
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), src)
        return data
    buf = torch.empty(n, dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy())


def broadcast_ints(values: list[int], src: int = 0) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device())
    dist.broadcast(t, src)
    return [int(v) for v in t.cpu().tolist()]


def all_reduce_sums(values: list[float]) -> list[float]:
    """Element-wise sums over ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.cpu().tolist()]


def gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-able `value`, in rank order, on every rank (padded uint8 all_gather)."""
    dev, world = _comm_device(), dist.get_world_size()
    raw = json.dumps(value).encode()
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(raw)], dtype=torch.int64, device=dev))
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # json.dumps: never empty
    bufs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(bufs, mine)
    return [json.loads(bytes(b[: int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes, strict=True)]
