"""One transformer layer's activations (parallel/measure/activations.py): the adapted Korthikanti et al. formula
against what autograd keeps, each storage once, for both attention kernels, both recomputations and a
real `single` run. (Tensor, sequence and context parallelism: test_tensor_parallel.py and
test_context_parallel.py check their rows against the same formula.)"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from parallel import strategies
from parallel.basics.cli import layer_recompute
from parallel.config import RunConfig
from parallel.measure import activations
from parallel.models.transformer import Block
from parallel.worker import execute
from parallel.world.dist import Dist


def measured(b: int, s: int, h: int, a: int, backend=None, recompute: str = "none") -> dict:
    torch.manual_seed(0)
    block = Block(h, a)
    meter = activations.LayerMeter(block)
    block(torch.randn(b, s, h))  # the input the meter keeps, as in training
    with sdpa_kernel([backend]) if backend else torch.enable_grad():
        return meter.details(s, "fp32", recompute)


@pytest.mark.parametrize("b, s, h, a", [(4, 64, 128, 4), (2, 128, 256, 8), (8, 32, 64, 2)])
@pytest.mark.parametrize("backend, kernel", [(SDPBackend.MATH, "math"), (SDPBackend.FLASH_ATTENTION, "fused")])
def test_the_formula_is_the_bytes_autograd_keeps_to_the_byte(b, s, h, a, backend, kernel):
    d = measured(b, s, h, a, backend)
    assert d["layer_activation_layout"]["kernel"] == kernel
    assert d["layer_activation_bytes"] == d["layer_activation_predicted"]
    terms = d["layer_activation_terms"]
    assert terms["whole"] + terms["split"] == 64 * s * b * h  # sbh(64 + ...) bytes in fp32
    assert terms["core"] == (4 * a * s * s * b if kernel == "math" else 4 * a * s * b)  # softmax, or log-sum-exp


def test_recomputation_keeps_what_the_paper_says():
    b, s, h, a = 4, 64, 128, 4
    none, selective, full = (measured(b, s, h, a, SDPBackend.MATH, r) for r in ("none", "selective", "full"))
    assert selective["layer_activation_bytes"] == none["layer_activation_bytes"] - 4 * a * s * s * b  # no s^2 term
    assert full["layer_activation_bytes"] == 4 * s * b * h  # the layer's input alone
    for d in (selective, full):
        assert d["layer_activation_bytes"] == d["layer_activation_predicted"]


def test_bench_memorys_recomputation_table_is_measured_beside_the_formula():
    layer = layer_recompute("transformer", torch.device("cpu"), 8)
    assert list(layer) == ["none", "selective", "full"]
    assert all(d["layer_activation_bytes"] == d["layer_activation_predicted"] for d in layer.values())
    assert layer_recompute("mlp", torch.device("cpu"), 8) == {}  # no transformer block: nothing to show


def test_a_single_run_reports_its_layer_and_the_moe_block_is_left_out():
    config = RunConfig(workload="transformer", devices="cpu:1", batch_size=8, steps=1, warmup=1).validate()
    d = execute(strategies.get("single"), config, Dist())[0].details
    assert d["layer_activation_bytes"] == d["layer_activation_predicted"] > 0
    assert d["layer_activation_layout"] | {"kernel": "-"} == {"s": 32, "b": 8, "h": 128, "a": 4, "t": 1, "sp": False,
                                                               "cp": 1, "kernel": "-", "recompute": "none"}
    from parallel.models.workloads import WORKLOADS

    assert activations.block_of(WORKLOADS["moe"].build_model(0)) is None  # its MLP is routed: not the formula's
