"""The kernel benchmark's nvidia-smi readings (benchmarks/bench_kernels.py: gpu_state, the driver version): what
they ask for and how they read the answer, with nvidia-smi and the device properties stood in for."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_kernels as bk  # noqa: E402


@pytest.fixture
def smi(monkeypatch):
    """nvidia-smi answering `reply["stdout"]` (or failing when it is None); the commands it was given."""
    reply, commands = {"stdout": ""}, []
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)

    def run(command, **kwargs):
        commands.append(command)
        if reply["stdout"] is None:
            raise subprocess.CalledProcessError(9, command)
        return subprocess.CompletedProcess(command, 0, stdout=reply["stdout"])

    monkeypatch.setattr(subprocess, "run", run)
    return reply, commands


def test_gpu_state_reads_this_gpus_clock_temperature_and_power(smi):
    reply, commands = smi
    reply["stdout"] = "1980, 54, 317.42\n"
    assert bk.gpu_state() == {"sm_mhz": 1980.0, "temp_c": 54.0, "power_w": 317.42}
    assert "--id=00000000:1B:00.0" in commands[-1]  # by PCI address, whatever CUDA_VISIBLE_DEVICES says
    assert "--query-gpu=clocks.sm,temperature.gpu,power.draw" in commands[-1]


def test_gpu_state_is_empty_where_nvidia_smi_cannot_say(smi):
    reply, _ = smi
    reply["stdout"] = "1980, [N/A], 317.42\n"
    assert bk.gpu_state() == {}
    reply["stdout"] = None
    assert bk.gpu_state() == {}
    reply["stdout"] = "1980, 54\n"  # fewer values than asked for
    assert bk.gpu_state() == {}


def test_driver_version(smi):
    reply, _ = smi
    reply["stdout"] = "580.159.04\n"
    assert bk._driver_version() == "580.159.04"
    reply["stdout"] = None
    assert bk._driver_version() == "unknown"
