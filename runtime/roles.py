"""The run's actors and the only code that starts, replaces or stops them: `Roles` (`ray.kill` and
`start_actor` appear nowhere else: tests/unit/test_role_protocols.py). runtime/fault_tolerance.py calls its
restarts; each handle is typed by its role's Protocol (runtime/remote.py:Handle); the actors' classes are
runtime/builder.py's. The sampler pool is RLlib's FaultTolerantActorManager, the one thing that knows which
sampler is healthy, called by this class alone.

    roles = Roles.start(cfg, model_path, resume)    # retrieval, store, learner group, backup, samplers
    roles.scale_samplers(4); roles.replace_sampler(actor_id); roles.restart_learners(); roles.stop()
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray.rllib.utils.actor_manager import FaultTolerantActorManager
from ray.util.placement_group import remove_placement_group

from configs.schema import Config, ConfigError, to_dict
from runtime.builder import (
    BackupActor,
    LearnerActor,
    LearnerRankActor,
    SamplerActor,
    StoreActor,
    store_options,
)
from runtime.learner_group import LearnerGroup, rank_placement
from runtime.pools import check_pools
from runtime.remote import Handle, RoleLog, declared, start_actor
from runtime.retrieval_actor import RetrievalActor, _bind, service_corpus
from runtime.store_client import one_line
from runtime.topology import role_options
from system.roles import BackupRole, HostRole, LearnerRole, RetrievalRole, SamplerRole, StoreRole

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSpec:
    """What every sampler is built from: config dict, model, store name, weight endpoint and CURVE key."""

    data: dict[str, Any]
    model_path: str
    store_name: str
    endpoint: str
    key: Any


class Roles:
    """The live actors of one run (read them freely; only these methods change them)."""

    def __init__(
        self,
        cfg: Config,
        spec: SamplerSpec,
        store: Handle[StoreRole],
        learners: LearnerGroup,
        retrieval: Handle[RetrievalRole] | None,
    ) -> None:
        self.cfg, self.spec, self.store, self.learners, self.retrieval = cfg, spec, store, learners, retrieval
        self.backup = _start_backup(cfg, spec.data, store)
        self._pool = FaultTolerantActorManager([], 1)
        self.slots: dict[int, int] = {}  # a sampler's actor id -> its slot (the number of its log file)
        self.retiring: set[int] = set()  # scaled down: no new calls, removed once idle
        self.next_slot = 0

    @property
    def learner(self) -> Handle[LearnerRole]:
        """The learner the driver and the samplers talk to (rank 0)."""
        return self.learners.rank0

    @classmethod
    def start(cls, cfg: Config, model_path: str, resume: bool = False) -> Roles:
        check_pools(cfg)  # a pool no node provides fails here, before any actor starts
        data = to_dict(cfg)
        retrieval = _start_retrieval(cfg, data)  # before the samplers: they get its URL through `data`
        store_name = f"treeopsd-store-{uuid.uuid4().hex[:12]}"  # samplers look it up by name
        store = start_store_actor(
            cfg.store_dir,
            name=store_name,
            max_restarts=cfg.run.max_store_restarts,  # Ray restarts a dead store in place
            run_dir=cfg.run.run_dir,  # RUN_DIR/logs/store-0.log
            resources=role_options(cfg, "store").get("resources"),  # its node pool, resources.store.pool
            **store_options(cfg),
        )
        learners = start_learner_group(cfg, data, model_path, store, resume, role_options(cfg, "learner"))
        endpoint, key = ray.get(learners.rank0.call(LearnerRole.endpoint))
        roles = cls(cfg, SamplerSpec(data, model_path, store_name, endpoint, key), store, learners, retrieval)
        roles.scale_samplers(cfg.sampler.num_samplers)
        return roles

    # ---- the sampler pool -----------------------------------------------------------------------------
    def scale_samplers(self, n: int) -> None:
        """Adds sampler actors up to n active ones (they subscribe and fetch the latest weights on start);
        past n, the newest are retired: no new calls, removed once their last call returned."""
        ids = sorted(i for i in self._pool.actor_ids() if i not in self.retiring)
        for _ in range(n - len(ids)):
            self._add_sampler(self.next_slot)
            self.next_slot += 1
        self.retiring |= set(ids[n:])

    def _add_sampler(self, slot: int) -> int:
        s, cfg = self.spec, self.cfg
        opts = {**role_options(cfg, "sampler"), "max_restarts": cfg.sampler.max_restarts}
        log_to = RoleLog(cfg.run.run_dir, "sampler", slot)  # RUN_DIR/logs/sampler-<slot>.log, appended
        args = (s.data, s.model_path, slot, s.store_name, s.endpoint, s.key)
        actor = start_actor(SamplerActor, SamplerRole, log_to, opts, *args)
        self._pool.add_actors([actor.actor])
        actor_id = max(self._pool.actor_ids())
        self.slots[actor_id] = slot
        return actor_id

    def sample(self, method: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        """One call of `method` (a SamplerRole method) in flight on each healthy sampler not retiring."""
        name = declared(SamplerRole, method)
        for i in self._pool.healthy_actor_ids():
            if i not in self.retiring and self._pool.num_outstanding_async_reqs(_tag(i)) == 0:
                self._pool.foreach_actor_async(name, _tag(i), kwargs=kwargs, remote_actor_ids=[i])

    def sampler_results(self, timeout_s: float) -> list[Any]:
        """The sampler calls that ended, each once (RLlib's results: `actor_id`, `ok`, `get()` the value or
        the error), after RLlib's health probe of the unhealthy ones."""
        done = list(self._pool.fetch_ready_async_reqs(timeout_seconds=timeout_s))
        self._pool.probe_unhealthy_actors(timeout_seconds=0.1, mark_healthy=True)
        return done

    def retire_idle(self) -> list[int]:
        """Removes the retiring samplers whose last call has returned (its trees are committed)."""
        idle = [i for i in self.retiring if self._pool.num_outstanding_async_reqs(_tag(i)) == 0]
        for actor_id in idle:
            self.remove_sampler(actor_id)
        return idle

    def samplers_busy(self) -> int:
        return int(self._pool.num_outstanding_async_reqs())

    def healthy_samplers(self) -> list[int]:
        return list(self._pool.healthy_actor_ids())

    def sampler_ids(self) -> list[int]:
        return list(self._pool.actor_ids())

    def samplers_restarted(self) -> int:
        """The restarts RLlib's manager saw (of samplers it had marked unhealthy)."""
        return int(self._pool.total_num_restarts())

    def ask_samplers(self, method: Callable[..., Any], timeout_s: float = 30.0) -> dict[int, Any]:
        """{actor id: answer} of `method` (a SamplerRole or HostRole method) from the samplers that answer."""
        name = declared(
            HostRole if getattr(HostRole, method.__name__, None) is method else SamplerRole, method
        )
        results = self._pool.foreach_actor(name, timeout_seconds=timeout_s)
        return {r.actor_id: r.get() for r in results if r.ok}  # type: ignore[attr-defined]

    def replace_sampler(self, actor_id: int) -> int:
        """A new sampler in the slot of `actor_id` (whose call raised: its state is not trusted); its id."""
        slot = self.slots[actor_id]
        self.remove_sampler(actor_id)
        return self._add_sampler(slot)

    def actor_in_slot(self, slot: int) -> int:
        return next(actor_id for actor_id, s in self.slots.items() if s == slot)

    def remove_sampler(self, actor_id: int) -> None:
        """Stops the sampler and takes it out of the pool (its calls in flight are dropped)."""
        self.slots.pop(actor_id, None)
        self.retiring.discard(actor_id)
        ray.kill(self._pool.remove_actor(actor_id), no_restart=True)

    def replace_all_samplers(self) -> None:
        """Every active sampler retires after its current call and as many new ones start (they subscribe
        to the weight endpoint or search the retrieval URL that changed)."""
        active = [i for i in self._pool.actor_ids() if i not in self.retiring]
        self.retiring |= set(active)
        self.scale_samplers(len(active))

    def follow_endpoint(self, endpoint: str, key: Any) -> bool:
        """True when the weights moved: samplers started from now on subscribe to the new endpoint."""
        if (endpoint, key) == (self.spec.endpoint, self.spec.key):
            return False
        log.warning("weights moved from %s to %s: replacing the samplers", self.spec.endpoint, endpoint)
        self.spec = replace(self.spec, endpoint=endpoint, key=key)
        return True

    # ---- backup, learner, retrieval -------------------------------------------------------------------
    def restart_backup(self) -> None:
        """A new backup actor (stateless: its leased trees come back on their own)."""
        _kill(self.backup, "backup")  # a live one that raised; a dead one: nothing to do
        self.backup = _start_backup(self.cfg, self.spec.data, self.store)

    def stop_learners(self) -> None:
        stop_learner_group(self.learners, timeout_s=5.0)

    def restart_learners(self, free_port: bool = False) -> bool:
        """A learner group resumed from the newest checkpoint, on the old weight port (a free one with
        `free_port`: the configured one); True when the weights moved (the samplers must follow)."""
        s = self.spec
        port = int(s.endpoint.rsplit(":", 1)[1])
        data = s.data if free_port else {**s.data, "weights": {**s.data["weights"], "port": port}}
        opts = role_options(self.cfg, "learner")
        self.learners = start_learner_group(self.cfg, data, s.model_path, self.store, True, opts)
        endpoint, key = ray.get(self.learners.rank0.call(LearnerRole.endpoint))
        return self.follow_endpoint(endpoint, key)

    def restart_retrieval(self) -> None:
        """A new retrieval service over the same corpus; samplers started from now on search its URL."""
        _stop_retrieval(self.retrieval)
        data = {**self.spec.data, "env": dict(self.spec.data["env"])}
        self.retrieval = _start_retrieval(self.cfg, data)
        self.spec = replace(self.spec, data=data)

    def stop(self) -> None:
        """Stops every role (best effort for the dead ones), closes the store, and frees the actors."""
        self._pool.foreach_actor(
            declared(SamplerRole, SamplerRole.close), healthy_only=True, timeout_seconds=20
        )
        stop_learner_group(self.learners)  # every rank, killed, and the placement group freed
        try:
            ray.get(self.store.call(StoreRole.close), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("close did not stop cleanly: %s", e)
        for handle in (self.backup, self.store):
            ray.kill(handle.actor, no_restart=True)
        self._pool.clear()  # kills the samplers
        _stop_retrieval(self.retrieval)

    @staticmethod
    def stop_now() -> None:
        """Every actor of the run killed at once (a second interrupt): what they wrote is atomic."""
        ray.shutdown()


def _tag(actor_id: int) -> str:
    return f"sampler-{actor_id}"


def _kill(handle: Handle[Any], role: str) -> None:
    try:
        ray.kill(handle.actor, no_restart=True)
    except ray.exceptions.RayError as e:
        log.info("killing the old %s: %s", role, e)


def _start_backup(cfg: Config, data: dict[str, Any], store: Handle[StoreRole]) -> Handle[BackupRole]:
    """A backup actor on a store; not restarted by Ray: the fault tolerance has Roles start a new one."""
    log_to = RoleLog(cfg.run.run_dir, "backup")  # RUN_DIR/logs/backup-0.log, appended
    options = {**role_options(cfg, "backup"), "max_restarts": 0}
    return start_actor(BackupActor, BackupRole, log_to, options, data, store)


def start_store_actor(
    directory: str,
    name: str | None = None,
    max_restarts: int = 0,
    run_dir: str | None = None,
    resources: dict[str, float] | None = None,
    **options: Any,
) -> Handle[StoreRole]:
    """`ReplayStore(directory, **options)` as a Ray actor: 0 CPUs (it mostly waits on disk), one call at a
    time. With `max_restarts` Ray restarts a dead store in place: the constructor reopens the directory and
    every client keeps its handle (runtime/store_client.py). `run_dir`: it logs to RUN_DIR/logs/store-0.log;
    `resources`: e.g. the node pool of `resources.store.pool` (`{"pool_<name>": 0.01}`)."""
    ray_options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1, "max_restarts": max_restarts}
    if resources:
        ray_options["resources"] = resources
    if name is not None:  # the samplers look it up by name (runtime/builder.py:sampler_on_ray)
        ray_options["name"] = name
    log_to = None if run_dir is None else RoleLog(run_dir, "store")
    return start_actor(StoreActor, StoreRole, log_to, ray_options, directory, **options)


def start_learner_group(
    cfg: Config,
    data: dict[str, Any],
    model_path: str,
    store: Handle[StoreRole],
    resume: bool,
    options: dict[str, Any],
) -> LearnerGroup:
    """The learner role on Ray (runtime/learner_group.py); returns once every rank has started (and
    resumed), its weight endpoint bound; a start that fails leaves nothing running."""
    ranks, timeout = cfg.learner.ranks, cfg.learner.collective_timeout_s
    if ranks == 1:
        log_to = RoleLog(cfg.run.run_dir, "learner")  # RUN_DIR/logs/learner-0.log
        actor = start_actor(LearnerActor, LearnerRole, log_to, options, data, model_path, store, resume)
        group = LearnerGroup([actor], timeout)
    else:
        pg, per_rank, address = rank_placement(cfg, ranks, options)  # a node's ranks contiguous
        actors = [
            start_actor(
                LearnerRankActor,
                LearnerRole,
                RoleLog(cfg.run.run_dir, "learner", r),  # RUN_DIR/logs/learner-<rank>.log
                per_rank[r],
                *(data, model_path, store, resume, r, ranks, address),
            )
            for r in range(ranks)
        ]
        group = LearnerGroup(actors, timeout, pg)
    try:
        group.wait([a.host(HostRole.pid) for a in group.actors])  # construction done on every rank
    except BaseException:
        stop_learner_group(group, timeout_s=5.0)
        raise
    return group


def stop_learner_group(group: LearnerGroup, timeout_s: float = 30.0) -> None:
    """Stops every rank (best effort for the dead or stuck ones), kills them, frees the bundles."""
    try:
        group.stop_calls(timeout_s)
    except ray.exceptions.RayError as e:  # a dead rank's handle: nothing left to stop
        log.info("stopping the old learner: %s", e)
    for actor in group.actors:
        ray.kill(actor.actor, no_restart=True)
    if group.placement is not None:
        remove_placement_group(group.placement)


def _start_retrieval(cfg: Config, data: dict[str, Any]) -> Handle[RetrievalRole] | None:
    """Starts the run's retrieval service when `env.retriever = service` has no URL; sets `data["env"]`'s
    `retriever_url` (and `retriever_token`). The actor handle, or None when none is needed."""
    e = cfg.env
    if e.retriever != "service" or e.retriever_url is not None:
        return None
    if e.index == "dense" and not Path(e.encoder or "").is_dir():
        raise ConfigError(f"env.encoder = {e.encoder!r} is invalid: expected a local encoder folder")
    corpus, index_dir = service_corpus(cfg)
    host, token = _bind(cfg)
    where = None if index_dir is None else str(index_dir)
    options = {"num_cpus": 0, "max_restarts": 0}
    args = (str(corpus), e.index, where, e.encoder, host, token)
    actor = start_actor(RetrievalActor, RetrievalRole, None, options, *args)
    try:
        url = ray.get(actor.call(RetrievalRole.url))
    except ray.exceptions.RayError as exc:
        ray.kill(actor.actor, no_restart=True)
        raise ConfigError(f"the retrieval service over {corpus} did not start: {one_line(exc)}") from None
    data["env"]["retriever_url"], data["env"]["retriever_token"] = url, token
    return actor


def _stop_retrieval(actor: Handle[RetrievalRole] | None) -> None:
    """Stops the run's service (best effort: it may already be gone) and frees the actor."""
    if actor is None:
        return
    try:
        ray.get(actor.call(RetrievalRole.stop), timeout=10)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.warning("the retrieval service did not stop cleanly: %s", exc)
    ray.kill(actor.actor, no_restart=True)
