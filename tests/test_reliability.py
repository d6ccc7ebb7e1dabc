"""Reliability: resume after a crash, hangs end with the missing rank named, one clear error per failed
rank, even shards, bad input refused, interruption keeps finished rows, loopback-only rendezvous.
All on CPU with gloo; each test well under a minute."""

import contextlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from parallel import cli, strategies
from parallel.config import ConfigError, RunConfig
from parallel.launch import child as launch
from parallel.loop import checkpoint
from parallel.loop.optim import make_optimizer, tag
from parallel.loop.train import NonFiniteLoss
from parallel.models.workloads import WORKLOADS
from parallel.strategies.base import Trainable
from parallel.worker import execute
from parallel.world.dist import Dist
from tests.conftest import ROOT, in_process
from tests.multirank import uninterrupted

pytestmark = pytest.mark.timeout(120)
DDP = ["--devices", "cpu:2", "--warmup", "0", "--batch-size", "32", "--timeout", "90"]


def parallel(*args):
    return in_process(*args)


def rows(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())["rows"]


@pytest.mark.slow
def test_a_crashed_rank_restarts_resumes_and_ends_like_an_uninterrupted_run(tmp_path):
    # Rank 1 raises before step 3; torchrun restarts the group once; it resumes from the checkpoint
    # written after step 1 and recomputes steps 2-5 on the same batches (data is a function of the step).
    common = ["run", "ddp", *DDP, "--steps", "6", "--checkpoint-every", "2", "--resume", "--max-restarts", "1"]
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    p = parallel(*common, "--fail-at-step", "3", "--fail-rank", "1", "--out", str(crashed))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "InjectedFault" in (crashed / "logs" / "ddp.log").read_text()  # it did crash, and recovered
    # The same run uninterrupted, on spawned ranks (tests/multirank.py: the same code, for a launch's cost less)
    uninterrupted("ddp", RunConfig(devices="cpu:2", warmup=0, batch_size=32, steps=6, checkpoint_every=2,
                                   out=str(clean)).validate())
    a, b = saved(crashed / "checkpoints" / "ddp"), saved(clean / "checkpoints" / "ddp")
    assert int(a["step"]) == int(b["step"]) == 5
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])  # bitwise: same sums, same order
    assert all(torch.equal(a["optim"]["state"][k]["momentum_buffer"], b["optim"]["state"][k]["momentum_buffer"])
               for k in b["optim"]["state"])


def saved(folder, workload: str = "cnn") -> dict:
    """A DCP checkpoint of this program read back into plain tensors (model, optimiser state, step)."""
    model = WORKLOADS[workload].build_model(0)
    tag(model, WORKLOADS[workload].classes)
    optimizer = make_optimizer(RunConfig().validate())(model.parameters())
    sd = checkpoint.state(Trainable(model, optimizer, None, torch.device("cpu")))
    checkpoint.load_into(folder, sd)
    return sd


MATRIX = ["--workload", "moe", "--steps", "3", "--batch-size", "32", "--pg-timeout", "2", "--timeout", "60"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("devices, rank, how", [("cpu:4", 1, "stop"), ("cpu:4", 0, "kill")])
def test_every_multi_process_strategy_names_the_hung_rank_and_its_step_within_the_timeout(devices, rank, how,
                                                                                          tmp_path):
    """Issue 59's matrix: --hang-rank in every multi-process strategy that runs on the devices (the rank that
    stops, and rank 0, which holds what the others meet at, killed by SIGKILL), in one comparison on the
    workload they all train: each row ends at its 2 s timeout, not at --timeout's 60 s, with one line that
    names the rank and step 1, and "different collectives" nowhere, since the ranks issued the same calls.
    A cover of the matrix (hang_matrix.COVER): one strategy for each kind of wait the fault leaves the
    others in; `python -m parallel.tools.hang_matrix` runs every strategy alone, as `run`, at cpu:2 and
    cpu:4, with both ranks and faults."""
    from parallel.tools import hang_matrix

    names = sorted(hang_matrix.COVER[how])
    assert set(names) <= {name for name, _, _ in hang_matrix.cases([devices])}  # each runs there
    start = time.monotonic()
    p = parallel("compare", "--strategies", ",".join(names), "--devices", devices, "--hang-rank", str(rank),
                 "--hang-how", how, *MATRIX, "--out", str(tmp_path))
    elapsed = time.monotonic() - start
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stdout[-2000:]
    failed = {r["strategy"]: r["error"] for r in rows(tmp_path) if r["status"] == "failed"}
    assert failed.keys() == set(names), failed.keys() ^ set(names)
    for name, line in failed.items():
        assert re.search(rf"\b(rank|worker) {rank}\b", line) and "step 1" in line, (name, line)
        assert "different collectives" not in line, (name, line)
    assert elapsed < 10 + 8 * len(names), elapsed  # 3-4 s a row here, quiet; a row that hung would take 60
    if how == "stop":  # each rank's record, the hung one's stacks from its watch thread, the line beside them
        assert {"rank0.json", "rank0.txt", "rank1.txt", "rank1.stack.txt", "diagnosis.txt"} <= {
            f.name for f in (tmp_path / "hang" / "ddp").iterdir()}


@pytest.mark.slow
def test_a_hung_rank_0_of_an_fsdp_pipeline_is_named_within_the_timeout(tmp_path):
    """Rank 0 stopped in the 2-D composition whose groups torch makes (DeviceMesh): before issue 59 they took
    torch's 30-minute default, not --pg-timeout, and its stage's timeout was wrapped as "Failed to run
    stage backward", read as the rank's own crash."""
    start = time.monotonic()
    p = parallel("run", "fsdp_pp", "--workload", "transformer", "--devices", "cpu:4", "--steps", "3",
                 "--hang-rank", "0", "--pg-timeout", "5", "--timeout", "90", "--out", str(tmp_path))
    elapsed = time.monotonic() - start
    (row,) = rows(tmp_path)
    assert p.returncode == 1 and row["status"] == "failed" and "Traceback" not in p.stdout + p.stderr
    assert re.match(r"rank 0 never issued collective #\d+ on group .* \(step 1\): rank 0 is \d+ "
                    r"collectives? behind; it was: step 1: stopped by --hang-rank", row["error"]), row["error"]
    assert elapsed < 60, elapsed  # 13-14 s here, quiet


@pytest.mark.slow
def test_a_rank_error_reaches_the_user_as_one_line_naming_the_rank(tmp_path):
    p = parallel("run", "ddp", *DDP, "--steps", "4", "--fail-at-step", "2", "--fail-rank", "1", "--out", str(tmp_path))
    (row,) = rows(tmp_path)
    assert p.returncode == 1
    assert row["error"] == "rank 1: InjectedFault: injected fault at step 2 on rank 1 (--fail-at-step)"
    assert "ddp failed: rank 1: InjectedFault" in p.stdout


def test_the_first_failure_of_the_last_attempt_is_named_not_the_lowest_rank(tmp_path):
    # torchrun's summary times failures to the second and names the lowest rank on a tie: rank 0, which
    # failed 3 ms after rank 1 because rank 1 had died, was named (seen with forked workers).
    result = tmp_path / "ddp.json"
    for rank, restart, t, error in [(2, 0, 10.0, "InjectedFault: y"), (3, 1, 20.004, "RuntimeError: peer gone"),
                                    (0, 1, 20.007, "RuntimeError: peer gone"), (1, 1, 20.001, "InjectedFault: x")]:
        (tmp_path / f"ddp.failure{rank}.json").write_text(
            json.dumps({"rank": rank, "restart": restart, "time": t, "error": error}))
    assert launch.first_failure(result) == "rank 1: InjectedFault: x"
    assert launch.first_failure(tmp_path / "fsdp.json") is None


def test_sharding_is_even_or_refused(capsys, tmp_path):
    # Policy: every rank gets exactly B/N samples of every step, so ranks never run different numbers of
    # collectives (the uneven-inputs hang); a global batch that does not divide is refused up front.
    code = cli.main(["compare", "--strategies", "ddp", "--devices", "cpu:2", "--batch-size", "33",
                     "--out", str(tmp_path / "o")])
    assert code == 2 and "global batch 33 is not divisible by world size 2" in capsys.readouterr().err


def test_non_finite_loss_is_reported_with_strategy_and_step():
    config = RunConfig(devices="cpu:2", batch_size=32, steps=5, warmup=0, lr=1e4).validate()
    with pytest.raises(NonFiniteLoss, match=r"loss is (nan|inf|-inf) at step \d of single"):
        execute(strategies.get("single"), config, Dist())


def _bad_checkpoints(tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / ".metadata").write_bytes(b"not a checkpoint")
    other = tmp_path / "other"  # a checkpoint of the MLP, offered to the CNN
    model = WORKLOADS["mlp"].build_model(0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=other)
    return corrupt, other


@pytest.mark.parametrize("argv, message", [
    (["--resume-from", "/nonexistent/ckpt"], "checkpoint '/nonexistent/ckpt' does not exist"),
    (["--resume-from", "{corrupt}"], "cannot be read"),
    (["--resume-from", "{other}"], "does not fit the cnn model"),
    (["--strategies", "hogwild", "--checkpoint-every", "2"], "hogwild cannot checkpoint or resume"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be 0 (never) or more, got -1"),
    (["--max-restarts", "-2"], "--max-restarts must be 0 or more, got -2"),
    (["--port", "70000"], "--port must be 0 (any free port) or 1..65535, got 70000"),
    (["--port", "{taken}"], "on 127.0.0.1 is not free: Address already in use"),
    (["--timeout", "-5"], "--timeout must be a positive number of seconds, got -5.0"),
    (["--pg-timeout", "nan"], "--pg-timeout must be a positive number of seconds, got nan"),
])
def test_more_bad_input_is_one_line_exit_2_and_writes_nothing(argv, message, tmp_path, refused):
    import socket

    corrupt, other = _bad_checkpoints(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        subs = {"corrupt": corrupt, "other": other, "taken": taken.getsockname()[1]}
        argv = [a.format(**subs) for a in argv]
        if "--strategies" not in argv:
            argv = ["--strategies", "single", *argv]
        refused(["compare", *argv, "--devices", "cpu:2"], message)


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    # DCP unpickles a checkpoint's .metadata with plain pickle; this program reads it with an unpickler
    # that admits only DCP's metadata classes.
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ConfigError, match="cannot be read: .*posix.system is not allowed"):
        checkpoint.load_into(evil, {"model": WORKLOADS["cnn"].build_model(0).state_dict()})
    assert not marker.exists()


def _descendants(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, grew = {pid}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in found} - found
        found |= new
        grew = bool(new)
    return found


def _listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state held by these processes."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                found.append(parts[1])
    return found


def test_sigterm_stops_a_comparison_like_ctrl_c_and_keeps_the_finished_rows(tmp_path, monkeypatch, capsys,
                                                                            signals_restored):
    # A scheduler's SIGTERM is turned into Ctrl-C's KeyboardInterrupt (cli._interrupt); the end-to-end test
    # below sends SIGINT to a real comparison, so the rest of the way is the same.
    def interrupted_mid_run(config, chosen, baseline, on_row):
        on_row([])  # what a finished row leaves: results.json
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(cli, "run_strategies", interrupted_mid_run)
    code = cli.main(["compare", "--strategies", "single", "--devices", "cpu:1", "--out", str(tmp_path)])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # even where it was ignored
    assert code == 130 and "interrupted" in capsys.readouterr().out and (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_ctrl_c_keeps_finished_rows_and_leaves_no_child_and_every_store_listened_on_loopback(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "parallel", "compare", "--strategies", "single,ddp",
                             "--devices", "cpu:2", "--steps", "3", "--warmup", "0", "--batch-size", "2",
                             "--hang-rank", "1", "--pg-timeout", "120", "--out", str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `nohup` starts it
    # `single` finishes its 3 steps, then ddp starts and waits at step 1 for its rank 1, which stops
    # responding there (--hang-rank; its watchdog waits 120 s): interrupt ddp mid-run, at no CPU's cost.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (tmp_path / "logs" / "ddp.log").exists():
        time.sleep(0.2)
    # Meanwhile: torch's TCPStore listens on every interface and `torchrun --standalone` hosts two of them
    # (pytorch#173909); the harness's launch keeps every listening socket on 127.0.0.1 (launch/child.py).
    start, seen = time.monotonic(), []
    while time.monotonic() < start + 20 and (len(seen) < 3 or time.monotonic() < start + 3):
        time.sleep(0.5)  # the harness's store, rank 0's store, gloo's
        seen = _listening(_descendants(proc.pid))
    assert len(seen) >= 3, seen
    loopback = ("0100007F:", "0000000000000000FFFF00000100007F:")  # 127.0.0.1, as IPv4 and IPv4-mapped IPv6
    assert all(addr.startswith(loopback) for addr in seen), seen
    before = _descendants(proc.pid) - {proc.pid}
    assert before  # ddp's torchrun and workers are running
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=30) != 0
    except subprocess.TimeoutExpired:  # where it is stuck: faulthandler prints every thread's stack on SIGABRT
        proc.send_signal(signal.SIGABRT)
        for pid in before:  # its children are in a session of their own: nobody else ends them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"still running 30 s after Ctrl-C:\n{proc.communicate(timeout=30)[1][-6000:]}")
    assert [r["strategy"] for r in rows(tmp_path)] == ["single"]  # the finished row is kept
    time.sleep(0.5)
    alive = [pid for pid in before if Path(f"/proc/{pid}").exists() and "Z" not in
             Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]
    assert alive == []


def test_resuming_a_finished_run_does_nothing_and_keeps_its_parameters(tmp_path):
    base = {"devices": "cpu:2", "batch_size": 32, "steps": 3, "warmup": 0, "out": str(tmp_path)}
    _, final = execute(strategies.get("single"), RunConfig(**base, checkpoint_every=1).validate(), Dist())
    again = RunConfig(**base, resume=True).validate()
    row, state = execute(strategies.get("single"), again, Dist())
    assert row.losses == [] and row.final_loss is None and row.samples_per_s is None
    assert all(torch.equal(state[k], final[k]) for k in final)


def _watchdog_as_under_nccl(rank, world):
    """The loop's watchdog in a group whose default backend reads as nccl (which has no monitored_barrier):
    rank 1 stops responding, rank 0 must name it."""
    import torch.distributed as td

    from parallel.loop import train
    from parallel.world import dist as dist_module

    real = td.get_backend
    td.get_backend = lambda group=None: "nccl" if group is None else real(group)  # the default group's alone
    config = RunConfig(pg_timeout=3.0)
    made = dist_module.watch_group(3.0)  # as Dist.init does for every rank, right after joining
    if rank == 1:
        time.sleep(60)  # hung: never reaches the barrier (the test ends once rank 0 has raised)
    train._watchdog(config, Dist(rank=rank, world_size=world))
    return made is not td.GroupMember.WORLD


@pytest.mark.slow
def test_a_hung_rank_is_named_under_nccl_too():
    # Before: the watchdog ran on gloo only, so under nccl rank 0 walked on into the step's collectives and
    # the NCCL watchdog aborted it, naming rank 0. Now a gloo group of the same ranks carries the barrier.
    from tests.multirank import RankError, run_ranks

    with pytest.raises(RankError, match="Ranks? 1 failed to pass monitoredBarrier"):
        run_ranks(_watchdog_as_under_nccl, world=2, timeout=20)
