"""The sm_90 compile check of interpreted launches (tests/sm90_compile.py): active wherever triton is, and it
fails a kernel that the interpreter runs but the GPU's compiler refuses (run 136's loop-carried type change)."""
import os

import pytest
import torch

import sm90_compile

triton = pytest.importorskip("triton")
tl = triton.language

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("SPIN_SM90_COMPILE") == "0",
                                reason="the check wraps the interpreter (a CUDA machine compiles for real); "
                                       "SPIN_SM90_COMPILE=0 turns it off")


@triton.jit
def _retyped_in_loop(x_ptr, n, WIDE: tl.constexpr):
    """Writes n to x_ptr[0]; with WIDE a float64 name is re-bound to an int64 inside the loop, which the
    interpreter runs and the compiler refuses, as in run 136."""
    span = tl.full([], 2.0, tl.float64)
    i = tl.zeros([], tl.int64)
    if WIDE:
        while i < n:
            span = n - i  # int64 now: the loop-carried type changes
            i += 1
    else:
        while i < n:
            i += 1
    tl.store(x_ptr, i.to(tl.float32) + span.to(tl.float32) * 0)


def test_the_check_is_installed_where_triton_compiles():
    # the compiler's front end is internal API: a triton that moves it must fail here, not switch the check off
    assert sm90_compile.usable()
    assert getattr(type(_retyped_in_loop).run, "_sm90", False)


def test_a_kernel_the_compiler_refuses_fails_though_the_interpreter_runs_it():
    x = torch.full((1,), -1.0)
    _retyped_in_loop[(1,)](x, 3, WIDE=False)  # compiled (fine) and interpreted
    assert x.item() == 3.0
    sm90_compile.compile_launch(_retyped_in_loop, (x, 3), {"WIDE": False})  # cached: no second compile
    with pytest.raises(triton.compiler.errors.CompilationError, match="Loop-carried variable span"):
        sm90_compile.compile_launch(_retyped_in_loop, (x, 3), {"WIDE": True})
    y = torch.full((1,), -1.0)
    _retyped_in_loop[(1,)](y, 3, WIDE=True)  # the interpreter alone (the check compiles the package's kernels)
    assert y.item() == 3.0
