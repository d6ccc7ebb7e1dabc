"""expert_parallel: each rank holds some of every layer's experts; tokens go to them and back by all-to-all (by hand).

    torchrun --nproc_per_node=2 scripts/expert_parallel.py --workload moe [--ep 2] [--capacity-factor 1.25]

The diff from `single`: the N ranks are groups of `ep` (EP x DP: the expert-parallel groups borrow the
data-parallel ranks, as torchtitan's ep does); every rank trains on its own share of the batch, and in
each group rank j holds experts j E/ep .. (j+1) E/ep - 1 of every routed layer, the others dropped. In
each routed layer, after the router (the model's own, moe.py):

    rows sorted by expert ----- counts: all-to-all (E per rank) ----->  how many rows come from whom
    rows --------- all-to-all, splits = rows per destination rank ---->  the rank's experts on them
    y <------------------ all-to-all, the splits swapped -------------  outputs go home, gate-weighted there

`expert_dispatch.py` holds the all-to-all, a torch.autograd.Function whose backward is the all-to-all with
the splits swapped, so each expert's gradient is of every token routed to it, from every rank of the group.
The dense weights
(attention, norms, embeddings, routers) are replicated: their gradients are averaged over all N ranks
in one flat all-reduce; an expert's over the N/ep ranks that hold it, summed and divided by N (each
rank's loss is the mean of its own tokens). Dropless by default; `--capacity-factor c` lets each expert
take at most ceil(c x T x k / E) rows of a rank's T tokens per layer (moe.py): a run that drops any is
judged not-expected, with the count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch import nn

from parallel.kit.collectives import every_rank, sum_gradients
from parallel.kit.expert_dispatch import Dispatch
from parallel.loop import checkpoint
from parallel.measure.experts import Experts
from parallel.models.moe import combine
from parallel.models.outputs import call
from parallel.strategies.base import CLIPPED, Hooks, Mutant, Trainable, injected, model_state_every_rank
from parallel.world.errors import ConfigError

NAME = "expert_parallel"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    o = run.options
    model = model.to(dist.device)
    for p in model.parameters():  # every rank starts from rank 0's weights (they are built alike anyway)
        td.broadcast(p.detach(), src=0)
    n, ep = dist.world_size, ep_of(run)
    ep_group, expert_group = _groups(n, ep, dist.rank)
    layers = model.moe_layers()
    local = layers[0].num_experts // ep
    owned = list(range(dist.rank % ep * local, (dist.rank % ep + 1) * local))
    dispatch = Dispatch(ep_group, ep, td.group.WORLD if n > 1 else None)
    if injected(run, UNGATED):
        dispatch.combine = combine_ungated
    if injected(run, TRANSPOSED):
        dispatch.order = order_transposed
    if injected(run, LOCAL_AUX):
        dispatch.global_counts = lambda counts: counts  # each rank's own
    for moe in layers:
        moe.experts = nn.ModuleList(moe.experts[i] for i in owned)  # the others are freed
        moe.dispatch, moe.capacity_factor = dispatch, o.capacity_factor
    expert_params = {id(p) for moe in layers for p in moe.experts.parameters()}
    skip = {id(p) for moe in layers for p in moe.router.parameters()} if injected(run, ROUTER_UNREDUCED) else set()
    dense = [p for p in model.parameters() if id(p) not in expert_params | skip]
    state = State(dispatch, owned, dense, [p for p in model.parameters() if id(p) in expert_params], expert_group,
                  n)
    held = tuple(range(dist.rank % ep, n, ep))  # the ranks holding this rank's experts (its expert-replica group)
    if injected(run, EXPERTS_NORM):  # the bug: counted in the norm as the dense parameters are, held by every rank
        held = tuple(range(n))
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device, state=state,
                     held_by={k: held for k, p in model.named_parameters() if id(p) in expert_params})


def train_step(t: Trainable, batch, dist):
    s = t.state
    t.optimizer.zero_grad(set_to_none=True)
    x, y = (b.to(t.device, non_blocking=True) for b in batch)
    loss = t.loss_fn(call(t.model, x, y), y)
    loss.backward()  # the all-to-alls' backward brings every expert the gradients of its rows
    if s.world > 1:  # dense: summed over every rank; an expert: over the ranks holding it; / N both
        sum_gradients(s.dense, s.world)
    if s.expert_group is not None:
        sum_gradients(s.experts, s.world, s.expert_group)
    elif s.world > 1:
        for p in s.experts:  # held by this rank alone: its gradient already has every row routed to it
            if p.grad is not None:
                p.grad /= s.world
    t.optimizer.step()
    if s.dispatch.dropped:
        t.not_expected = (f"capacity factor {t.model.moe_layers()[0].capacity_factor:g} dropped "
                          f"{s.dispatch.dropped} of {s.dispatch.assigned} routed assignments on rank {dist.rank} "
                          "(`single` drops none)")
    return loss.detach()


def ep_of(run) -> int:
    return run.options.ep or min(DEFAULT_EP, run.world_size)


@dataclass
class State:
    dispatch: Dispatch
    owned: list[int]  # the global index of each expert this rank holds, in every layer
    dense: list[nn.Parameter]  # replicated: averaged over every rank
    experts: list[nn.Parameter]  # this rank's experts: summed over the ranks holding them, divided by N
    expert_group: object  # the ranks holding the same experts (None: one)
    world: int


def _groups(world: int, ep: int, rank: int):
    """(the rank's expert-parallel group: ep neighbours; its expert-replica group: every ep-th rank), each
    None when of one rank. Every rank creates every group, in the same order (torch.distributed's rule)."""
    mine = [None, None]
    for g in range(world // ep):
        ranks = list(range(g * ep, (g + 1) * ep))
        group = td.new_group(ranks) if ep > 1 else None
        if rank in ranks:
            mine[0] = group
    for j in range(ep):
        ranks = list(range(j, world, ep))
        group = td.new_group(ranks) if world > ep else None
        if rank in ranks:
            mine[1] = group
    return mine


DEFAULT_EP = 2  # on 4 devices: ep 2 x dp 2

_MOE = {"workload": "moe"}


@dataclass
class Options:
    ep: int = field(default=0, metadata={"help": f"ranks per expert-parallel group, dividing the devices and the "
                                                 f"experts; the rest data parallel (0: {DEFAULT_EP})"})
    capacity_factor: float = field(default=0.0, metadata={"help": "rows an expert takes per call, over its even "
                                                                  "share (0: dropless); the rest are dropped"})

    def __post_init__(self):
        if self.ep < 0:
            raise ConfigError(f"--ep must be 0 (the default) or more, got {self.ep}")
        if not self.capacity_factor >= 0:
            raise ConfigError(f"--capacity-factor must be 0 (dropless) or more, got {self.capacity_factor}")


def experts_per_layer(model: nn.Module) -> int:
    return model.moe_layers()[0].num_experts


def check(run) -> None:
    n, ep = run.world_size, ep_of(run)
    if n % ep:
        raise ConfigError(f"--ep {ep} does not divide the {n} devices")
    experts = experts_per_layer(run.meta_model)
    if experts % ep:
        raise ConfigError(f"--ep {ep} does not divide the {experts} experts of each layer")
    run.check_divisible(n, "devices")


UNGATED = Mutant("expert_parallel:combine-without-gates", "the experts' outputs summed back to their tokens "
                 "without the router's gate weights", _MOE)
ROUTER_UNREDUCED = Mutant("expert_parallel:router-grad-not-reduced", "the routers' gradients left out of the "
                          "dense all-reduce: each rank's router learns from its own tokens", _MOE)
TRANSPOSED = Mutant("expert_parallel:splits-transposed", "the received rows read as grouped by expert then "
                    "source, not source then expert: rows go to the wrong expert", _MOE)
LOCAL_AUX = Mutant("expert_parallel:aux-loss-local-counts", "the load-balancing loss's counts taken over the "
                   "rank's own tokens, not summed over the batch",
                   {**_MOE, "aux_loss": 1.0, "batch_size": 8, "seq_len": 8})  # 32 tokens a rank: counts that differ
EXPERTS_NORM = Mutant("expert_parallel:experts-norm-unreduced", "the clip's gradient norm takes the experts as the "
                      "dense weights, held alike by every rank: their squares divided by the ranks, never summed "
                      "over the expert groups", {**_MOE, **CLIPPED, "workload": "moe"})
MUTANTS = (UNGATED, ROUTER_UNREDUCED, TRANSPOSED, LOCAL_AUX, EXPERTS_NORM)


# How the injected bugs above are written: setup puts one in the dispatch's place


def combine_ungated(x, routing, rows_out):
    """UNGATED: Dispatch.combine with every gate 1: the experts' outputs summed back to their tokens."""
    return combine(x, dataclasses.replace(routing, gate=torch.ones_like(routing.gate)), rows_out)


def order_transposed(grid):
    """TRANSPOSED: Dispatch.order reading the received rows as expert-major: the same total, other rows per
    expert."""
    expert = torch.arange(grid.shape[1], device=grid.device).repeat_interleave(grid.shape[0])
    return torch.argsort(expert.repeat_interleave(grid.t().reshape(-1)), stable=True)


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """The whole model on rank 0 under one device's names: every rank's experts gathered (a collective)."""
    names = _global_names(t)
    sd = {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()}
    out = {k: v for k, v in sd.items() if k not in names}
    for part in every_rank({names[k]: v for k, v in sd.items() if k in names}):
        out.update(part)
    return out


def _global_names(t: Trainable) -> dict[str, str]:
    """This rank's expert tensors (parameters, and buffers if any), from the name they have here (experts.0
    is its first) to the one they have on one device (experts.2 on the rank that holds experts 2 and 3)."""
    out = {}
    for moe in t.model.moe_layers():
        prefix = f"{_name(t.model, moe)}.experts."
        for j, (here, expert) in enumerate(zip(t.state.owned, moe.experts, strict=True)):
            for k in expert.state_dict():
                out[f"{prefix}{j}.{k}"] = f"{prefix}{here}.{k}"
    return out


def _renamed(sd: dict, names: dict[str, str]) -> dict:
    """A checkpoint state (base.checkpoint_state's: model, optimiser by parameter name, step) renamed."""
    optim = dict(sd["optim"])
    optim["state"] = {names.get(k, k): v for k, v in optim["state"].items()}
    optim["param_groups"] = [{**g, "params": [names.get(k, k) for k in g["params"]]} for g in optim["param_groups"]]
    return {**sd, "model": {names.get(k, k): v for k, v in sd["model"].items()}, "optim": optim}


def checkpoint_state(t: Trainable) -> dict:
    """DCP's state with each expert under its name on one device, so that ranks holding different experts
    save different keys (under the local names, DCP would keep rank 0's experts as if every rank's were
    replicas of them); replicas of one expert (EP x DP) share a key, saved once."""
    return _renamed(checkpoint.state(t), _global_names(t))


def restore_checkpoint(t: Trainable, sd: dict) -> None:
    """The loaded state back under this rank's local names. The optimiser's param_groups are an object DCP
    keeps one copy of (rank 0's): each rank puts back its own parameters' names in them."""
    mine = checkpoint.state(t)["optim"]["param_groups"]
    local = {v: k for k, v in _global_names(t).items()}
    sd = _renamed(sd, local)
    sd["optim"]["param_groups"] = [{**g, "params": m["params"]}
                                   for g, m in zip(sd["optim"]["param_groups"], mine, strict=True)]
    checkpoint.restore(t, sd)


def _name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def memory_layout(run, layout):
    return layout.replace(ep=ep_of(run))  # the routed experts split over ep ranks (the planner's memory)


EXPERTS = True  # it splits the model's routed experts (model.moe_layers())
ROUTING = True  # its routers' counts are summed over every rank (trains with --aux-loss)

MEASURE = Experts(ep_of, held=lambda t: t.state.owned)  # measure/experts.py: routing, balance, bytes

HOOKS = Hooks(check=check, state_dict=state_dict, model_state_bytes=model_state_every_rank,
              checkpoint_state=checkpoint_state, restore_checkpoint=restore_checkpoint, memory_layout=memory_layout)
