"""The theory beside every pipeline run (measure/replay.py): each rank's own action list
played out on piece times, the closed forms it must agree with where their assumptions hold, and the
micro-batches each order keeps at once. Pure arithmetic on torch's own action lists: no process starts."""

import types

import pytest

from parallel import strategies
from parallel.config import ConfigError, RunConfig
from parallel.kit import schedules
from parallel.measure.replay import (
    CLOSED_FORMS,
    closed_form_idle,
    held,
    needs,
    rank_of,
    replay,
    replayed,
    torch_groups,
    torch_orders,
)
from parallel.measure.stage_time import simulate
from parallel.strategies.model import pipeline_dist


def orders(schedule: str, p: int, m: int, groups: bool = False):
    """replay.torch_orders for `schedule` as torch 2.13 builds it (its visualiser's mock stages give the
    same pipeline_order a run's schedule object holds); with `groups`, (orders, torch_groups)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    row = pipeline_dist.SCHEDULES[schedule]
    name, v = row.cls, row.per_rank
    ops = get_schedule_ops(getattr(schedules, name), p, m, v if v > 1 else None)
    held_by = types.SimpleNamespace(pipeline_order=dict(enumerate(ops)))
    out = torch_orders(held_by, schedule, p, m)
    return (out, torch_groups(held_by, schedule, p)) if groups else out


def times(stages: int, f=1.0, i=1.0, w=1.0) -> dict:
    return {(s, k): t for s in range(stages) for k, t in (("F", f), ("I", i), ("W", w), ("B", i + w))}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 12)])
def test_one_stage_schedules_replay_to_their_closed_form_on_equal_stages(schedule, p, m):
    r = replayed(orders(schedule, p, m), times(p, f=1.0, i=1.5, w=0.5))
    assert r["span_ms"] == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1)(F + B)
    assert r["idle"] == pytest.approx(closed_form_idle(schedule, p, m, 1, times(p, 1.0, 1.5, 0.5)))


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16)])
def test_torchs_zb1p_replays_to_zb_h1s_bubble_while_w_fills_it(p, m):
    for f, i, w in [(1, 1, 1), (2, 1, 1), (1, 2, 0.5)]:  # W no longer than F + I: it fits in the bubble
        r = replayed(orders("interleavedzb", p, m), times(2 * p, f, i, w))
        assert r["span_ms"] - 2 * m * (f + i + w) == pytest.approx(CLOSED_FORMS["interleavedzb"](p, f, i + w, i, w))


def test_dualpipev_replays_to_deepseeks_closed_form_on_equal_pieces_with_torchs_sends():
    """(PP/2-1)(F&B+B-3W), PP = 2p stages, F&B = F + B (torch runs the pair in turn): 2(p-1) at F = I = W,
    once each overlapped pair's outputs leave after the pair, as torch posts their sends; sent at once,
    the order would idle half that. At unequal pieces the closed form and the replay part."""
    for p in (2, 4):
        m = 4 * p
        dualpipev, groups = orders("dualpipev", p, m, groups=True)
        grouped = replayed(dualpipev, times(2 * p), groups=groups)["span_ms"] - 2 * m * 3
        assert grouped == pytest.approx(CLOSED_FORMS["dualpipev"](p, 1, 2, 1, 1)) == 2 * (p - 1)
        assert replayed(dualpipev, times(2 * p))["span_ms"] - 2 * m * 3 == pytest.approx(p - 1)
    dualpipev, groups = orders("dualpipev", 4, 8, groups=True)  # F = 2: 12 replayed against the form's 9
    assert replayed(dualpipev, times(8, f=2.0), groups=groups)["span_ms"] - 8 * 2 * 4 == pytest.approx(12)


def test_a_wrong_dependency_moves_the_replay():
    one_f_one_b = orders("1f1b", 4, 8)

    def sent_a_micro_batch_late(action, stages):  # a forward waits for the next micro-batch's on the stage before
        s, kind, j = action
        return needs(action, stages) + ([(s - 1, "F", j + 1)] if kind == "F" and s > 0 and j < 7 else [])

    right = max(p[5] for p in replay(one_f_one_b, times(4)))
    assert right == 33.0 and max(p[5] for p in replay(one_f_one_b, times(4), needs=sent_a_micro_batch_late)) == 81.0

    def input_gradient_after_the_weights(action, stages):  # the I/W split ignored: I waits for the next W
        s, kind, j = action
        return needs(action, stages) + ([(s + 1, "W", j)] if kind in "IB" and s < stages - 1 else [])

    with pytest.raises(ValueError, match="waits on itself"):  # zbv's order cannot be met then at all
        replay(orders("zbv", 4, 8), times(8), needs=input_gradient_after_the_weights)


def test_a_hand_off_between_ranks_is_paid_and_the_vs_turn_within_one_rank_is_not():
    zbv, p = orders("zbv", 2, 4), 2
    assert [rank_of(s, p, "v") for s in range(4)] == [0, 1, 1, 0]  # hop_ms measures 0|1 and 2|3
    free = replayed(zbv, times(4))["span_ms"]
    assert replayed(zbv, times(4), hop={0: 0.5, 2: 0.5})["span_ms"] > free


def test_a_receive_posted_at_its_use_pays_the_hand_off_after_the_receiver_is_free():
    """GPipe, p = 2: rank 1's forwards queue behind each other, so its inputs, sent early, wait for it;
    posted late (torch's one-stage schedules), each of its m forwards pays the hand-off once it is free."""
    gpipe, ms, hop = orders("gpipe", 2, 4), {(s, k): t for s in (0, 1) for k, t in (("F", 1.0), ("B", 2.0))}, {0: 0.5}
    early, late = replayed(gpipe, ms, hop)["span_ms"], replayed(gpipe, ms, hop, late=True)["span_ms"]
    assert early == 0.5 + 1 + 4 * 1 + 4 * 2 + 0.5 + 2  # the hand-offs that wait for data only: two
    assert late == early + 3 * 0.5 + 3 * 0.5  # and each later forward and backward of rank 1 and 0 pays one


def test_the_micro_batches_each_order_holds():
    for p, m in [(2, 4), (4, 8)]:
        assert held(orders("1f1b", p, m))[0] == min(m, p)  # PipeDream-Flush: p on the first stage
        assert set(held(orders("gpipe", p, m)).values()) == {m}  # GPipe: all of them, everywhere
        # DualPipeV: PP + 1 chunks a rank (PP = 2p stages), ZBV 2p: as DeepSeek's table and ZB's paper give
        assert set(held(orders("dualpipev", p, 2 * m), by="rank").values()) == {2 * p + 1}
        assert set(held(orders("zbv", p, 2 * m), by="rank").values()) == {2 * p}


def test_play_is_the_replay_of_one_stage_per_device():
    ops = [schedules.one_f_one_b(s, 3, 6) for s in range(3)]
    orders = {s: [(s, k, j) for k, j in ops[s]] for s in range(3)}
    pieces = replay(orders, {(s, k): 1.0 + s + (k == "B") for s in range(3) for k in "FB"}, dict.fromkeys(range(2), .2))
    played = simulate(ops, [1.0, 2.0, 3.0], [2.0, 3.0, 4.0], hop=0.2)
    assert max(p[5] for p in pieces) == pytest.approx(played)


def test_dualpipev_needs_two_micro_batches_per_rank_and_gets_them_by_default():
    config = RunConfig(devices="cpu:2", batch_size=64, options={"schedule": "dualpipev"})
    config = strategies.get("pipeline_dist").run(config)  # what the strategy is handed: its options typed
    assert pipeline_dist.fit_microbatches(config, 4, 64) == {"microbatches": 8}  # 2p = 8 stages
    assert pipeline_dist.fit_microbatches(config, 2, 64) == {"microbatches": 4}
    with pytest.raises(ConfigError, match="needs at least as many micro-batches as its 4 stages"):
        pipeline_dist.check_pipeline(strategies.get("pipeline_dist").run(RunConfig(
            workload="transformer", devices="cpu:2", batch_size=64,
            options={"schedule": "dualpipev", "microbatches": 2, "balance": "params"})), 2, 64)
