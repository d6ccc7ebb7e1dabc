"""How the harness calls a model and reads what it returns: the logits, and a loss the model computes itself.

    forward(x)                  -> logits                        most models
    forward(idx, targets=None)  -> (logits, loss)                nanoGPT, and many GPTs written from scratch
    forward(x, labels=None)     -> {"logits", "loss"}, or a ModelOutput with .logits and .loss

A model of the last two kinds, called without its targets, gives what generation needs: often the last
position's logits only, (B, 1, V). So wherever the whole model runs, the harness calls it with the batch's
targets (`call`): its logits are then every position's, and the loss it returns is what is trained
(userload.UserWorkload.loss), in every process alike. A strategy that holds only logits takes
cross-entropy over them: the pipelines the last stage's, manual_dp and data_parallel the gathered ones.
That is the same loss only where the model's own is cross-entropy over its logits, which `check` tries
on a sample before the run; where it is another (label smoothing, an extra term), those strategies are
skipped, saying why (`LOGITS_LOSS`, and `LAYERED` for the pipelines).

The model's loss must be the mean over its batch, as cross-entropy's is: data-parallel strategies average
the ranks' losses, each over its share.

transformers' models take `labels` too, but shift them inside (their labels are the input ids), while the
harness's targets are already the next tokens: passing them would train each position on the token after
next. Their logits are every position's without labels, so they are called without (`takes_targets`).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from parallel.models.data import IGNORE
from parallel.world.errors import ConfigError, theirs_line

TARGETS = ("targets", "labels")  # the names a forward takes its targets by, the first found wins
KEYWORD = "_parallel_targets"  # on a model instance (usermodel sets it): the name its forward takes them by
SUM, COUNT = "loss_sum", "tokens"  # a loss returned as its sum over the real targets and their count, which
#   the harness can weigh where tokens are uneven (loop/tokens.py; docs/loss.md)


def logits_of(output):
    """A model's output as the one tensor the harness works with: a tensor as it is; a Hugging Face
    ModelOutput's (or any mapping's) `logits`; a tuple's first element that is not a scalar (so
    `(logits, loss)` and `(loss, logits)` alike). The one place where an output's type is read."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "keys") and "logits" in output.keys():  # ModelOutput is an OrderedDict
        return output["logits"]
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor) and o.dim() > 0), output[0] if output else output)
    return output


def loss_in(output):
    """The loss a model returned beside its logits, or None: a mapping's or ModelOutput's `loss`; of a
    pair, the element that is not the logits (nanoGPT's `(logits, loss)`); of a longer tuple, its first
    scalar."""
    if isinstance(output, torch.Tensor):
        return None
    if hasattr(output, "keys"):  # a ModelOutput's keys leave out fields that are None
        if "loss" not in output.keys() and (pair := sum_in(output)) is not None:
            return pair[0] / pair[1]  # the mean a (sum, count) stands for
        return output["loss"] if "loss" in output.keys() else None
    if isinstance(output, (tuple, list)):
        logits = logits_of(output)
        if len(output) == 2:
            return output[1] if output[0] is logits else output[0]
        return next((o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0), None)
    return None


def sum_in(output):
    """(sum, count) where a model returned its loss as `loss_sum` over `tokens` real targets (a mapping or
    a ModelOutput), else None."""
    if hasattr(output, "keys") and SUM in output.keys() and COUNT in output.keys():
        return output[SUM], output[COUNT]
    return None


def takes_targets(model: nn.Module) -> str:
    """The name ('targets' or 'labels') model.forward takes its targets by, or "": none, or a transformers
    model (its labels are shifted inside; see the module's docstring)."""
    if any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        return ""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or C extension: no signature to read
        return ""
    return next((n for n in TARGETS if n in params and params[n].kind != params[n].POSITIONAL_ONLY), "")


def call(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """model(x), or model(x, targets=y) for a model that takes its targets (the name recorded on it, or on
    the module a wrapper holds as `.module`: DDP, nn.DataParallel). -> what forward returns."""
    keyword = keyword_of(model)
    x, y = contiguous(x), contiguous(y)  # as a DataLoader hands them: a forward's .view on them must work
    return model(x, **{keyword: y}) if keyword else model(x)


def contiguous(t):
    """A tensor as a user's code expects one (contiguous: `.view` works); anything else as it is."""
    return t.contiguous() if isinstance(t, torch.Tensor) else t


def keyword_of(model: nn.Module) -> str:
    """The name `call` gives a model its targets by ("" for none)."""
    while model is not None:
        if keyword := model.__dict__.get(KEYWORD):
            return keyword
        model = model.__dict__.get("_modules", {}).get("module")
    return ""


def check(spec: str, model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor, source: str) -> tuple[str, str, bool]:
    """One forward and the loss on a sample, before any strategy starts. `loss`: the factory's, or None.
    -> (the name forward takes its targets by, "" where it computes no loss of its own; why that loss is
    not cross-entropy over its logits, "" where it is; whether it returns its loss as a sum and a count).
    Every problem is a ConfigError, one line."""
    keyword = takes_targets(model)
    try:
        out = _forward(spec, model, x, {keyword: y} if keyword else {}, source)
    except ConfigError as e:  # its own loss, handed padding's targets: say which convention it needs
        if not keyword or y.is_floating_point() or not bool((y == IGNORE).any()):
            raise
        raise ConfigError(f"{e}; its own loss is handed targets of {IGNORE} (padding's, cross-entropy's default "
                          f"ignore_index): leave them out with ignore_index={IGNORE}, or return the logits alone") \
            from None
    own = loss_in(out) if keyword else None
    if keyword and own is None:  # it takes targets but returns no loss with them: a model like any other
        keyword, out = "", _forward(spec, model, x, {}, source)
    if own is not None and loss is not None:
        raise ConfigError(f"--model {spec}: its forward() takes {keyword!r} and returns its own loss, and the "
                          "factory returned 'loss' too: keep one of them")
    if loss is not None:
        _check_loss(spec, lambda: loss(out, y), f"its loss on a sample of {source}")
        return "", "", False
    if own is None:
        _check_logits(spec, logits_of(out), y, source)
        return "", "", False
    what = f"the loss its forward(..., {keyword}=...) returned"
    _check_loss(spec, lambda: own, what)
    if not own.requires_grad:
        raise ConfigError(f"--model {spec}: {what} does not depend on its parameters (detached, or computed "
                          "under no_grad?): there is nothing to train")
    return keyword, _not_cross_entropy(logits_of(out), y, float(own.detach())), sum_in(out) is not None


def _check_logits(spec: str, logits, y: torch.Tensor, source: str) -> None:
    """The harness's cross-entropy can take `logits` against `y`: (..., classes) against (...) indices."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise ConfigError(f"--model {spec}: its output {getattr(logits, 'shape', type(logits).__name__)} is not "
                          "(batch, ..., classes) logits for cross-entropy; return 'loss' from the factory")
    if y.is_floating_point():
        raise ConfigError(f"--model {spec}: {source} has float targets; cross-entropy needs class indices "
                          "(return 'loss' from the factory for anything else)")
    if logits.shape[:-1] != y.shape:
        hint = "" if logits.dim() < 3 else ("; a forward that gives the last position's logits alone must take "
                                            "the targets, as 'targets' or 'labels'")
        raise ConfigError(f"--model {spec}: its output {tuple(logits.shape)} does not fit targets {tuple(y.shape)} "
                          f"of {source} (cross-entropy wants (..., classes) against (...)){hint}")
    if not _in_range(y, logits.shape[-1]):
        real = y[y != IGNORE]
        raise ConfigError(f"--model {spec}: {source} has targets from {int(real.min())} to {int(real.max())}, out "
                          f"of range for its {logits.shape[-1]} classes ({IGNORE}, cross-entropy's ignore_index, "
                          "marks a target that does not count)")


def _in_range(y: torch.Tensor, classes: int) -> bool:
    """Every target a class index, or IGNORE (one that does not count: padding's, Hugging Face's -100)."""
    real = y[y != IGNORE]
    return not real.numel() or (int(real.min()) >= 0 and int(real.max()) < classes)


def _not_cross_entropy(logits, y: torch.Tensor, own: float) -> str:
    """Why a model's own loss (`own` on the sample) is not cross-entropy over its logits ("" where it is,
    to 1e-5: the same function up to fp32 rounding). Its targets need not be class indices at all."""
    fits = isinstance(logits, torch.Tensor) and logits.dim() >= 2 and logits.shape[:-1] == y.shape
    if not fits or y.is_floating_point() or not _in_range(y, logits.shape[-1]):
        shape = tuple(getattr(logits, "shape", ()))
        return (f"its own loss is not cross-entropy over its logits: its output {shape} and targets {tuple(y.shape)} "
                "are not logits and class indices")
    ce = float(F.cross_entropy(logits.detach().flatten(0, -2).double(), y.flatten(), ignore_index=IGNORE))
    if abs(own - ce) <= 1e-5 * max(1.0, abs(ce)):
        return ""
    return f"its own loss is not cross-entropy over its logits ({own:.4g} against {ce:.4g} on a sample)"


def _forward(spec: str, model: nn.Module, x: torch.Tensor, targets: dict, source: str):
    """model(x, **targets) on the sample, under the caller's random state; with autograd where there are
    targets (its loss must reach the parameters)."""
    try:
        with torch.set_grad_enabled(bool(targets)), torch.random.fork_rng(devices=[]):
            return model(contiguous(x), **{k: contiguous(v) for k, v in targets.items()})
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"--model {spec} cannot take {source} (inputs {tuple(x.shape[1:])} a sample): "
                          f"{theirs_line(e, model_files(model))}") from None


def model_files(model: nn.Module) -> set[str]:
    """The source files of the classes a model is made of: its own code, wherever it lives (transformers')."""
    files = set()
    for cls in {type(m) for m in model.modules()}:
        if cls.__module__.split(".")[0] in ("torch", "parallel"):  # torch's layers and ours are not the user's
            continue
        try:
            files.add(inspect.getsourcefile(cls) or "")
        except TypeError:  # a class defined in C
            pass
    return files


def _check_loss(spec: str, compute, what: str) -> None:
    try:
        value = compute()
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"--model {spec}: {what} raised {theirs_line(e)}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"--model {spec}: {what} must be one number (a tensor: the mean over the batch), got {got}")
    if not bool(torch.isfinite(value.detach())):
        raise ConfigError(f"--model {spec}: {what} is {float(value.detach())}, not a finite number")

