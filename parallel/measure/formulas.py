"""The formulas the planner and each run's report share: what a ring collective moves and costs, and
what model state a GPU holds under each ZeRO stage. A leaf module (the strategies import it)."""

from __future__ import annotations

SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
         "all_to_all": lambda n: n - 1, "send": lambda n: 1}


def element_bytes(precision: str) -> int:
    """Bytes of a parameter or a gradient element of a run: fp32's 4, 8 under --precision fp64, 2 under
    bf16-master (bf16 autocast keeps parameters and gradients in fp32; what it casts, its callers say)."""
    return {"fp64": 8, "bf16-master": 2}.get(precision, 4)


def ring_seconds(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """The ring model both the planner and the report's "pred." column use: steps x alpha + the bytes each
    rank sends x beta (Thakur et al. 2005; NCCL's bus bandwidth is nbytes x share / time). The report
    fits alpha and beta to this run's gloo all-reduces (report/costmodel.py); the planner takes them
    from the GPU kind."""
    if n <= 1:
        return 0.0
    return STEPS[kind](n) * alpha + SHARE[kind](n) * nbytes * beta


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in one ring collective of an `nbytes` tensor over n ranks."""
    return SHARE[kind](n) * nbytes if n > 1 else 0.0


def model_state(psi: float, zero_stage: int, shards: int, param_bytes: int = 2, grad_bytes: int = 2,
                optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes per GPU of parameters, gradients and optimizer state for psi parameters under ZeRO stage 0-3
    over `shards` ranks (Rajbhandari et al. 2020, section 5; their Psi = 2 + 2 + K=12). Stage 1 shards the
    optimizer, 2 the gradients too, 3 the parameters too."""
    def part(nbytes, from_stage):
        return psi * nbytes / (shards if zero_stage >= from_stage else 1)
    return {"parameters": part(param_bytes, 3), "gradients": part(grad_bytes, 2),
            "optimizer": part(optimizer_bytes, 1)}


def run_state(params: int, zero_stage: int, shards: int, element: int = 4, moments: float = 1,
              master: int = 0) -> float:
    """Model state bytes per rank of an fp32 model (`element` 8: fp64) whose optimiser keeps `moments`
    buffers a parameter (K = moments elements: SGD's momentum 1, AdamW's two moments 2, Muon's 1 on the
    matrices and 2 on the rest, averaged; loop/optim.moments), as this project's sharded strategies train
    it: what their runs measure per rank against
    (tests/test_sharded.py). Under AdamW in fp32: (4 + 4 + 8) Psi, the paper's K = 8 without a master copy.
    `master` bytes a parameter of fp32 master weights (bf16-master: element 2, master 4, the moments fp32):
    under AdamW the paper's own (2 + 2 + 12) Psi."""
    optimizer = master + moments * (4 if master else element)
    return sum(model_state(params, zero_stage, shards, element, element, optimizer).values())


def optimizer_bytes(precision: str, moments: float) -> float:
    """The optimiser's state a parameter, in bytes: `moments` buffers in the weights' dtype, and under
    bf16-master 4 bytes of fp32 master beside fp32 moments (the ZeRO paper's K = 12 under AdamW)."""
    if precision == "bf16-master":
        return 4 + 4 * moments
    return moments * element_bytes(precision)
