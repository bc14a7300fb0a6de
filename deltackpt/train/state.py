"""TrainState: everything a resumed run needs to continue bit-exactly, as one DCP ``Stateful``.

Layout of the state dict (DCP flattens nested dicts into dotted keys)::

    <model>            model state via get_state_dict (FSDP2/FSDP1/DDP/plain; FP32 master weights)
    <model>.optim      state of the optimizers of that model
    scheduler[.name]   LR scheduler(s);  scaler   GradScaler
    progress           {"step", "epoch", "world_size"};  extra   the user's JSON-able dict
    rank<r>.rng        Python / NumPy / torch CPU / CUDA generator states of rank r
    rank<r>.data       dataloader state of rank r (+ its shuffling generators' states)
    meta               optimizer classes, for a clear error when restoring into another optimizer

Per-rank values use rank-unique keys: DCP keeps a single copy of same-key plain values across ranks, so a
shared key would silently keep only one rank's RNG.

Resharding policy (world size changed between save and restore): model and optimizer reshard through DCP.
Ranks that existed at save time restore their own RNG and dataloader state. A rank that did not exist
seeds its generators from ``(step, rank)`` and starts its dataloader at the beginning of the current epoch;
a rank's state that no longer has a rank is dropped. Both cases log a warning, since the data order of
the resumed run then differs from an uninterrupted run's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from .rng import capture_rng, derived_seed, restore_rng, seed_all

log = logging.getLogger("deltackpt.train")


def _as_named(obj, default: str) -> dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (list, tuple)):
        return {f"{default}{i}" if i else default: o for i, o in enumerate(obj)}
    return {default: obj}


def rank_and_world() -> tuple[int, int]:
    """(this rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _generators(loader) -> list[torch.Generator]:
    """The shuffling generators a dataloader draws from (its own and its sampler's), without duplicates."""
    found = []
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        g = getattr(obj, "generator", None) if obj is not None else None
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
    return found


def _builds_iterators(loader) -> bool:
    """Whether ``loader`` is a torchdata StatefulDataLoader (or alike): one that builds its iterator from a
    loaded state at the next ``iter()`` (``next_iter_state``) through ``_get_iterator()``."""
    return hasattr(loader, "next_iter_state")


def _check_loader(loader) -> None:
    """TypeError unless TrainState can restore ``loader`` bit-exactly (see :func:`_undo_next_build`)."""
    if loader is not None and _builds_iterators(loader) and not callable(getattr(loader, "_get_iterator", None)):
        raise TypeError(f"TrainState: the dataloader ({type(loader).__name__}) has next_iter_state but no "
                        "_get_iterator() (a torchdata version this deltackpt does not know): its resume could "
                        "not be made bit-exact")


_UNDOES = "_deltackpt_undoes_draws"


def _loader_state(loader) -> dict:
    """``loader.state_dict()``; a loaded state not yet turned into an iterator as it was loaded (asked for its
    state, StatefulDataLoader would build its iterator now, freezing a DistributedSampler's epoch before the
    user's ``set_epoch``)."""
    pending = getattr(loader, "next_iter_state", None) if _builds_iterators(loader) else None
    if isinstance(pending, dict) and pending:
        return copy.deepcopy(pending)  # a load's target is filled in place: not the pending state's tensors
    return loader.state_dict()


def _undo_next_build(loader) -> None:
    """Make the next iterator ``loader`` builds (``_get_iterator()``, from ``iter()`` or ``state_dict()``) leave
    torch's and Python's/NumPy's global RNGs and the loader's shuffling generators as it found them.

    The iterator a resumed run builds from the loaded state redoes the draws the saved iterator's build made
    (a base seed, a permutation); the saved generator and RNG states already include those. Only that one
    build is affected: later epochs' iterators draw as in the uninterrupted run."""
    build = getattr(loader, "_get_iterator", None)
    if not callable(build):  # (checked by TrainState.__init__; a loader changed since)
        raise TypeError(f"TrainState: the dataloader ({type(loader).__name__}) has no _get_iterator()")
    if getattr(build, _UNDOES, False):
        return  # armed by an earlier load: its build captures the states at build time
    own = "_get_iterator" in vars(loader)

    def build_undoing_draws():
        if own:
            loader._get_iterator = build
        else:
            del loader._get_iterator
        rng, gens = capture_rng(), _generators(loader)
        states = [g.get_state() for g in gens]
        try:
            return build()
        finally:
            restore_rng(rng)
            for g, s in zip(gens, states):
                g.set_state(s)

    setattr(build_undoing_draws, _UNDOES, True)
    loader._get_iterator = build_undoing_draws


def _state_dict_names(model, name: str) -> set[str]:
    """The keys ``get_state_dict`` gives module attribute ``name`` (wrapper prefixes such as DDP's
    ``module.``, FSDP1's or torch.compile's dropped)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # (private in torch: the same rule by hand)
        return _unwrapped_name(model, name)
    return set(_get_fqns(model, name))


def _persistent(model, name: str) -> bool:
    """Whether buffer ``name`` (a path of ``model.named_buffers()``) is in the state dict."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in getattr(module, "_non_persistent_buffers_set", ())


def _unwrapped_name(model, name: str) -> set[str]:
    """:func:`_state_dict_names` by hand: each wrapper's own attribute dropped from ``name`` (DDP's
    ``module``, torch.compile's ``_orig_mod``, FSDP1's and activation checkpointing's wrapped module), a
    user's attribute of the same name kept."""
    from torch.nn.parallel import DistributedDataParallel

    kept, obj = [], model
    for part in name.split("."):
        wrapper = (part == "module" and isinstance(obj, DistributedDataParallel)
                   or part == "_orig_mod" and type(obj).__name__ == "OptimizedModule"
                   or part in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))
        if not wrapper:
            kept.append(part)
        obj = getattr(obj, part, None)
    return {".".join(kept)}


def _keep_saved_state(osd: dict, prefix: str, saved_keys: frozenset[str]) -> None:
    """Drop from optimizer state dict ``osd`` the parameters whose state the checkpoint lacks (its keys
    ``saved_keys``; a parameter's are ``prefix + fqn + "." + state name``)."""
    # A state value may be nested ({"bufs": {"m1": t}}: "<fqn>.bufs.m1"), so every dotted prefix of a key's
    # rest may be the parameter's name (no parameter's name is a prefix of another's: a module's attribute is
    # either a parameter or a submodule).
    have = set()
    for key in saved_keys:
        if key.startswith(prefix):
            parts = key[len(prefix):].split(".")
            have.update(".".join(parts[:i]) for i in range(1, len(parts)))
    state = osd.get("state", {})
    for fqn in [f for f in state if f not in have]:
        del state[fqn]


# Keys of TrainState.state_dict besides the models' and schedulers' names (and "<model>.optim").
_RESERVED = {"scaler", "progress", "extra", "meta"}


def _check_names(names: list[str]) -> None:
    """ValueError unless the models' and schedulers' names are distinct keys of the state dict: each its own,
    none a key TrainState writes itself, and without "." (DCP joins nested keys with it: model "a" and model
    "a.b" would both own "a.b.weight", and "<model>.optim" is an optimizer's state)."""
    seen = set()
    for name in names:
        if not isinstance(name, str) or not name or "." in name or name in _RESERVED \
                or re.fullmatch(r"rank\d+", name):
            raise ValueError(f"TrainState: {name!r} cannot name a model or scheduler: names must be non-empty, "
                             f"without '.', and none of {sorted(_RESERVED)} or rank<N> (the state's own keys)")
        if name in seen:
            raise ValueError(f"TrainState: {name!r} names two of the models and schedulers")
        seen.add(name)


class TrainState(Stateful):
    """The complete state of a training run. Pass it to ``dcp.save``/``dcp.load`` or a CheckpointManager.

    ``model`` / ``optimizer`` / ``scheduler`` may be single objects, lists or name -> object dicts; each
    optimizer is attached to the model whose parameters it updates.

    ``dataloader``: a torchdata ``StatefulDataLoader`` (or any object with ``state_dict``/``load_state_dict``).
    A restored one continues with the batches, and torch's RNG with the draws, of the uninterrupted run: the
    iterator is built from the loaded state at the next ``iter(loader)``. With a ``DistributedSampler``, call
    ``sampler.set_epoch(state.epoch)`` after the restore and before ``iter(loader)`` (as every epoch of the
    usual loop does). A sampler that is neither torchdata's nor stateful is fast-forwarded, so it must give the
    same order when iterated again (SequentialSampler, DistributedSampler: not torch's RandomSampler).
    """

    def __init__(self, model, optimizer=None, scheduler=None, dataloader=None, scaler=None,
                 extra: dict[str, Any] | None = None, *, step: int = 0, epoch: int = 0,
                 options: StateDictOptions | None = None) -> None:
        self.models = _as_named(model, "model")
        if not self.models:
            raise ValueError("TrainState needs at least one model")
        self.optimizers = _as_named(optimizer, "optim")
        self.schedulers = _as_named(scheduler, "scheduler")
        _check_names([*self.models, *self.schedulers])
        _check_loader(dataloader)
        self.dataloader = dataloader
        self.scaler = scaler
        self.extra = dict(extra or {})
        json.dumps(self.extra)  # fail early: extra must be JSON-able
        self.step = step
        self.epoch = epoch
        self.options = options
        self._owner = self._attach_optimizers()
        # Saved world size for the next load_state_dict (set by prepare_load); None = same as now.
        self._load_world: int | None = None
        # Keys (relative to this state) the checkpoint the next load reads holds (set by prepare_load).
        self._saved_keys: frozenset[str] | None = None
        self._saving = False  # set by CheckpointManager around its saves (prepare_save): per-rank buffers

    def _attach_optimizers(self) -> dict[str, list]:
        owner: dict[str, list] = {name: [] for name in self.models}
        for oname, opt in self.optimizers.items():
            params = {id(p) for group in opt.param_groups for p in group["params"]}
            matches = [m for m, model in self.models.items() if params & {id(p) for p in model.parameters()}]
            if len(matches) != 1:
                raise ValueError(f"optimizer {oname!r} must update the parameters of exactly one model "
                                 f"(matches: {matches or 'none'})")
            owner[matches[0]].append(opt)
        return owner

    def buffer_keys(self) -> frozenset[str]:
        """Keys (in :meth:`state_dict`, model name first) of the models' buffers: BatchNorm's running stats
        are each rank's own under DDP (buffers are broadcast at the start of forward, then updated from the
        local batch) and FSDP (buffers are not sharded), so a save does not compare them as replicas. By
        name: a parameter is never among them, whatever memory it shares."""
        return frozenset(self._own_buffers())

    def _own_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's persistent buffers (those of the state dict; a non-persistent one, a cache or a mask,
        is no state) by :meth:`buffer_keys` key, each path of a shared module."""
        return {f"{name}.{key}": buf for name, model in self.models.items()
                for bname, buf in model.named_buffers(remove_duplicate=False)  # shared modules: each path
                if _persistent(model, bname)
                for key in _state_dict_names(model, bname)}

    # -- Stateful ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        rank, world = rank_and_world()
        sd: dict[str, Any] = {}
        for name, model in self.models.items():
            opts = self._owner[name]
            had = {id(p) for o in opts for p in o.state}
            try:
                msd, osd = get_state_dict(model, opts, options=self.options)
            except TypeError as e:
                lbfgs = [n for n, o in self.optimizers.items() if o in opts and isinstance(o, torch.optim.LBFGS)]
                if not lbfgs:
                    raise
                # torch gives an optimizer without state some by a step() with lr 0, without a closure.
                raise TypeError(f"TrainState cannot checkpoint optimizer {lbfgs[0]!r} (torch.optim.LBFGS): torch's "
                                "get_state_dict initializes a stateless optimizer by calling step() without the "
                                "closure LBFGS needs, and LBFGS's history (lists that grow step by step) does not "
                                "restore through DCP either") from e
            sd[name] = msd
            if opts:
                # get_state_dict gives an optimizer without state some (a step with lr 0): the live one keeps
                # none, or a save before the first step would shift Adam's bias correction by one step.
                for o in opts:
                    for p in [p for p in o.state if id(p) not in had]:
                        del o.state[p]
                if self._saved_keys is not None:  # a load's target: the state the checkpoint holds, no more
                    _keep_saved_state(osd, f"{name}.optim.state.", self._saved_keys)
                sd[f"{name}.optim"] = osd
        for name, sched in self.schedulers.items():
            sd[name] = sched.state_dict()
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        sd["progress"] = {"step": int(self.step), "epoch": int(self.epoch), "world_size": world}
        # One JSON value, not a nested dict: DCP only loads keys the target already has, and a fresh
        # TrainState's extra is empty.
        sd["extra"] = json.dumps(self.extra, sort_keys=True)
        sd["meta"] = {"optimizers": {n: type(o).__name__ for n, o in self.optimizers.items()}}
        load_world = self._load_world if self._load_world is not None else world
        own = f"rank{rank}.buffers"
        if (self._saving and world > 1 or self._saved_keys is not None
                and any(k.startswith(own + ".") for k in self._saved_keys)):
            # Buffers (BatchNorm's running stats) are each rank's own under DDP and FSDP; the model's keys hold
            # one rank's copy. A manager's checkpoint holds every rank's too, and each rank gets its own back.
            # Copies: a load fills the model's keys and these in place, in no set order (the same tensors
            # would end up holding whichever came last).
            sd[own] = {key: buf.detach().clone() for key, buf in self._own_buffers().items()}
        if rank < load_world:
            if self.dataloader is not None:
                sd[f"rank{rank}.data"] = {
                    "loader": _loader_state(self.dataloader),
                    "generators": [g.get_state() for g in _generators(self.dataloader)],
                }
            # After the loader's state: a loader that has no iterator yet builds one for its state_dict(),
            # drawing from torch's RNG (and its generators); the next iter() then uses that iterator.
            rng = capture_rng()
            if self._saved_keys is not None and "cuda" in rng:
                # A load's target asks only for the CUDA generators the checkpoint holds: one saved where fewer
                # devices were visible (on CPU, or one GPU a rank) resumes where more are; the others keep theirs.
                have = f"rank{rank}.rng.cuda."
                rng["cuda"] = {i: s for i, s in rng["cuda"].items() if have + i in self._saved_keys}
                if not rng["cuda"]:
                    del rng["cuda"]
            sd[f"rank{rank}.rng"] = rng
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rank, world = rank_and_world()
        options = self.options
        if self._saved_keys is not None:
            # A parameter the checkpoint holds no optimizer state for gets none (the manager checked the
            # model's keys and shapes against the checkpoint before the load).
            options = dataclasses.replace(options or StateDictOptions(), strict=False)
        for name, model in self.models.items():
            opts = self._owner[name]
            set_state_dict(model, opts, model_state_dict=state_dict[name],
                           optim_state_dict=state_dict.get(f"{name}.optim", {}), options=options)
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state_dict[name])
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
        saved_buffers = state_dict.get(f"rank{rank}.buffers", {})
        own = self._own_buffers() if saved_buffers else {}
        with torch.no_grad():
            for key, value in saved_buffers.items():
                own[key].copy_(value)
        progress = state_dict["progress"]
        self.step, self.epoch = int(progress["step"]), int(progress["epoch"])
        saved_world = int(progress["world_size"])
        extra = state_dict.get("extra", "{}")
        self.extra = json.loads(extra) if isinstance(extra, str) else dict(extra)
        self._load_world = None
        if rank == 0 and world < saved_world:
            log.warning("world size shrank %d -> %d: the RNG and dataloader state of ranks %d..%d are dropped",
                        saved_world, world, world, saved_world - 1)
        data = state_dict.get(f"rank{rank}.data")
        if data is not None and self.dataloader is not None:
            self.dataloader.load_state_dict(data["loader"])
            for g, s in zip(_generators(self.dataloader), data["generators"]):
                g.set_state(s)
            if _builds_iterators(self.dataloader) and self.dataloader.next_iter_state is not None:
                # The iterator is built from the loaded state at the next iter(), after the user's
                # sampler.set_epoch (built now, a DistributedSampler's order would be that of the epoch it
                # holds now). That build draws again what the saved iterator's build drew (its base seed from
                # the loader's generator or torch's RNG, a permutation): undone, the generators and RNGs go on
                # exactly as in the uninterrupted run.
                _undo_next_build(self.dataloader)
        rng = state_dict.get(f"rank{rank}.rng")
        if rng is not None:
            restore_rng(rng)
        else:
            log.warning("rank %d did not exist when the checkpoint was saved (world size %d -> %d): seeding its "
                        "generators from (step, rank) and starting its dataloader at the epoch start",
                        rank, saved_world, world)
            seed_all(derived_seed("deltackpt", self.step, rank))

    # -- restore across world sizes ----------------------------------------------------------------------------
    def prepare_save(self, saving: bool) -> None:
        """Tell the next ``state_dict()`` calls (until ``prepare_save(False)``) that they make a manager's
        checkpoint, which holds every rank's buffers too (``rank<N>.buffers``)."""
        self._saving = bool(saving)

    def prepare_load(self, saved_world_size: int | None, saved_keys=None) -> None:
        """Tell the next ``state_dict()`` which per-rank entries the checkpoint holds (resharding) and, with
        ``saved_keys`` (its keys, relative to this state), which parameters have optimizer state in it:
        a parameter without (unused so far: an MoE expert not routed to) gets none from the load.

        Needed before ``dcp.load`` when the world size changed since the save; None resets it.
        """
        self._load_world = None if saved_world_size is None else int(saved_world_size)
        self._saved_keys = None if saved_keys is None else frozenset(saved_keys)
