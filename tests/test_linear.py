"""models/linear.py: the CPU's W @ xᵀ path gives F.linear's values for every row count and shape,
with and without bias, keeps gradients, and Linear keeps nn.Linear's state-dict names."""
import pytest
import torch
import torch.nn.functional as F

from eaglet.models.linear import CPU_MAX_ROWS, Linear, linear


@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 2, 48), (2, 3, 48), (7, 48), (1, CPU_MAX_ROWS, 48),
                                   (1, CPU_MAX_ROWS + 1, 48), (0, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    y = linear(x, w, b)
    assert y.shape == (*shape[:-1], 80) and y.is_contiguous()
    assert torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_gradients_match():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 16, generator=g, requires_grad=True)
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    linear(x, w).square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.linear(x, w).square().sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)


def test_module_keeps_names():
    m = Linear(4, 3, bias=True)
    assert isinstance(m, torch.nn.Linear) and set(m.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 4)
    assert torch.allclose(m(x), F.linear(x, m.weight, m.bias), atol=1e-6)
