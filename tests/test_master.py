"""--precision bf16-master (loop/master.py; docs/optimizer.md): bf16 weights stepped through fp32 masters,
bit for bit torch's own update on the masters; what a master keeps that a bf16 weight loses; a resume;
the ZeRO paper's 2 + 2 + K; the refusals; and, slow, every layout that keeps a master against `single`,
the model state by kind beside the formula, and the run's weights the fp32 masters."""

import pytest
import torch
from torch import nn

from parallel.config import ConfigError, RunConfig
from parallel.loop import master, optim
from parallel.measure import formulas, sharded
from tests.multirank import judged_on_ranks

pytestmark = pytest.mark.timeout(240)


def _weights(seed: int = 0) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    matrix, scale = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.ones(4))
    return [optim.tag_as(matrix, "matrix"), optim.tag_as(scale, "vector")]


def _master(params, name: str = "adamw", lr: float = 3e-3) -> torch.optim.Optimizer:
    config = RunConfig(workload="transformer", optimizer=name, lr=lr, precision="bf16-master").validate()
    return optim.make_optimizer(config)(params)


def _bf16(params) -> list[nn.Parameter]:
    out = []
    for p in params:
        q = optim.like(nn.Parameter(p.detach().clone()), p)
        master.cast(nn.ParameterList([q]))
        out.append(q)
    return out


@pytest.mark.parametrize("name", ["adamw", "sgd", "muon"])
def test_a_step_is_torchs_own_update_on_fp32_masters_rounded_to_bf16(name):
    fp32 = _weights()
    low = _bf16(fp32)
    ours = _master(low, name)
    theirs = torch.optim.AdamW if name == "adamw" else None  # the same recipe on fp32 copies, by hand
    copies = [nn.Parameter(p.detach().bfloat16().float()) for p in fp32]  # what the masters start from
    for c, p in zip(copies, fp32, strict=True):
        optim.tag_as(c, optim.kind_of(p))
    config = RunConfig(workload="transformer", optimizer=name, lr=3e-3).validate()
    reference = optim.make_optimizer(config)(copies)
    assert theirs is None or isinstance(reference, theirs)
    for step in range(3):
        torch.manual_seed(10 + step)
        grads = [torch.randn_like(p, dtype=torch.bfloat16) for p in low]
        for p, c, g in zip(low, copies, grads, strict=True):
            p.grad, c.grad = g.clone(), g.float()
        ours.step()
        reference.step()
        for p, c in zip(low, copies, strict=True):
            held = ours.state[p][master.MASTER]
            assert p.dtype == torch.bfloat16 and held.dtype == torch.float32
            assert torch.equal(held, c.detach()) and torch.equal(p.detach(), c.detach().bfloat16()), (name, step)


def test_a_master_keeps_what_a_bf16_weight_loses_and_the_injected_bug_loses_it():
    # A norm's scale at 1.0: bf16 holds 1 - 2^-8 below it, so AdamW's 1e-3 steps round back to 1.0 until the
    # master has moved more than half of that
    def run(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
        p = optim.tag_as(nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), "vector")
        opt = _master([p], lr=1e-3)
        if bug:
            opt.keep_in_bf16()
        for _ in range(3):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.detach().float(), opt.state[p][master.MASTER]

    moved, kept = run(bug=False)
    stuck, low = run(bug=True)
    assert kept.dtype == torch.float32 and torch.allclose(kept, torch.full((4,), 0.997), atol=2e-5)
    assert torch.equal(moved, torch.full((4,), 1 - 2**-8))  # the master crossed the midpoint: the weight moved
    assert low.dtype == torch.bfloat16 and torch.equal(stuck, torch.ones(4))  # every update rounded away


def test_state_dict_holds_the_master_and_a_resume_is_bitwise():
    def steps(opt, params, n, seed):
        for i in range(n):
            torch.manual_seed(seed + i)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()

    whole = _bf16(_weights())
    opt = _master(whole)
    steps(opt, whole, 4, 0)
    half = _bf16(_weights())
    first = _master(half)
    steps(first, half, 2, 0)
    saved = first.state_dict()
    assert set(saved["state"][0]) == {"master", "step", "exp_avg", "exp_avg_sq"}
    again = _bf16(_weights())
    with torch.no_grad():
        for p, q in zip(again, half, strict=True):
            p.copy_(q)
    resumed = _master(again)
    resumed.load_state_dict(saved)
    steps(resumed, again, 2, 2)
    for p, q in zip(whole, again, strict=True):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master"], resumed.state[q]["master"])


def test_the_model_state_is_the_zero_papers_2_2_k():
    psi, n = 1000, 4  # AdamW: K = 12 (the fp32 master and two moments); Rajbhandari et al. section 3
    assert formulas.run_state(psi, 0, n, 2, 2, master=4) == 16 * psi
    assert formulas.run_state(psi, 1, n, 2, 2, master=4) == (2 + 2 + 12 / n) * psi
    assert formulas.run_state(psi, 2, n, 2, 2, master=4) == (2 + (2 + 12) / n) * psi
    assert formulas.run_state(psi, 3, n, 2, 2, master=4) == 16 * psi / n
    assert formulas.element_bytes("bf16-master") == 2
    assert sharded.master_of(RunConfig(precision="bf16-master").validate()) == 4


def test_hogwild_is_refused_in_one_line():
    from parallel import strategies

    config = RunConfig(workload="mlp", devices="cpu:2", precision="bf16-master").validate()
    with pytest.raises(ConfigError, match="shared copy") as e:
        strategies.get("hogwild").validate(config)
    assert "\n" not in str(e.value)


# ---- slow: every layout that keeps masters, against `single` under bf16-master


def _run(workload, world, options):  # judged_on_ranks imports it
    return RunConfig(workload="transformer", devices=f"cpu:{world}", batch_size=8, steps=3, warmup=1,
                     optimizer="adamw", precision="bf16-master", check_replicas=True, options=options).validate()


LAYOUTS = [("ddp", {}), ("zero", {"zero_stage": 1}), ("zero", {"zero_stage": 2}), ("zero_optimizer", {}),
           ("fsdp", {}), ("manual_tp", {}), ("tensor_parallel", {}), ("pipeline_dist", {})]


@pytest.mark.slow
def test_every_layout_keeps_fp32_masters_where_the_paper_says_and_matches_single():
    world = 2
    rows = judged_on_ranks(world, [(name, "transformer", options) for name, options in LAYOUTS], _run)
    for (name, options), row in zip(LAYOUTS, rows, strict=True):  # each matched (judged_on_ranks)
        s = sharded.result(row)
        if s is None or s.zero_stage is None:
            continue
        masters, params = max(s.master_bytes_per_rank), max(s.param_bytes_per_rank)
        if name != "zero_optimizer":  # whole parameters owned greedily: uneven
            # 4 bytes of master to a bf16 weight's 2: all of them (ddp), 1/N of them from ZeRO-1 on (fsdp's
            # weights are 1/N too)
            share = world if 1 <= s.zero_stage < 3 else 1
            assert masters == pytest.approx(2 * params / share, rel=0.02), (name, options, s)
        assert row.details["model_state_bytes_per_device"][0] == pytest.approx(s.zero_formula_bytes, rel=0.02), name
