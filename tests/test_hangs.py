"""A hang named: each rank's record of collectives (parallel/loop/recorder.py, torch's Flight Recorder) and the
parent's one-line diagnosis (parallel/judge/hangs.py), on records made up here and on real gloo ranks."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from parallel.judge import diagnose, hangs, named
from parallel.loop import recorder
from parallel.world import errors
from tests.multirank import RankError, run_ranks

pytestmark = pytest.mark.timeout(120)


def _entry(seq, op="all_reduce", n=1024, step=1, state="finished", group="0", dtype="fp32"):
    return {"group": group, "seq": seq, "p2p": False, "op": op, "sizes": [[n]], "dtype": dtype, "step": step,
            "state": state, "time_ns": seq}


def _record(rank, entries, doing="step 1: in its train_step", groups=None):
    return {"rank": rank, "doing": doing, "error": "", "groups": groups or {"0": [0, 1]}, "entries": entries}


def test_a_rank_a_collective_behind_is_named_with_what_the_other_waits_in():
    records = {0: _record(0, [_entry(1, "broadcast", 38), _entry(2), _entry(3, state="started")]),
               1: _record(1, [_entry(1, "broadcast", 38), _entry(2)], doing="step 1: stopped")}
    line = hangs.diagnose(records, 2)
    assert line.startswith("rank 1 never issued collective #3 on group [0, 1] (its last: #2 all_reduce(1024 fp32))")
    assert "rank 0 waits in #3 all_reduce(1024 fp32) (step 1): rank 1 is 1 collective behind" in line
    assert line.endswith("it was: step 1: stopped")


def test_different_collectives_at_one_sequence_number_are_named_on_both_ranks():
    records = {0: _record(0, [_entry(1), _entry(2, n=1024, state="started", step=3)]),
               1: _record(1, [_entry(1), _entry(2, "all_gather", 512, state="started", step=3)])}
    assert hangs.diagnose(records, 2) == ("rank 1 is at collective #2 all_gather(512 fp32) on group [0, 1]; rank 0 "
                                          "waits in #2 all_reduce(1024 fp32) (step 3): the ranks issued different "
                                          "collectives")


def test_the_earliest_disagreement_of_all_groups_is_the_cause():
    groups = {"0": [0, 1], "1": [0, 1]}
    late = [_entry(1), _entry(5, group="1"), {**_entry(9, group="1"), "time_ns": 90}]
    early = [{**_entry(4, n=8), "time_ns": 40}]
    records = {0: _record(0, late[:2] + [late[2]] + early, groups=groups),
               1: _record(1, late[:2], groups=groups)}
    assert "#4 all_reduce(8 fp32)" in hangs.diagnose(records, 2)  # group 0's #4 came before group 1's #9


def test_a_rank_behind_because_it_waits_in_another_group_is_not_the_cause():
    # fsdp_pp at cpu:4, rank 1 stopped (seen once in the suite under load): rank 3 waits for it in their FSDP
    # group, so it is behind its pipeline partner rank 2, which issued its #23 first. The root is rank 1.
    groups = {"pipe": [2, 3], "fsdp": [1, 3]}
    records = {1: _record(1, [_entry(5, group="fsdp")], doing="step 1: stopped by --hang-rank", groups=groups),
               2: _record(2, [_entry(22, group="pipe"), {**_entry(23, group="pipe", state="started"), "time_ns": 50}],
                          groups=groups),
               3: _record(3, [_entry(5, group="fsdp"), _entry(22, group="pipe"),
                              {**_entry(6, group="fsdp", state="started"), "time_ns": 100}], groups=groups)}
    line = hangs.diagnose(records, 4, last={0: ("step 1: in its train_step", "Thread 0x1\n")})
    assert line.startswith("rank 1 never issued collective #6 on group [1, 3]"), line


def test_gaps_in_the_numbers_are_not_disagreements():
    # A monitored barrier takes a sequence number and leaves no entry: every rank skips it alike.
    records = {r: _record(r, [_entry(1), _entry(4)]) for r in (0, 1)}
    line = hangs.diagnose(records, 2)
    assert line.startswith("no collective is waiting and the ranks agree on every one")


def test_behind_counts_the_collectives_recorded_not_the_numbers():
    # Two numbers between #2 and #5 went to monitored barriers (no entry): rank 1 is one collective behind.
    records = {0: _record(0, [_entry(2), _entry(5, state="started")]), 1: _record(1, [_entry(2)])}
    assert "rank 1 is 1 collective behind" in hangs.diagnose(records, 2)


def test_a_failed_point_to_point_op_is_named_from_the_error_and_where_it_was_raised():
    # gloo's Flight Recorder leaves sends and receives out: the numbers agree, the error says what failed.
    stack = ('  File "/v/torch/distributed/pipelining/schedules.py", line 683 in _wait_batch_p2p\n'
             '  File "/w/parallel/strategies/pipeline_dist.py", line 238 in train_step\n')
    records = {0: {**_record(0, [_entry(1)]), "step": 1, "stack": stack,
                   "error": "RuntimeError: Timed out waiting 5000ms for send operation to complete"},
               1: {**_record(1, [_entry(1)], doing="step 1: stopped"), "step": 1}}
    assert hangs.diagnose(records, 2) == ("rank 0 failed at step 1 inside _wait_batch_p2p (from pipeline_dist.py:238 "
                                          "train_step): RuntimeError: Timed out waiting 5000ms for send operation to "
                                          "complete; rank 1 was: step 1: stopped")


def test_torchs_own_fingerprint_check_is_said_in_the_records_words():
    # --debug-collectives: TORCH_DISTRIBUTED_DEBUG=DETAIL raises on every rank before the collective runs.
    error = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
             "CollectiveFingerPrint(SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[1059850], TensorDtypes=Float, "
             "TensorDeviceTypes=...), but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=12, "
             "OpType=ALLREDUCE, TensorShape=[4, 8], TensorDtypes=BFloat16, TensorDeviceTypes=...).")
    records = {0: {**_record(0, []), "step": 0, "error": error}, 1: {**_record(1, []), "step": 0}}
    assert hangs.diagnose(records, 2) == ("rank 1 is at collective #12 all_reduce(32 bf16); rank 0 at #12 "
                                          "all_reduce(1059850 fp32) (step 0): the ranks issued different "
                                          "collectives (torch's check, --debug-collectives)")


def test_a_ranks_own_error_is_the_cause_not_the_others_timeouts():
    records = {0: {**_record(0, [_entry(1)]), "step": 2, "error": "RuntimeError: [Rank 0]: Ranks 1 failed to pass "
                                                                   "monitoredBarrier in 60000 ms"},
               1: {**_record(1, [_entry(1)]), "step": 2, "error": "InjectedFault: injected fault at step 2"}}
    assert hangs.diagnose(records, 2) == ("rank 1: InjectedFault: injected fault at step 2 (step 2; the others then "
                                          "waited for it)")


def test_a_pair_gloo_closed_on_its_timeout_is_the_collectives_failure_not_the_ranks_own():
    # Seen in the suite (zero_optimizer at cpu:4, rank 1 stopped): a rank whose pair gloo closed on its timeout,
    # through DDP's comm hook, had been named as the cause, and the stopped rank not at all.
    closed = "RuntimeError: Got the following error when running the callback: RuntimeError: Application " \
             "timeout caused pair closure"
    assert errors.from_a_collective(closed) and errors.from_a_collective(f"rank 2: {closed}")
    three, timed_out = {"0": [0, 1, 2]}, closed.replace("Application timeout caused pair closure",
                                                       "Timed out waiting 2000ms for recv operation")
    records = {0: {**_record(0, [_entry(1), _entry(2, state="started")], groups=three), "step": 1, "error": timed_out},
               1: _record(1, [_entry(1)], doing="step 1: stopped by --hang-rank", groups=three),
               2: {**_record(2, [_entry(1), _entry(2, state="started")], groups=three), "step": 1, "error": closed}}
    assert hangs.diagnose(records, 3).startswith("rank 1 never issued collective #2")


def test_an_all_to_alls_sizes_differ_by_rank_and_are_not_a_disagreement():
    # Expert dispatch sends uneven splits: the shapes of an all-to-all differ between ranks by design.
    records = {0: _record(0, [_entry(1, "all_to_all", 96), _entry(2, state="started")]),
               1: _record(1, [_entry(1, "all_to_all", 160)])}
    assert hangs.diagnose(records, 2).startswith("rank 1 never issued collective #2")


def test_a_scatters_root_passes_what_the_others_do_not_and_that_is_no_disagreement():
    # DTensor's distribute_tensor scatters from rank 0: its record has the sizes and the dtype, the others'
    # none (issue 59: tensor_parallel's hang was read as "different collectives" at set-up)
    root, other = _entry(1, "scatter", 16384, step=-1), {**_entry(1, "scatter", step=-1), "sizes": [], "dtype": ""}
    records = {0: _record(0, [root, _entry(2), _entry(3, state="started")]),
               1: _record(1, [other, _entry(2)], doing="step 1: stopped")}
    assert hangs.diagnose(records, 2).startswith("rank 1 never issued collective #3")
    records[1]["entries"][0] = {**other, "op": "all_reduce"}  # but another op at #1 is one
    assert "the ranks issued different collectives" in hangs.diagnose(records, 2)


def test_an_error_raised_from_a_collectives_failure_is_read_as_the_collectives():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for send")
        except RuntimeError as e:  # as torch's pipelining wraps a stage's failure
            raise RuntimeError("Failed to run stage backward:\nStage output: ...") from e
    except RuntimeError as wrapped:
        line = errors.error_line(wrapped)
    assert line == ("RuntimeError: Failed to run stage backward: (from RuntimeError: [gloo/transport/tcp/"
                    "unbound_buffer.cc:129] Timed out waiting 5000ms for send)")
    assert errors.from_a_collective(line)
    assert not errors.from_a_collective(errors.error_line(ValueError("a bug of the rank's own")))


def _group_timeouts(rank, world):
    import torch
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.world.dist import every_group_times_out

    before = td.new_group(list(range(world)))  # run_ranks has set the run's timeout (30 s here) already
    every_group_times_out(7)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # each dimension a group of its own
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for g in (before, mesh.get_group("dp"), mesh.get_group("tp"), td.new_group(list(range(world))))]


def test_every_group_a_run_makes_takes_its_timeout():
    # torch hands a new group (new_group's, DeviceMesh's) its 30-minute constant, not the world's timeout
    from tests.multirank import run_ranks

    assert run_ranks(_group_timeouts, 4, timeout=30) == [[30.0, 7.0, 7.0, 7.0]] * 4


def test_a_ring_that_forgot_a_groups_entries_is_read_with_torchs_status():
    # One ring for every group: rank 1 kept none of group 1's entries, but torch's status says it got to #9.
    groups = {"0": [0, 1], "1": [0, 1]}
    records = {0: _record(0, [_entry(8, group="1"), _entry(9, group="1"), _entry(2, state="started")], groups=groups),
               1: {**_record(1, [_entry(1)], groups=groups),
                   "status": {"1": {"last_enqueued_collective": 9}}}}
    line = hangs.diagnose(records, 2)
    assert "group [0, 1] (its last: #1 all_reduce(1024 fp32)); rank 0 waits in #2" in line  # not a false #8


def test_a_killed_rank_is_named_before_the_others_failures():
    records = {0: {**_record(0, [_entry(1)]), "step": 3, "error": "RuntimeError: Connection reset by peer"}}
    line = hangs.diagnose(records, 2)
    assert line.startswith("rank 1 left no record: died or killed before writing one, while the others were in "
                           "step 3 (its log says which); then rank 0 failed at step 3: RuntimeError: Connection "
                           "reset by peer"), line


def test_a_rank_that_failed_inside_a_collective_is_named_with_it():
    # a peer gone without a record (gloo aborted it before its stack was written): the collective the other
    # failed in is what names the bug (manual_ddp:buckets-reordered, seen once in the suite)
    rec = {**_record(0, [_entry(15), _entry(16, n=525312, step=0, state="started")]), "step": 0,
           "error": "RuntimeError: Connection reset by peer"}
    line = hangs.diagnose({0: rec}, 2)
    assert "then rank 0 failed in #16 all_reduce(525312 fp32) on group [0, 1] (step 0): RuntimeError" in line
    assert named.HANG_NAMED.search(line)


def test_a_killed_rank_is_named_before_the_disagreement_its_death_caused():
    # --hang-how kill on fsdp_tp at cpu:4: rank 0 leaves nothing, and rank 2, cut off by it, raised before
    # its #14 while rank 3 waits there: rank 0 is the cause, the pair's disagreement what followed
    records = {q: _record(q, [_entry(13), *([_entry(14, state="started")] if q == 3 else [])],
                          groups={"0": [2, 3]}) for q in (1, 2, 3)}
    line = hangs.diagnose(records, 4)
    assert line.startswith("rank 0 left no record: died or killed before writing one") and "; then rank 2 never" in line


def test_a_killed_rank_is_named_with_the_step_the_others_waited_in_not_the_one_a_later_stage_reached():
    # pipeline_dist at cpu:4, rank 0 killed in step 1: the last stage was done with its part and in step 2
    records = {q: {**_record(q, [_entry(1)], groups={"0": [0, 1, 2, 3]}), "step": 2 if q == 3 else 1}
               for q in (1, 2, 3)}
    assert hangs.diagnose(records, 4).startswith("rank 0 left no record: died or killed before writing one, while "
                                                 "the others were in step 1 (rank 3 already in step 2)")


def test_a_rank_that_left_nothing_is_named():
    line = hangs.diagnose({0: _record(0, [_entry(1)])}, 2)
    assert line.startswith("rank 1 left no record")


def test_a_rank_that_died_at_once_is_named_with_where_it_died():
    stack = ('Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n  File "/x/threading.py", line 1 '
             'in run\n\nCurrent thread 0x2 (most recent call first):\n  File "/v/torch/distributed/distributed_c10d.py"'
             ', line 3245 in all_reduce\n  File "/w/parallel/strategies/manual_ddp.py", line 88 in _bucket_ready\n')
    records = {0: _record(0, [_entry(1), _entry(2, n=4, state="started", step=0)])}
    log = "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at " \
          "pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size."
    line = hangs.diagnose(records, 2, {1: stack}, log)
    assert line.startswith("rank 1 died inside all_reduce (from manual_ddp.py:88 _bucket_ready)")
    assert "8 vs 4" in line and "rank 0 waits in #2 all_reduce(4 fp32) on group [0, 1] (step 0)" in line


def test_every_rank_that_died_is_named_and_where_the_project_issued_the_collective():
    # gloo aborts each rank that receives more than it expects: a rank padded longer kills its neighbours. The
    # counting steps' dispatch mode (wire.py) sits above the strategy's line: the line named is the strategy's.
    stack = ('Fatal Python error: Aborted\n\nCurrent thread 0x2 (most recent call first):\n  File "/v/torch/'
             'distributed/distributed_c10d.py", line 4943 in reduce_scatter_single\n  File "/w/parallel/wire.py", '
             'line 128 in __torch_dispatch__\n  File "/w/parallel/strategies/zero.py", line 168 in _reduce\n')
    records = {q: _record(q, [_entry(1), _entry(2, state="started", step=0)], groups={"0": [0, 1, 2, 3]})
               for q in (2, 3)}
    line = hangs.diagnose(records, 4, {0: stack, 1: stack})
    assert line.startswith("rank 0 died inside reduce_scatter_single (from zero.py:168 _reduce); Fatal Python error: "
                           "Aborted; rank 1 died too, inside reduce_scatter_single (from zero.py:168 _reduce); "
                           "rank 2 waits in #2 all_reduce(1024 fp32) on group [0, 1, 2, 3] (step 0)"), line


def test_the_rank_whose_collective_differs_from_the_others_is_the_one_named_at_it():
    four = {"0": [0, 1, 2, 3]}
    records = {q: _record(q, [_entry(1), _entry(2, n=1026 if q == 1 else 1024, state="started", step=0)], groups=four)
               for q in (1, 2, 3)}  # rank 0 died (gloo aborted it: its fatal stack); rank 1 padded its buffer longer
    line = hangs.diagnose(records, 4, {0: "Fatal Python error: Aborted"})
    assert line.startswith("rank 1 is at collective #2 all_reduce(1026 fp32) on group [0, 1, 2, 3]; rank 2 waits in "
                           "#2 all_reduce(1024 fp32) (step 0)"), line


# Real ranks: torch's Flight Recorder on gloo, the watch thread, the record a failing rank writes.

def _skips(rank, world, folder):
    rec = recorder.start(Path(folder), rank, stall_s=0.25)
    recorder.mark(0, "step 0: in its train_step")
    try:
        torch.distributed.all_reduce(torch.ones(4))
        if rank == 1:
            recorder.mark(0, "step 0: skipped one")
            time.sleep(30)  # never issues the second; its watch thread writes its record after 0.25 s
        torch.distributed.all_reduce(torch.ones(8))
    except Exception as e:
        recorder.stop(e)
        raise
    return rec.written


def test_a_rank_that_skips_a_collective_is_named_from_real_records(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # the ranks copy this environment before their group
    with pytest.raises(RankError):
        run_ranks(_skips, 2, (str(tmp_path),), timeout=1, total=40)
    records = diagnose.read(tmp_path)
    assert records[0]["written"] == "it failed" and "Timed out" in records[0]["error"]
    assert records[1]["written"].startswith("no progress for 0.25 s") and (tmp_path / "rank1.stack.txt").exists()
    line = diagnose.explain(tmp_path, 2)
    assert line.startswith("rank 1 never issued collective #2 on group [0, 1] (its last: #1 all_reduce(4 fp32))")
    assert "rank 0 waits in #2 all_reduce(8 fp32) (step 0)" in line and line.endswith("it was: step 0: skipped one")
    assert (tmp_path / "diagnosis.txt").read_text() == line + "\n"
    assert "all_reduce(8 fp32)  [[8]]  step 0  failed" in (tmp_path / "rank0.txt").read_text()  # its timeout


def _stuck(rank, world, folder):
    with recorder.recording(Path(folder), rank, pg_timeout=1):  # the watch ends a wait after 2 x 1 + 2 s
        recorder.mark(0, "step 0: in its train_step")
        torch.distributed.all_reduce(torch.ones(4))
        if rank == 1:
            recorder.mark(0, "step 0: skipped one")
            time.sleep(60)
        torch.distributed.all_reduce(torch.ones(8))  # the group's own timeout is 60 s: torch would not end it


def test_a_wait_torch_does_not_bound_is_ended_by_the_watch_thread_and_diagnosed(tmp_path, monkeypatch):
    # a collective whose timeout is longer than --pg-timeout says (a group torch made with its own default, a
    # functional collective's wait): rank 0 waits in it, and its watch thread ends it, its record written
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 died \(exit code 1\)"):
        run_ranks(_stuck, 2, (str(tmp_path),), timeout=60)
    assert time.monotonic() - start < 30  # 4 s and start-up, not the group's 60 s
    records = diagnose.read(tmp_path)
    assert records[0]["error"].startswith("TimeoutError: no progress for 4 s inside a collective")
    assert errors.WATCH_ENDED in records[0]["error"] and errors.from_a_collective(records[0]["error"])
    line = diagnose.explain(tmp_path, 2)
    assert line.startswith("rank 1 never issued collective #2 on group [0, 1] (its last: #1 all_reduce(4 fp32))")
    assert "rank 0 waits in #2 all_reduce(8 fp32) (step 0)" in line and line.endswith("it was: step 0: skipped one")


def _ended(rank, world, folder):
    recorder.start(Path(folder), rank, stall_s=60)
    recorder.mark(0, "step 0: in its train_step")
    os.kill(os.getpid(), signal.SIGTERM)  # as torchrun ends every rank once one failed
    time.sleep(30)


def test_a_rank_leaves_what_it_was_doing_and_its_launchers_sigterm_adds_its_stacks(tmp_path):
    with pytest.raises(RankError, match="exit code -15"):
        run_ranks(_ended, 1, (str(tmp_path),), timeout=30)
    ((rank, (doing, stack)),) = diagnose.last(tmp_path).items()
    assert (rank, doing) == (0, "step 0: in its train_step") and "in _ended" in stack


def test_a_killed_rank_is_told_from_the_ranks_its_launcher_ended_and_named_with_what_it_was_doing():
    stack = 'Thread 0x1 (most recent call first):\n  File "/v/torch/distributed/distributed_c10d.py", line 9 in ' \
            'all_reduce\n  File "/w/parallel/kit/collectives.py", line 56 in sum_gradients\n'
    killed = ("step 1: stopped by --hang-rank before its first gradient collective (allreduce_)", "")
    records = {0: {**_record(0, [_entry(15), _entry(16, n=64, state="started")]), "step": 1}}
    line = hangs.diagnose(records, 3, last={1: killed, 2: ("step 1: in its train_step", stack)})
    assert line == ("rank 1 left no record: died or killed before writing one (it was: step 1: stopped by "
                    "--hang-rank before its first gradient collective (allreduce_)), while the others were in "
                    "step 1 (its log says which); then rank 0 waited in #16 all_reduce(64 fp32) on group [0, 1] "
                    "(step 1), which rank 1 never joined")
    # torchrun ended the others before any wrote a record: the step and the place from what they left
    line = hangs.diagnose({}, 3, last={0: killed, 1: ("step 1: in its train_step", stack), 2: ("", stack)})
    assert line == ("rank 0 left no record: died or killed before writing one (it was: step 1: stopped by "
                    "--hang-rank before its first gradient collective (allreduce_)), while the others were in "
                    "step 1 (its log says which); then ranks 1, 2 were ended by their launcher (rank 1 inside "
                    "all_reduce (from collectives.py:56 sum_gradients))")


def test_a_clean_run_leaves_no_record(tmp_path):
    rec = recorder.start(tmp_path / "hang", 0, stall_s=60)
    recorder.mark(0, "step 0")
    recorder.stop()
    assert not (tmp_path / "hang").exists() and rec.written == ""


def test_nccls_own_recorder_is_read_beside_the_generic_one(tmp_path, monkeypatch):
    # nccl records into a recorder of its own, dumped by _dump_nccl_trace on CUDA builds (torch's init.cpp);
    # this CPU build has none, so a stand-in of its dump, in its fields, beside gloo's (the watchdog's group).
    import pickle

    import torch.distributed as td

    def entry(seq, name, state, retired, group, t):
        return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "profiling_name": name,
                "process_group": (group, ""), "input_sizes": [[1024]], "input_dtypes": ["BFloat16"],
                "time_created_ns": t, "state": state, "retired": retired}

    nccl = {"entries": [entry(7, "nccl:all_reduce", "completed", True, "0", 20),
                        entry(8, "nccl:reduce_scatter", "started", False, "0", 30)],
            "pg_status": {"0": {"last_enqueued_collective": 8, "last_completed_collective": 7}}}
    gloo = {"entries": [entry(3, "gloo:all_reduce", "scheduled", True, "1", 10)],
            "pg_status": {"1": {"last_enqueued_collective": 3, "last_completed_collective": 3}}}
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a: pickle.dumps(nccl), raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a: pickle.dumps(gloo), raising=False)
    monkeypatch.setattr(td, "is_initialized", lambda: True)
    monkeypatch.setattr(recorder, "_groups", lambda: {"0": [0, 1], "1": [0, 1]})
    rec = recorder.Recorder(tmp_path, 0, stall_s=60)
    try:
        snap = rec.snapshot()
    finally:
        rec.close()
    assert [(e["group"], e["seq"], e["op"], e["dtype"], e["state"]) for e in snap["entries"]] == [
        ("1", 3, "all_reduce", "bf16", "finished"), ("0", 7, "all_reduce", "bf16", "finished"),
        ("0", 8, "reduce_scatter", "bf16", "started")]
    assert snap["status"].keys() == {"0", "1"}
    assert recorder.waiting([nccl["pg_status"]]) and not recorder.waiting([gloo["pg_status"]])
