"""`python -m parallel devices` (#29): the environment block to paste into an issue, read as it is printed."""

import contextlib
import io
import subprocess

import pytest
import torch
from rich.console import Console

from parallel import cli, envinfo
from parallel.world import machine

KEYS = ["parallel", "git commit", "Python", "platform", "torch", "torch CUDA", "NCCL", "transformers", "GPU driver",
        "CUDA_VISIBLE_DEVICES", "CPU", "--devices auto", "default backend", "compare runs", "compare skips"]


def block(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("```")
    return lines[start + 1: lines.index("```", start + 1)]


def test_the_block_comes_first_one_key_a_line(capsys):
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("Copy and paste the block below")
    lines = block(out)
    assert all(ln.startswith("- ") and ": " in ln for ln in lines), lines
    got = dict(ln[2:].split(": ", 1) for ln in lines)
    assert [k for k in KEYS if k not in got] == []
    assert got["parallel"] == __import__("parallel").__version__ and got["torch"] == torch.__version__
    spec = cli.compare_defaults().spec
    assert got["--devices auto"].startswith(f"{spec} ({spec.kind_label})") and got["default backend"] == spec.backend
    assert got["git commit"] == "unknown" or len(got["git commit"].split()[0]) >= 7
    if not torch.cuda.is_available():
        assert got["NCCL"] == "n/a"
    if torch.version.cuda is None and not torch.version.hip:
        assert got["torch CUDA"] == "none (CPU build)"
    assert "memory per device" in out and "what `compare` runs" in out  # what it printed before stays, after


def test_values_are_printed_as_they_are_not_as_markup(monkeypatch):
    gpu = {"index": 0, "name": "[bold]Fake[/bold] GPU", "total_bytes": 80 * 2**30, "free_bytes": 2**30,
           "capability": "9.0"}
    console = Console(file=io.StringIO(), width=100)
    envinfo.show(console, cli.compare_defaults(), gpus=[gpu])
    out = console.file.getvalue()
    assert "- GPU 0: [bold]Fake[/bold] GPU, 80.0 GiB, capability 9.0" in block(out)
    assert "[bold]Fake[/bold] GPU" in out.split("```")[-1]  # the hardware table too


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_git_commit_short_hash_dirty_or_unknown(tmp_path, monkeypatch):
    assert envinfo.git_commit(tmp_path) == "unknown"  # not a checkout
    git(tmp_path, "init", "-q")
    (tmp_path / "f.py").write_text("1\n")
    git(tmp_path, "add", "f.py")
    git(tmp_path, "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("")
    assert envinfo.git_commit(tmp_path) == head  # an untracked file does not make it dirty
    (tmp_path / "f.py").write_text("2\n")
    assert envinfo.git_commit(tmp_path) == f"{head} (dirty)"
    (tmp_path / "sub").mkdir()
    assert envinfo.git_commit(tmp_path / "sub") == "unknown"  # a copy inside another repository: not its commit

    def hangs(*a, **k):
        raise subprocess.TimeoutExpired("git", 5)

    monkeypatch.setattr(subprocess, "run", hangs)
    assert envinfo.git_commit(tmp_path) == "unknown"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("git")))
    assert envinfo.git_commit(tmp_path) == "unknown"


def test_nccl_is_asked_only_where_cuda_works(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: pytest.fail("asked without CUDA"))
    assert envinfo.nccl_version() == "n/a"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    assert envinfo.nccl_version() == "2.28.9"
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (_ for _ in ()).throw(RuntimeError("no NCCL")))
    assert envinfo.nccl_version() == "unknown"


def test_gpu_driver_from_nvml_or_not_available(monkeypatch):
    class NVML:
        nvmlSystemGetDriverVersion = staticmethod(lambda: b"570.86.15")
        nvmlSystemGetCudaDriverVersion = staticmethod(lambda: 12080)

    monkeypatch.setattr(machine, "nvml", lambda: contextlib.nullcontext(NVML))
    assert envinfo.gpu_driver() == "570.86.15 (CUDA 12.8)"
    monkeypatch.setattr(machine, "nvml", lambda: contextlib.nullcontext(None))
    assert envinfo.gpu_driver() == "n/a"
