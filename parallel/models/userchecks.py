"""What the harness finds in a user's model, by running or reading it, never by guessing: the layers the
pipelines cut at (each run one after another on a sample must give the model's own output), its routed
experts, its tied weights, and what makes no strategy able to match one device (dropout, BatchNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.models import hf, outputs
from parallel.models.moe import MoE
from parallel.models.workloads import logits_of
from parallel.world.errors import first_line as _first_line


def in_order(model: nn.Module, given, sample: torch.Tensor, targets) -> tuple[tuple[str, ...] | None, str, bool]:
    """(the names of the layers the pipelines cut at, "", from_hf) or (None, why not, False): the factory's
    'layers', the model's pipeline_layers(), a Hugging Face decoder's (parallel.models.hf), or its children; each
    run one after another on a sample must give the model's own output (an nn.Sequential's always do)."""
    names = {id(m): n for n, m in model.named_modules()}
    from_hf = False
    if given is not None:
        if not given or not all(isinstance(m, nn.Module) and id(m) in names for m in given):
            return None, "its 'layers' must be modules of the model", False
        layers, what = list(given), "its 'layers'"
    elif hasattr(model, "pipeline_layers"):
        layers, what = model.pipeline_layers(), "its pipeline_layers()"
    elif hf.is_decoder(model) and sample.dim() == 2 and not sample.is_floating_point():
        try:
            layers, why = hf.decoder_layers(model, sample.shape[1])
        except Exception as e:  # noqa: BLE001 - transformers' internals, a shape the recording did not expect
            layers, why = [], _first_line(e)
        if not layers:
            return None, f"its blocks cannot be cut apart: {why}; return 'layers' from the factory", False
        what, from_hf = "its embeddings, blocks, final norm and head", True
    else:
        found = []
        for name, child in model.named_children():
            found += [f"{name}.{n}" for n, _ in child.named_children()] if isinstance(child, nn.ModuleList) else [name]
        if len(found) < 2:
            return None, "it has fewer than two children to cut between; return 'layers' from the factory", False
        if isinstance(model, nn.Sequential):
            return tuple(found), "", False
        layers, what = [model.get_submodule(n) for n in found], "its children"
    if why := _differs(model, layers, sample, targets, what):
        return None, why, False
    return tuple(_layer_name(m, names) for m in layers), "", from_hf


def _layer_name(layer: nn.Module, names: dict[int, str]) -> str:
    return names.get(id(layer)) or "+".join(getattr(layer, "owners", {}).values()) or type(layer).__name__


def _differs(model: nn.Module, layers: list[nn.Module], sample: torch.Tensor, targets, what: str) -> str:
    """Why `layers` run one after another are not `model` on `sample` ("" when they are); a model that takes
    its `targets` is given them (outputs.call), so that its logits are every position's. The same operations
    in the same order give the same numbers; 1e-5 of the output's scale allows for a kernel that takes
    another path on a differently shaped call."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            h = sample
            for layer in layers:
                h = layer(h)
            want = logits_of(outputs.call(model, sample, targets))
    except Exception as e:  # noqa: BLE001 - a layer that does not take the previous one's output
        return (f"its forward() is not {what} run one after another: they fail on a sample ({_first_line(e)}); "
                "return 'layers' from the factory")
    finally:
        model.train()
    if not isinstance(h, torch.Tensor) or not isinstance(want, torch.Tensor) or h.shape != want.shape:
        return (f"its forward() is not {what} run one after another: they give {tuple(getattr(h, 'shape', ()))}, "
                f"it {tuple(getattr(want, 'shape', ()))} (checked on a sample)")
    gap = float((h.float() - want.float()).abs().max()) if h.numel() else 0.0
    if gap > 1e-5 * max(1.0, float(want.float().abs().max())):
        return (f"its forward() is not {what} run one after another (checked on a sample: they differ by up to "
                f"{gap:.3g}): a module left out or out of order? give every module forward runs, in order")
    return ""


def moe_layers_of(model: nn.Module) -> list[MoE]:
    """The model's routed layers: its moe_layers(), else every parallel.models.moe.MoE it holds, in order."""
    return list(model.moe_layers()) if hasattr(type(model), "moe_layers") else \
        [m for m in model.modules() if isinstance(m, MoE)]


def experts_of(model: nn.Module) -> tuple[bool, str]:
    """(expert parallelism can split it, why not): its routed layers must be parallel.models.moe.MoE (whose
    `dispatch` expert_parallel replaces) with one expert count; any other experts are named as found."""
    layers = moe_layers_of(model)
    if layers and all(isinstance(m, MoE) for m in layers):
        if len({m.num_experts for m in layers}) > 1:
            return False, "its MoE layers have different expert counts"
        return True, ""
    found = routed_experts(model)
    if not found and hasattr(type(model), "moe_layers"):
        found = [f"its moe_layers(): {', '.join(sorted({type(m).__name__ for m in layers}))}"]
    if found:
        return False, (f"its experts ({'; '.join(found[:3])}) are not parallel.models.moe.MoE layers, whose "
                       "dispatch expert_parallel replaces (docs/experts.md)")
    return False, "it has no parallel.models.moe.MoE layers (docs/experts.md)"


def routed_experts(model: nn.Module) -> list[str]:
    """The model's blocks of routed experts, found by structure, never by name: a module holding E >= 2 experts
    (a ModuleList of E alike modules, or weights with a leading dimension E: transformers' fused experts,
    (E, out, in)) beside a router (a Linear or a weight with E outputs), as "model.layers.0.mlp and 1 more:
    MixtralSparseMoeBlock, 8 experts with a router", alike blocks together."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name, block in model.named_modules():
        for holder, count in _expert_holders(block):
            if _routes(block, holder, count):
                groups.setdefault((type(block).__name__, count), []).append(name or "the model")
                break
    return [f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: {cls}, {count} experts "
            "with a router" for (cls, count), names in groups.items()]


def _expert_holders(block: nn.Module) -> list[tuple[nn.Module, int]]:
    """(module, expert count) for each of block and its children that holds experts."""
    found = []
    for m in (block, *block.children()):
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({_shapes(e) for e in m}) == 1 \
                and _shapes(m[0])[1]:
            found.append((m, len(m)))
        elif not isinstance(m, nn.modules.conv._ConvNd):  # a convolution's weight is (out, in, kernel)
            leading = {p.shape[0] for p in m.parameters(recurse=False) if p.dim() >= 3}
            if len(leading) == 1 and (count := leading.pop()) >= 2:
                found.append((m, count))
    return found


def _shapes(m: nn.Module) -> tuple:
    return type(m), tuple(tuple(p.shape) for p in m.parameters())


def _routes(block: nn.Module, holder: nn.Module, count: int) -> bool:
    """`block` holds, beside `holder`, a router to `count` experts: a Linear with `count` outputs, or a weight
    (count, C) (Mixtral's TopKRouter), of its own or within a child that holds no experts (JetMoE's
    router.layer; not another routed block's)."""
    others = [c for c in block.children() if c is not holder and not _has_experts(c)]
    for m in ([] if holder is block else [block]) + [m for c in others for m in c.modules()]:
        if isinstance(m, nn.Linear):
            if m.out_features == count:
                return True
        elif any(p.dim() == 2 and p.shape[0] == count for p in m.parameters(recurse=False)):
            return True
    return False


def _has_experts(m: nn.Module) -> bool:
    return any(p.dim() >= 3 for p in m.parameters()) or any(isinstance(c, nn.ModuleList) for c in m.modules())


def tied_names(model: nn.Module) -> str:
    """The model's tied weights as "lm_head.weight = transformer.wte.weight" ("" for none)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return ", ".join(" = ".join(reversed(group)) for group in names.values() if len(group) > 1)


def cannot_match(model: nn.Module) -> dict[str, str]:
    """What in the model makes a strategy's training differ from one device's even when the strategy is
    right, by cause: "dropout" (modules with p > 0, or a Hugging Face config's dropout rates, which its
    attention applies functionally): every run draws other random masks; "batchnorm": each device
    normalises its share of the batch by its own statistics (ddp synchronises them). Found before the
    run, said at its start and named in the verdict of a row that mismatches."""
    out = {}
    drops = [m.p for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    # transformers' attention applies its dropout functionally (no module to find): Llama, Qwen2, Mixtral ...
    # (and OPT's layers theirs: `dropout`): every rate its config names that is on
    config = getattr(getattr(model, "config", None), "to_dict", lambda: {})()
    rates = {k: v for k, v in config.items() if ("dropout" in k or "pdrop" in k) and k != "summary_first_dropout"
             and isinstance(v, float) and v > 0}
    if drops or rates:
        where = ", ".join(([f"{len(drops)} dropout module(s), p up to {max(drops):g}"] if drops else [])
                          + [f"config {k} = {v:g}" for k, v in sorted(rates.items())][:2])
        out["dropout"] = (f"dropout is on ({where}): every run draws other random masks, so no strategy can "
                          "match one device; set dropout to 0 to compare")
    if norms := [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
        out["batchnorm"] = (f"BatchNorm ({len(norms)} layer(s)) normalises each device's share of the batch by its "
                            "own statistics; ddp synchronises them (SyncBatchNorm), the other strategies do not")
    return out
