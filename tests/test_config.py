"""Validation needs no process group: every bad value is refused with a message naming it."""

import json

import pytest
import torch

from parallel.config import ConfigError, RunConfig
from parallel.world.devices import synchronizer
from parallel.world.devicespec import DeviceSpec, parse_devices
from parallel.world.dist import Dist, backend_for


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"workload": "resnet"}, "unknown workload 'resnet'; choose from mlp, cnn"),
        ({"batch_size": 0}, "--batch-size must be at least 1, got 0"),
        ({"steps": -3}, "--steps must be at least 1, got -3"),
        ({"warmup": -1}, "--warmup must be 0 or more, got -1"),
        ({"lr": float("nan")}, "--lr must be a positive finite number, got nan"),
        ({"lr": -0.1}, "--lr must be a positive finite number, got -0.1"),
        ({"seed": -1}, "--seed must be 0 or more"),
        ({"timeout": 0}, "--timeout must be a positive number of seconds, got 0"),
        ({"devices": "cpu:2", "world_size": 3}, "--world-size 3 is more than the 2 device(s) of cpu:2"),
        ({"devices": "cpu:two"}, "cpu takes a count"),
        ({"devices": "cpu:0"}, "must be 1..64, got 0"),
        ({"devices": "tpu:0"}, "expected auto, cpu:N, cuda:0,1,... or cuda:IxK"),
        ({"devices": "cuda:"}, "expected cuda:0, cuda:0,1,... or cuda:0x2"),
    ],
)
def test_bad_values_are_refused_with_the_number(kw, message):
    with pytest.raises(ConfigError) as err:
        RunConfig(**kw).validate()
    assert message in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="CUDA is not available"):
        parse_devices("cuda:0")


def test_validate_resolves_devices_and_world_size():
    c = RunConfig(devices="cpu:3").validate()
    assert (c.devices, c.world_size) == ("cpu:3", 3)
    assert RunConfig(devices="cpu:3", world_size=2).validate().world_size == 2



@pytest.mark.parametrize("gpus, devices, world", [(0, "cpu:2", 2), (1, "cuda:0x2", 2), (4, "cuda:0,1,2,3", 4)])
def test_auto_is_every_gpu_here_one_shared_by_two_or_two_cpu_devices(monkeypatch, gpus, devices, world):
    from parallel.world import devices as dev
    from tests.strict_cuda import StrictCuda

    monkeypatch.setattr(dev, "CUDA", StrictCuda(count=gpus))  # what the package sees, whatever this machine has
    auto = RunConfig().validate()
    assert (auto.devices, auto.world_size) == (devices, world)


def test_config_round_trips_through_json():
    c = RunConfig(workload="mlp", steps=7, lr=0.5).validate()
    assert RunConfig.from_json(c.to_json()) == c


def test_the_device_list_is_parsed_once_and_kept_as_text(monkeypatch):
    from parallel import config as config_module

    parsed = []
    monkeypatch.setattr(config_module, "parse_devices", lambda text: parsed.append(text) or parse_devices(text))
    c = RunConfig(devices="cpu:3").validate()
    assert (c.spec, c.spec.count, parsed) == (DeviceSpec("cpu", (0, 1, 2)), 3, ["cpu:3"])  # validate's parse, kept
    assert "spec" not in json.loads(c.to_json())  # the text travels; the parse is this process's
    c.devices = "cpu:2"  # another list: the old parse no longer holds
    assert c.spec.count == 2 and parsed == ["cpu:3", "cpu:2"]


def test_divisibility_message_names_both_numbers(small):
    with pytest.raises(ConfigError, match="global batch 250 is not divisible by world size 4"):
        small(batch_size=250).check_divisible(4, "world size")


def test_virtual_devices_split_the_cores(monkeypatch):
    monkeypatch.setattr("parallel.world.devices.cpu_cores", lambda: 8)
    assert DeviceSpec("cpu", (0, 1)).threads_per_device() == 4
    assert DeviceSpec("cpu", (0, 1, 2)).threads_per_device() == 2
    assert DeviceSpec("cpu", tuple(range(16))).threads_per_device() == 1  # oversubscribed, never 0


def test_backend_follows_the_device_in_one_place():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"


def test_dist_from_torchrun_env():
    spec = DeviceSpec("cuda", (0, 1))
    d = Dist.from_env(spec, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (d.rank, d.world_size, d.local_rank, d.is_main) == (3, 4, 1, False)
    assert d.device == torch.device("cuda", 1) and d.backend == "nccl"
    solo = Dist.from_env(parse_devices("cpu:2"), {})
    assert (solo.rank, solo.world_size, solo.is_main, solo.backend) == (0, 1, True, "gloo")
    with pytest.raises(ConfigError, match="3 processes on this node but only 2 device"):
        Dist.from_env(spec, {"LOCAL_WORLD_SIZE": "3"})


def test_cuda_synchronizer_calls_cuda_synchronize(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    synchronizer(torch.device("cuda", 1))()
    synchronizer(torch.device("cpu"))()
    assert calls == [torch.device("cuda", 1)]
