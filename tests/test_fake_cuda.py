"""The fake CUDA device other tests use refuses what CUDA refuses, so their checks are real."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCuda, OnCuda, on_fake_cuda
from torch import nn


def test_mixing_devices_raises_and_moves_copy() -> None:
    with FakeCuda():
        gpu = torch.arange(4.0, device="cuda")
        assert gpu.device == torch.device("cuda", 0) and (gpu * 2).device.type == "cuda"
        with pytest.raises(RuntimeError, match="same device"):
            gpu + torch.ones(4)
        with pytest.raises(RuntimeError, match="same device"):
            gpu[torch.tensor([1, 2], device="cuda")] = torch.zeros(2)
        with pytest.raises(TypeError, match="numpy"):
            gpu.numpy()
        gpu[0] = torch.tensor(7.0)  # a 0-dim CPU tensor mixes, as on CUDA
        host = gpu.cpu()
        assert type(host) is torch.Tensor and host.tolist() == [7.0, 1.0, 2.0, 3.0]
        host[1] = -1.0  # a copy, not the GPU tensor
        assert float(gpu[1]) == 1.0
        assert torch.ones(2).to(gpu).device.type == "cuda" and gpu.to(torch.ones(1)).device.type == "cpu"


def test_a_module_on_the_fake_gpu_trains_there_and_refuses_host_inputs() -> None:
    with FakeCuda():
        layer = on_fake_cuda(nn.Linear(3, 1))
        assert isinstance(layer.weight, nn.Parameter) and isinstance(layer.weight, OnCuda)
        layer(torch.randn(5, 3, device="cuda")).sum().backward()
        assert layer.weight.grad is not None and layer.weight.grad.device.type == "cuda"
        with pytest.raises(RuntimeError, match="same device"):
            layer(torch.randn(5, 3))
