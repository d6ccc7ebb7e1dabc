"""`python -m parallel devices`: the environment as a block to paste into an issue (the way `accelerate env`
prints one), then the hardware, and what `compare` would run here with its defaults and what it would skip.

    ```
    - parallel: 0.1.0
    - git commit: 5486dc7 (dirty)
    - Python: 3.11.9
    - platform: Linux-6.8.0-x86_64-with-glibc2.39
    - torch: 2.13.0+cpu
    - torch CUDA: none (CPU build)
    ...
    ```

What `compare` would run is not worked out here: the config is built by `compare`'s own parser from no
arguments (cliargs.config_from_args), and `compare.select_runs` chooses on it, the one selection every command uses, so
the two commands cannot disagree about a strategy.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

import parallel
from parallel.compare import select_runs
from parallel.config import RunConfig
from parallel.report import notes
from parallel.world import machine

PLAIN = {"markup": False, "highlight": False, "soft_wrap": True}  # values as they are: no [..] taken as markup,
#                                                                   no colours, no folding at the console width


def git_commit(root: Path | None = None, timeout: float = 5.0) -> str:
    """The short hash of the checkout this package runs from, "(dirty)" after it when a tracked file is
    modified; "unknown" outside a git checkout (an installed copy), without git, or when git does not answer."""
    package = Path(parallel.__file__).resolve().parent
    root = root or package.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=timeout,
                              check=True).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if top != root.resolve():  # an installed copy inside some other repository: not this package's commit
            return "unknown"
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit} (dirty)" if dirty else commit


def nccl_version() -> str:
    """NCCL as torch carries it; asked only where CUDA works (on a CPU build there is none to ask)."""
    if not torch.cuda.is_available():
        return "n/a"
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL (ROCm's RCCL, Windows): say so, not a traceback
        return "unknown"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def gpu_driver() -> str:
    """The NVIDIA driver's version and the CUDA it supports, from NVML; "n/a" where NVML does not load."""
    with machine.nvml() as nvml:
        if nvml is None:
            return "n/a"
        try:
            version = nvml.nvmlSystemGetDriverVersion()
            cuda = nvml.nvmlSystemGetCudaDriverVersion()
        except Exception:  # noqa: BLE001 - NVML loads but does not answer
            return "unknown"
    version = version.decode() if isinstance(version, bytes) else version
    return f"{version} (CUDA {cuda // 1000}.{cuda % 1000 // 10})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _installed(package: str) -> str:
    """Its version, found without importing it (transformers takes seconds), or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def env_lines(config: RunConfig, chosen: list[tuple], skipped: dict[str, str], gpus: list[dict], cpu: dict,
              unusable: str | None) -> list[str]:
    """The `- key: value` lines of the block (`cpu`: machine.cpu_info(); `unusable`: machine.unusable_gpus())."""
    spec = config.spec
    lines = [
        ("parallel", parallel.__version__),
        ("git commit", git_commit()),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("torch CUDA", torch.version.cuda or (f"none (ROCm {torch.version.hip})" if torch.version.hip
                                             else "none (CPU build)")),
        ("NCCL", nccl_version()),
        ("transformers", _installed("transformers")),  # a Hugging Face --model is built by it (docs/your-model.md)
        ("GPU driver", gpu_driver()),
    ]
    if gpus:
        lines += [(f"GPU {g['index']}", f"{g['name']}, {_gib(g['total_bytes'])}, capability {g['capability']}")
                  for g in gpus]
    else:
        lines.append(("GPUs", f"none usable ({unusable})" if unusable else "none"))
    lines += [
        ("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")),
        ("CPU", f"{cpu['model']}, {cpu['cores']} cores"),
        ("--devices auto", f"{spec} ({spec.kind_label}), {spec.threads_per_device()} thread(s) per device"),
        ("default backend", spec.backend),
        ("compare with no options", f"{config.workload} workload, global batch {config.batch_size}, {config.steps} "
                                    f"steps after {config.warmup} warm-up"),
        ("compare runs", ", ".join(dict.fromkeys(s.name for s, _, _ in chosen))),
        ("compare skips", ", ".join(skipped) or "nothing"),
    ]
    return [f"- {key}: {value}" for key, value in lines]


def show(console: Console, config: RunConfig, gpus: list[dict] | None = None) -> None:
    """Everything `devices` prints before basics' memory demo: the block to paste, the hardware, and what
    `compare` would run on `config` (the same planning) and skip (in `compare`'s words).
    `gpus`: machine.cuda_info(), read once by the caller (it may start a child process)."""
    gpus = machine.cuda_info() if gpus is None else gpus
    chosen, skipped = select_runs(config, ["all"])  # the one selection `compare` uses, on compare's own config
    cpu, unusable = machine.cpu_info(), machine.unusable_gpus()
    console.print("Copy and paste the block below into your GitHub issue:", **PLAIN)
    console.print("```", **PLAIN)
    for line in env_lines(config, chosen, skipped, gpus, cpu, unusable):
        console.print(line, **PLAIN)
    console.print("```", **PLAIN)

    t = Table(title="devices", title_justify="left")
    for c in ("device", "name", "memory total / free", "capability", "threads"):
        t.add_column(c)
    t.add_row("cpu", Text(cpu["model"]), "-", "-", f"{cpu['cores']} cores")
    for g in gpus:
        t.add_row(f"cuda:{g['index']}", Text(g["name"]), f"{_gib(g['total_bytes'])} / {_gib(g['free_bytes'])}",
                  g["capability"], "-")
    console.print(t)
    console.print("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in machine.backends().items()),
                  **PLAIN)
    spec = config.spec
    console.print(f"--devices auto = {spec} ({spec.kind_label}, {spec.backend}), "
                  f"{spec.threads_per_device()} thread(s) per device", **PLAIN)
    if unusable:
        console.print(f"GPUs not used: {unusable}", style="yellow", **PLAIN)

    s = Table(title=f"what `compare` runs with --devices auto ({config.batch_size} samples a step)",
              title_justify="left")
    for c in ("strategy", "launcher", "devices", "kind", "about"):
        s.add_column(c, overflow="fold")
    for st, label, cfg in chosen:
        s.add_row(" ".join(filter(None, [st.name, label])), st.launch, str(st.world_size(cfg)), st.kind(cfg),
                  st.description)
    console.print(s)
    for line in notes.skipped_in_full(skipped):  # as `compare` prints them in full
        console.print(f"- {line}", style="dim", **PLAIN)
