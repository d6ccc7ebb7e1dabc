"""DDP's options' refusals. DDP's script under torchrun, as the README types it (2 gloo processes on loopback,
a rank failing and restarted): tests/test_restart.py. DDP through `compare` (with gradient accumulation, its
bytes, the cost model): tests/test_compare.py, whose one comparison serves many checks. The script run
alone, a world of one: tests/test_gpu_paths.py (in process)."""

import pytest

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--accum", "0"], "--accum must be at least 1, got 0"),
        (["--accum", "3"], "global batch 512 is not divisible by world size 2 x accum 3 = 6"),
        (["--bucket-mb", "-1"], "--bucket-mb must be 0 (torch's default) or more, got -1.0"),
        (["--prescale", "2"], "--prescale must be 0 or 1, got 2"),
        (["--accum", "two"], "invalid comma-separated int value: 'two'"),
    ],
)
def test_bad_ddp_options_are_one_line_exit_2(argv, message, refused):
    refused(["compare", "--strategies", "ddp", "--devices", "cpu:2", *argv], message)
