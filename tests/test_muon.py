"""--optimizer muon (loop/muon.py; docs/optimizer.md): torch.optim.Muon on the hidden matrices and AdamW on the
rest as one optimiser, equal to torch's two stepped apart; on spawned gloo ranks, a sharded matrix's update
(a DTensor's dim-0 and dim-1 shards, manual_tp's cut, ZeRO's flat chunks) equal bit for bit to one device's,
the injected bug's not; and, slow, every layout that shards a matrix under Muon against `single` in float64
with the gathers' bytes counted as predicted, and a resume bitwise."""

import copy

import pytest
import torch
from torch import nn

from parallel.config import ConfigError, RunConfig
from parallel.loop import muon, optim
from parallel.models import transformer
from parallel.models.workloads import WORKLOADS
from tests.multirank import faulted_and_resumed, judged_on_ranks, run_ranks

pytestmark = pytest.mark.timeout(240)


# The transformer at width 32, not its 128: Muon's Newton-Schulz is 15 matrix products a matrix a step, half
# a second of the default transformer's step on this machine's single thread, and shape is all it reads.
NARROW = {"hidden": 32}


def _tagged_transformer():
    workload = transformer.shaped(WORKLOADS["transformer"], **NARROW)
    model = workload.build_model(0)
    optim.tag(model, workload.classes)
    return model


def _config(**fields):
    return RunConfig(workload="transformer", optimizer="muon", **fields).validate()


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = _tagged_transformer()
    groups = optim.Recipe(_config()).groups(model.parameters())
    muons = [p for g in groups if g.get("muon") for p in g["params"]]
    assert muons and all(optim.kind_of(p) == "matrix" for p in muons)
    rest = [p for g in groups if not g.get("muon") for p in g["params"]]
    assert {optim.kind_of(p) for p in rest} == {"embedding", "vector", "head"}
    assert all(g["weight_decay"] == 0 for g in groups if any(optim.kind_of(p) == "vector" for p in g["params"]))
    k = optim.moments(_config(), model.parameters())  # one buffer a matrix element, two elsewhere
    assert 1 < k < 2 and optim.moments(RunConfig(optimizer="adamw").validate(), model.parameters()) == 2


def test_one_optimiser_steps_as_torchs_muon_and_adamw_stepped_apart_and_resumes_from_its_state_dict():
    torch.manual_seed(0)
    ours, theirs, resumed = (_tagged_transformer() for _ in range(3))
    recipe = optim.Recipe(_config(lr=1e-2))
    mine = recipe(ours.parameters())
    matrices = [p for p in theirs.parameters() if optim.kind_of(p) == "matrix"]
    rest = recipe.groups([p for p in theirs.parameters() if optim.kind_of(p) != "matrix"])
    pair = (torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95)))
    later = recipe(resumed.parameters())
    x = torch.randint(0, 64, (4, 16))
    for step in range(3):
        for model, opts in ((ours, [mine]), (theirs, pair), (resumed, [later])):
            for o in opts:
                o.zero_grad()
            model(x).float().square().mean().backward()
            for o in opts:
                o.step()
        if step == 0:  # the resumed copy takes ours's state after one step, as a checkpoint's load gives it
            resumed.load_state_dict(ours.state_dict())
            later.load_state_dict(copy.deepcopy(mine.state_dict()))  # its own tensors, as from a file
    for (name, a), b, c in zip(ours.named_parameters(), theirs.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name


def _sharded(rank, world):
    """A matrix's Muon step whole (torch's) and from each layout's shards; every result whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    shapes = [(12, 8), (6, 10)]
    weights, grads = [torch.randn(s) for s in shapes], [torch.randn(s) for s in shapes]
    config = _config(lr=0.1)

    def stepped(params, given, alone=False):
        opt = optim.Recipe(config)([optim.tag_as(p, "matrix") for p in params])
        opt.alone = alone
        for p, g in zip(params, given, strict=True):
            p.grad = g
        for _ in range(2):  # the momentum's second step too
            opt.step()

    whole = [nn.Parameter(w.clone()) for w in weights]
    stepped(whole, [g.clone() for g in grads])
    out = {"whole": [p.detach() for p in whole]}
    mesh = init_device_mesh("cpu", (world,))
    for dim in (0, 1):
        params = [nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(dim)])) for w in weights]
        stepped(params, [distribute_tensor(g.clone(), mesh, [Shard(dim)]) for g in grads])
        out[f"dtensor {dim}"] = [p.full_tensor() for p in params]
        cut = [muon.split(nn.Parameter(w.clone().chunk(world, dim)[rank]), dim) for w in weights]
        stepped(cut, [g.clone().chunk(world, dim)[rank] for g in grads])
        out[f"split {dim}"] = [torch.cat(_every(p.detach(), world), dim) for p in cut]
    flat = torch.cat([w.reshape(-1) for w in weights] + [torch.zeros(4)])  # 176 elements, padded: 2 x 88
    offsets, length = [(0, torch.Size(shapes[0])), (96, torch.Size(shapes[1]))], flat.numel() // world
    chunk = nn.Parameter(flat[rank * length:][:length].clone())
    setattr(chunk, muon.WHOLE, muon.Chunk(offsets, rank * length, length, world))  # a matrix across the cut
    flat_grad = torch.cat([g.reshape(-1) for g in grads] + [torch.zeros(4)])
    stepped([chunk], [flat_grad[rank * length:][:length].clone()])
    joined = torch.cat(_every(chunk.detach(), world))
    out["chunk"] = [joined[o:o + s.numel()].view(s) for o, s in offsets]
    alone = [nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
    stepped(alone, [distribute_tensor(g.clone(), mesh, [Shard(0)]) for g in grads], alone=True)
    out["alone"] = [p.full_tensor() for p in alone]
    return out


def _every(t, world):
    import torch.distributed as td

    parts = [torch.empty_like(t) for _ in range(world)]
    td.all_gather(parts, t.contiguous())
    return parts


def test_a_sharded_matrix_steps_bit_for_bit_as_one_device_and_the_shard_alone_does_not():
    for got in run_ranks(_sharded, 2):
        for layout in ("dtensor 0", "dtensor 1", "split 0", "split 1", "chunk"):
            assert all(torch.equal(a, b) for a, b in zip(got[layout], got["whole"], strict=True)), layout
        assert not torch.allclose(got["alone"][0], got["whole"][0], atol=1e-3)


def test_a_torch_without_muons_newton_schulz_refuses_muon_in_one_line(monkeypatch):
    monkeypatch.setattr(muon, "MISSING", "--optimizer muon needs torch.optim.Muon's Newton-Schulz")
    with pytest.raises(ConfigError, match="needs torch.optim.Muon"):
        _config()
    assert RunConfig(workload="transformer", optimizer="adamw").validate().optimizer == "adamw"


def test_muon_refuses_kv_heads_copied_across_ranks_in_one_line():
    config = RunConfig(workload="transformer", arch="llama", kv_heads=1, devices="cpu:2", optimizer="muon")
    from parallel import strategies
    with pytest.raises(ConfigError, match="Muon orthogonalises whole matrices"):
        strategies.get("manual_tp").validate(config.validate())


# ---- slow: every layout that shards a matrix, and those that hold it whole, under Muon against `single`


def _muon(workload, world, options):  # judged_on_ranks imports it
    return RunConfig(workload=workload, devices=f"cpu:{world}", batch_size=8, steps=2, warmup=1, extras=False,
                     optimizer="muon", clip_norm=0.25, lr_schedule="cosine", warmup_steps=2, check_replicas=True,
                     options=options, **(NARROW if workload == "transformer" else {})).validate()


SHARDED = ("fsdp", "zero", "manual_tp")  # a DTensor, a chunk, a cut; tensor_parallel's Shard(1) is bitwise above,
# and the matrix in docs/measurements.md has it and fsdp_tp


@pytest.mark.slow
def test_every_layout_under_muon_matches_single_with_the_gathers_bytes_counted_as_predicted():
    # the layouts that shard a matrix, and experts; the others step torch's Muon as `single` does (the matrix
    # in docs/measurements.md has every strategy)
    runs = [(name, "transformer", {"zero_stage": 2} if name == "zero" else {}) for name in SHARDED]
    runs += [("expert_parallel", "moe", {})]
    rows = judged_on_ranks(2, runs, _muon)
    assert all(r.update_ms_p50 > 0 for r in rows)  # the update's own time, from the loop's hooks
    for (name, _, _), row in zip(runs, rows, strict=True):
        if name in SHARDED:  # the gathers are part of the count, and of the prediction
            assert row.comm_bytes_per_step == pytest.approx(row.comm_bytes_predicted, rel=1e-9), name


# Muon's state beside AdamW's moments, with bf16-master's fp32 masters beside both: zero's own chunks, and a
# load by DCP (a state of masters alone, not fresh to DCP, once left the moments unloaded in ddp, fsdp and
# tensor_parallel; all six that checkpoint were measured bitwise, docs/measurements.md)
RESUMED = ("zero", "fsdp")


def _resumed(rank, world, folder):
    return {(name, run): v for name in RESUMED for run, v in faulted_and_resumed(
        rank, world, name, f"{folder}/{name}", workload="transformer", batch_size=8, optimizer="muon",
        precision="bf16-master", **NARROW).items()}


@pytest.mark.slow
def test_a_resume_under_muon_and_masters_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    got = run_ranks(_resumed, 2, (str(tmp_path),), timeout=200)[0]
    for name in RESUMED:
        whole, resumed = got[(name, "whole")], got[(name, "resumed")]
        assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole), name
