"""The run's actors and the only code that starts, replaces or stops them: `Roles`.

    roles = Roles.start(cfg, model_path, resume)    # retrieval, store, learner group, backup, samplers
    roles.scale_samplers(4)                          # up to 4 samplers; the ids to retire when there are more
    roles.replace_sampler(slot)                      # a sampler whose call raised: a new one in its slot
    roles.restart_backup(); roles.restart_learners(); roles.restart_retrieval()
    roles.stop()                                     # every role, best effort for the dead ones

The driver decides (runtime/decisions.py) and calls these; nothing else calls `start_actor` or `ray.kill`
(tests/unit/test_decisions.py reads the source to check it). Each actor holds one role object
(runtime/remote.py): `ReplayStore` and `BackupWorker` (runtime/store_hosts.py: `StoreActor`, `BackupActor`,
light hosts), `TreeSampler` (runtime/sampler_role.py), `Learner` (runtime/learner_roles.py, placed by
runtime/learner_group.py), the retrieval service (runtime/retrieval_actor.py).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray.rllib.utils.actor_manager import FaultTolerantActorManager
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configs.schema import Config, ConfigError, to_dict
from runtime.learner_group import LearnerGroup, LearnerRankError, _placement, _rank_bundles, _rendezvous
from runtime.learner_roles import LearnerActor, LearnerRankActor
from runtime.pools import check_pools
from runtime.remote import RoleLog, run_remote, start_actor
from runtime.retrieval_actor import RetrievalActor, _bind, service_corpus
from runtime.sampler_role import SamplerActor
from runtime.store_hosts import BackupActor, StoreActor
from runtime.topology import role_options
from storage.replay_store_actor import RemoteStore

__all__ = [
    "BackupActor",
    "Roles",
    "SamplerSpec",
    "StoreActor",
    "start_learner_group",
    "start_store_actor",
    "start_topology",
    "stop_topology",
]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSpec:
    """What every sampler is built from: the config dict, the model, the store's name and the learner's
    weight endpoint (address, CURVE key)."""

    data: dict[str, Any]
    model_path: str
    store_name: str
    endpoint: str
    key: Any


class Roles:
    """The live actors of one run (read them freely; only these methods change them)."""

    def __init__(self, cfg: Config, spec: SamplerSpec, store: Any, learners: LearnerGroup, retrieval: Any):
        self.cfg, self.spec, self.store, self.learners, self.retrieval = cfg, spec, store, learners, retrieval
        self.backup = _start_backup(cfg, store)
        self.manager = FaultTolerantActorManager([], 1)
        self.slots: dict[int, int] = {}  # a sampler's actor id -> its slot (the number of its log file)
        self.next_slot = 0

    @property
    def learner(self) -> Any:
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
            eta=cfg.admission_eta,
            batch_size=cfg.learner.batch_trees,
            max_restarts=cfg.run.max_store_restarts,  # Ray restarts a dead store in place
            run_dir=cfg.run.run_dir,  # RUN_DIR/logs/store-0.log
            resources=role_options(cfg, "store").get("resources"),  # its node pool, resources.store.pool
        )
        learners = start_learner_group(cfg, data, model_path, store, resume, role_options(cfg, "learner"))
        endpoint, key = ray.get(learners.rank0.endpoint.remote())
        roles = cls(cfg, SamplerSpec(data, model_path, store_name, endpoint, key), store, learners, retrieval)
        roles.scale_samplers(cfg.sampler.num_samplers)
        return roles

    # ---- samplers -------------------------------------------------------------------------------------
    def scale_samplers(self, n: int, retiring: frozenset[int] = frozenset()) -> list[int]:
        """Adds sampler actors up to n (they subscribe and fetch the latest weights on start); returns the ids
        to retire when there are more than n — the driver stops calling those and removes them when idle."""
        ids = sorted(i for i in self.manager.actor_ids() if i not in retiring)
        for _ in range(n - len(ids)):
            self._add_sampler(self.next_slot)
            self.next_slot += 1
        return ids[n:] if n < len(ids) else []

    def _add_sampler(self, slot: int) -> int:
        s, cfg = self.spec, self.cfg
        opts = {**role_options(cfg, "sampler"), "max_restarts": cfg.sampler.max_restarts}
        log_to = RoleLog(cfg.run.run_dir, "sampler", slot)  # RUN_DIR/logs/sampler-<slot>.log, appended
        args = (s.data, s.model_path, slot, s.store_name, s.endpoint, s.key)
        actor = start_actor(SamplerActor, log_to, opts, *args)
        self.manager.add_actors([actor])
        actor_id = max(self.manager.actor_ids())
        self.slots[actor_id] = slot
        return actor_id

    def replace_sampler(self, actor_id: int) -> int:
        """A new sampler in the slot of `actor_id` (whose call raised: its state is not trusted); its id."""
        slot = self.slots[actor_id]
        self.remove_sampler(actor_id)
        return self._add_sampler(slot)

    def actor_in_slot(self, slot: int) -> int:
        return next(actor_id for actor_id, s in self.slots.items() if s == slot)

    def remove_sampler(self, actor_id: int) -> None:
        """Stops the sampler and takes it out of the manager (its calls in flight are dropped)."""
        self.slots.pop(actor_id, None)
        ray.kill(self.manager.remove_actor(actor_id), no_restart=True)

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
        self.backup = _start_backup(self.cfg, self.store)

    def stop_learners(self) -> None:
        stop_learner_group(self.learners, timeout_s=5.0)

    def restart_learners(self) -> bool:
        """A learner group resumed from the newest checkpoint, on the old weight port unless it is taken;
        True when the weights moved to a new endpoint (the samplers must follow: `follow_endpoint`)."""
        s = self.spec
        port = int(s.endpoint.rsplit(":", 1)[1])
        try:
            self.learners = self._start_learners({**s.data, "weights": {**s.data["weights"], "port": port}})
        except (ray.exceptions.RayError, LearnerRankError) as e:
            if "Address already in use" not in str(e):
                raise  # a failed start: the driver decides again (runtime/recovery.py)
            log.warning("weight port %d is taken: the learner restarts on a free one", port)
            self.learners = self._start_learners(s.data)
        endpoint, key = ray.get(self.learners.rank0.endpoint.remote())
        return self.follow_endpoint(endpoint, key)

    def _start_learners(self, data: dict[str, Any]) -> LearnerGroup:
        opts = role_options(self.cfg, "learner")
        group = start_learner_group(self.cfg, data, self.spec.model_path, self.store, True, opts)
        try:
            ray.get(group.rank0.endpoint.remote())
        except ray.exceptions.RayError:
            stop_learner_group(group, timeout_s=5.0)
            raise
        return group

    def restart_retrieval(self) -> None:
        """A new retrieval service over the same corpus; samplers started from now on search its URL."""
        _stop_retrieval(self.retrieval)
        data = {**self.spec.data, "env": dict(self.spec.data["env"])}
        self.retrieval = _start_retrieval(self.cfg, data)
        self.spec = replace(self.spec, data=data)

    def stop(self) -> None:
        """Stops every role (best effort for the dead ones), closes the store, and frees the actors."""
        self.manager.foreach_actor("close", healthy_only=True, timeout_seconds=20)
        stop_learner_group(self.learners)  # every rank, killed, and the placement group freed
        try:
            ray.get(self.store.close.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("close did not stop cleanly: %s", e)
        for handle in (self.backup, self.store):
            ray.kill(handle, no_restart=True)
        self.manager.clear()  # kills the samplers
        _stop_retrieval(self.retrieval)


def start_topology(cfg: Config, model_path: str, resume: bool = False) -> Roles:
    """Every role of the run started (the name the run's callers and tests know)."""
    return Roles.start(cfg, model_path, resume)


def stop_topology(roles: Roles) -> None:
    roles.stop()


def _kill(handle: Any, role: str) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except ray.exceptions.RayError as e:
        log.info("killing the old %s: %s", role, e)


def _start_backup(cfg: Config, store: Any) -> Any:
    """A backup actor on a store; not restarted by Ray: the driver has Roles start a new one."""
    log_to = RoleLog(cfg.run.run_dir, "backup")  # RUN_DIR/logs/backup-0.log, appended
    options = {**role_options(cfg, "backup"), "max_restarts": 0}
    return start_actor(BackupActor, log_to, options, RemoteStore(store), cfg.algo)


def start_store_actor(
    directory: str,
    name: str | None = None,
    max_restarts: int = 0,
    run_dir: str | None = None,
    resources: dict[str, float] | None = None,
    **options: Any,
) -> Any:
    """Starts `ReplayStore(directory, **options)` as a Ray actor (0 CPUs: it mostly waits on disk; one call
    at a time, so the store sees no concurrent calls).

    With `max_restarts` Ray restarts a dead store in place: the constructor reopens the directory (torn files
    quarantined, leases and reservations, which live in memory, handed back) and every client keeps its
    handle; a call in flight at the death fails (runtime/store_client.py). With `run_dir` the store logs to
    RUN_DIR/logs/store-0.log (a restart appends). `resources`: custom resources to ask for, e.g. the node
    pool of `resources.store.pool` (`{"pool_<name>": 0.01}`), which a restart asks for again."""
    ray_options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1, "max_restarts": max_restarts}
    if resources:
        ray_options["resources"] = resources
    if name is not None:  # the samplers look it up by name (runtime/sampler_role.py)
        ray_options["name"] = name
    log_to = None if run_dir is None else RoleLog(run_dir, "store")
    return start_actor(StoreActor, log_to, ray_options, directory, **options)


def start_learner_group(
    cfg: Config, data: dict, model_path: str, store: Any, resume: bool, options: dict[str, Any]
) -> LearnerGroup:
    """The learner role on Ray (runtime/learner_group.py); returns once every rank has started (and
    resumed)."""
    ranks, timeout = cfg.learner.ranks, cfg.learner.collective_timeout_s
    if ranks == 1:
        log_to = RoleLog(cfg.run.run_dir, "learner")  # RUN_DIR/logs/learner-0.log
        actor = start_actor(LearnerActor, log_to, options, data, model_path, store, resume)
        return LearnerGroup([actor], timeout, release=stop_learner_group)
    pg = _placement(cfg, ranks, options)
    bundles = _rank_bundles(pg, float(options["num_gpus"] or 0))  # a node's ranks contiguous (placement.py)

    def strategy(rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundles[rank])

    address = run_remote(_rendezvous, {"num_cpus": 0, "scheduling_strategy": strategy(0)})
    opts = {**options, "num_cpus": max(float(options["num_cpus"]), 0.01)}
    actors = [
        start_actor(
            LearnerRankActor,
            RoleLog(cfg.run.run_dir, "learner", r),  # RUN_DIR/logs/learner-<rank>.log
            {**opts, "scheduling_strategy": strategy(r)},
            *(data, model_path, store, r, ranks, address, resume),
        )
        for r in range(ranks)
    ]
    group = LearnerGroup(actors, timeout, pg, release=stop_learner_group)
    try:
        group.wait(group.call("pid"))  # construction (model, shards, resume, first publish) done everywhere
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
        ray.kill(actor, no_restart=True)
    if group.placement is not None:
        remove_placement_group(group.placement)


def _start_retrieval(cfg: Config, data: dict[str, Any]) -> Any | None:
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
    actor = start_actor(RetrievalActor, None, options, str(corpus), e.index, where, e.encoder, host, token)
    try:
        url = ray.get(actor.url.remote())
    except ray.exceptions.RayError as exc:
        ray.kill(actor, no_restart=True)
        why = (str(exc).strip().splitlines() or ["?"])[-1]
        raise ConfigError(f"the retrieval service over {corpus} did not start: {why}") from None
    data["env"]["retriever_url"], data["env"]["retriever_token"] = url, token
    return actor


def _stop_retrieval(actor: Any | None) -> None:
    """Stops the run's service (best effort: it may already be gone) and frees the actor."""
    if actor is None:
        return
    try:
        ray.get(actor.stop.remote(), timeout=10)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.warning("the retrieval service did not stop cleanly: %s", exc)
    ray.kill(actor, no_restart=True)
