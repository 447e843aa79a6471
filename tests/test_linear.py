"""models/linear.py: the CPU's W @ xᵀ path gives F.linear's values for every row count and shape,
with and without bias, keeps gradients, and Linear keeps nn.Linear's state-dict names; the choice
between the two is timed once a process unless EAGLET_CPU_MATMUL names it."""
import pytest
import torch
import torch.nn.functional as F

from eaglet.errors import InvalidInput
from eaglet.models import linear as linear_module
from eaglet.models.linear import CPU_MATMUL, CPU_MAX_ROWS, Linear, cpu_matmul, cpu_wxt, linear


@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 2, 48), (2, 3, 48), (7, 48), (1, CPU_MAX_ROWS, 48),
                                   (1, CPU_MAX_ROWS + 1, 48), (0, 48)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("wxt", [True, False])
def test_linear_equals_f_linear(shape, bias, wxt, monkeypatch):
    monkeypatch.setattr(linear_module, "cpu_wxt", lambda: wxt)
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


@pytest.fixture
def untimed():
    """cpu_wxt's cached choice cleared around a test (the suite's own comes back after it)."""
    cpu_wxt.cache_clear()
    yield
    cpu_wxt.cache_clear()


def test_the_cpu_matmul_is_named_or_timed(monkeypatch, untimed):
    """EAGLET_CPU_MATMUL=wxt or linear decides without timing, anything else is one clear error, and
    auto times both ways here; records then name the choice (cpu_matmul: None before any choice)."""
    for name, want in (("wxt", True), ("linear", False)):
        monkeypatch.setenv(CPU_MATMUL, name)
        cpu_wxt.cache_clear()
        assert cpu_matmul() is None and cpu_wxt() is want and cpu_matmul() == name
    monkeypatch.setenv(CPU_MATMUL, "fast")
    cpu_wxt.cache_clear()
    with pytest.raises(InvalidInput, match="EAGLET_CPU_MATMUL='fast'"):
        cpu_wxt()
    monkeypatch.setenv(CPU_MATMUL, "auto")
    cpu_wxt.cache_clear()
    assert cpu_matmul() is None  # asking what was chosen does not time it
    assert isinstance(cpu_wxt(), bool) and cpu_matmul() == ("wxt" if cpu_wxt() else "linear")


@pytest.mark.parametrize("wxt", [True, False])
def test_an_exact_model_always_takes_w_xt(wxt, monkeypatch):
    """Exact models' rows come out alike at any row count: W @ xᵀ whatever the host's choice, so one
    row's result is the same bits alone and among 7, 64 and 130 (pieces of 64)."""
    from eaglet.kernels import EXACT

    monkeypatch.setattr(linear_module, "cpu_wxt", lambda: wxt)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 576, generator=g)
    x = torch.randn(130, 576, generator=g)
    alone = linear(x[:1], w, kernels=EXACT)
    for rows in (7, 64, 130):
        assert torch.equal(linear(x[:rows], w, kernels=EXACT)[:1], alone)
