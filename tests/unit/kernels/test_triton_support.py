"""The cached Triton launch: its key separates every call Triton would compile differently (CPU),
the launch logic with a stand-in kernel (CPU), and real kernels launched both ways (GPU)."""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.kernels import triton_support as T
from tests.conftest import requires_cuda

triton = pytest.importorskip("triton")


def key(*values, constexprs=(), options=None, device=0):
    return T.specialization_key(values, frozenset(constexprs), options or {}, device)


def test_key_separates_what_triton_specializes_on():
    base = torch.zeros(64)
    assert key(base[0:]) == key(torch.ones(8))  # both 16-byte aligned fp32
    assert key(base[0:]) != key(base[1:])  # 4 bytes off: not aligned
    assert key(base) != key(base.to(torch.bfloat16))
    assert key(base[4:]) == key(base)  # 16 bytes off: aligned again
    ints = [1, 2, 16, 17, 32, -16, 2**31 - 16, 2**31, 2**63 - 1, 2**63]
    # 1 | 2, 17 | 16, 32, -16, 2**31-16 | 2**31 (64-bit, multiple of 16) | 2**63-1 | 2**63 (unsigned)
    assert len({key(v) for v in ints}) == 6
    assert key(16) == key(32) and key(2) == key(17)
    assert key(2**31 - 16) == key(16) and key(2**31) != key(16)
    assert key(2**63) != key(2**63 - 16) and key(2**63 - 1) == key(2**31 + 1)
    assert key(True) != key(1) and key(True) == key(False)
    assert key(1.0) == key(2.5) and key(None) == key(None) and key(None) != key(0)


def test_key_keeps_constexpr_values_options_and_device():
    assert key(64, constexprs={0}) != key(128, constexprs={0})
    assert key(64, constexprs={0}) != key(64)
    assert len({key(v, constexprs={0}) for v in (True, 1, 1.0)}) == 3
    assert key(1, options={"num_warps": 4}) != key(1, options={"num_warps": 8})
    assert key(1, options={"a": 1, "b": 2}) == key(1, options={"b": 2, "a": 1})
    assert key(1, device=0) != key(1, device=1)


def test_key_refuses_what_it_does_not_describe():
    with pytest.raises(T._Uncached):
        key("text")
    with pytest.raises(T._Uncached):
        key([1, 2], constexprs={0})  # unhashable constexpr


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, launches):
        self.launches = launches

    def run(self, *args):
        self.launches.append(("direct",) + args)


class _Kernel:
    """Stands in for a ``triton.jit`` function: records Triton-path launches."""

    arg_names = ["x_ptr", "n", "BLOCK"]
    constexprs = [2]

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(("triton", grid, args, kwargs))
            return _Compiled(self.launches)
        return launch


def test_launch_goes_direct_once_the_key_is_known(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(T, "_knobs", _Knobs())
    kernel = _Kernel()
    wrapped = T._CachedLaunchKernel(kernel)
    x = torch.zeros(64)
    wrapped[(4,)](x, 32, BLOCK=128)
    wrapped[(5, 2)](x, 48, BLOCK=128)  # same key: direct, grid padded to 3-D
    wrapped[(5,)](x[1:], 48, BLOCK=128)  # unaligned: Triton again
    wrapped[(5,)](x, 48, BLOCK=256)  # new constexpr: Triton again
    wrapped[lambda meta: (1,)](x, 48, BLOCK=128)  # callable grid: Triton
    wrapped[(3,)](x, 16, BLOCK=128, num_warps=8)  # new option: Triton
    wrapped[(3,)](x, 16, BLOCK=128, num_warps=8)  # ... then direct
    kinds = [launch[0] for launch in kernel.launches]
    assert kinds == ["triton", "direct", "triton", "triton", "triton", "triton", "direct"]
    direct = kernel.launches[1]
    assert direct[1:4] == (5, 2, 1) and direct[4] == 77
    assert direct[5:10] == ("function", "metadata", None, None, None)
    assert direct[10] is x and direct[11:] == (48, 128)  # every argument, constexprs included
    assert kernel.launches[-1][11:] == (16, 128)  # options are not arguments


def test_launch_hooks_send_every_launch_through_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    knobs = _Knobs()
    monkeypatch.setattr(T, "_knobs", knobs)
    kernel = _Kernel()
    wrapped = T._CachedLaunchKernel(kernel)
    x = torch.zeros(64)
    wrapped[(1,)](x, 32, BLOCK=128)
    knobs.runtime.launch_enter_hook.calls.append(print)
    wrapped[(1,)](x, 32, BLOCK=128)
    assert [launch[0] for launch in kernel.launches] == ["triton", "triton"]


class _Chain:
    def __init__(self):
        self.calls = []


class _Knobs:
    def __init__(self):
        self.runtime = type("runtime", (), {})()
        self.runtime.launch_enter_hook, self.runtime.launch_exit_hook = _Chain(), _Chain()


def test_only_jit_functions_are_wrapped():
    def plain(x):
        return x

    assert T.cached_launch(plain) is plain

    @triton.jit
    def kernel(x_ptr, n, BLOCK: triton.language.constexpr):
        pass

    wrapped = T.cached_launch(kernel)
    assert isinstance(wrapped, T._CachedLaunchKernel) and wrapped.arg_names == ["x_ptr", "n", "BLOCK"]
    assert wrapped.fn is kernel.fn  # other attributes are the kernel's


if T.HAVE_TRITON:
    import triton.language as tl

    @T.cached_launch
    @triton.jit
    def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < n
        x = tl.load(x_ptr + offsets, mask=ok)
        y = tl.load(y_ptr + offsets, mask=ok)
        tl.store(out_ptr + offsets, x + scale * y, mask=ok)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cached_launch_matches_torch_for_every_specialization():
    base = torch.randn(4096, device="cuda")
    other = torch.randn(4096, device="cuda")
    cases = [(0, 1), (0, 16), (0, 1000), (1, 1000), (3, 17), (4, 1024), (0, 1), (1, 1000)] * 2
    for offset, n in cases:
        x, y = base[offset:offset + n], other[offset:offset + n]
        out = torch.empty(n + 1, device="cuda")[1:]  # unaligned output as well
        _scaled_add_kernel[(triton.cdiv(n, 256),)](x, y, out, n, 0.5, BLOCK=256)
        assert torch.equal(out, x + 0.5 * y), (offset, n)
    keys = {k for k in _scaled_add_kernel._compiled}
    assert len(keys) >= 4  # aligned / unaligned inputs, n == 1, n % 16 == 0, other n
