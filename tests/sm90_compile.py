"""Every launch of the package's Triton kernels that the interpreter runs also goes through the compiler for the
H200 (sm_90), on a machine without a GPU.

The interpreter executes a kernel's Python line by line and never runs Triton's compiler, so a kernel can pass
every CPU test and still fail to build on the GPU (run 136: a loop-carried variable whose type changed, which the
compiler refuses and the interpreter never checks). Triton's CUDA backend compiles without a GPU, so each
distinct launch (kernel, argument types, constexprs, launch options) goes once through the compiler's front end
for sm_90 (`front_end`; SPIN_SM90_COMPILE=full: to a cubin) before the interpreter runs it; a compile error fails
the test that launched it.

`install()` wraps InterpretedFunction.run (conftest.py calls it under TRITON_INTERPRET=1 where the compiler is
usable and SPIN_SM90_COMPILE is not 0). The code generator resolves a kernel's callees through its module
globals, which hold InterpretedFunction objects in interpreter mode: for the compile they are swapped for
JITFunction twins of the same Python functions, and restored before the interpreter runs.
"""
from __future__ import annotations

import inspect
import os
import sys

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, mangle_type
except ImportError:  # pragma: no cover - no triton: nothing to check
    triton = None

TARGET = ("cuda", 90, 32)  # the H200 / H100: sm_90, 32-thread warps
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
PACKAGE = "spin_indexer"
_compiled: set = set()       # the launches compiled (their keys), once each per process
_twins: dict = {}            # python function -> its JITFunction


def usable() -> bool:
    """Whether this triton can compile for sm_90 here (its CUDA backend and the front-end calls `front_end`
    makes)."""
    if triton is None:
        return False
    try:
        _compile_probe()
    except Exception:  # noqa: BLE001 - any failure means the check is not available here
        return False
    return True


def _compile_probe() -> None:
    """One store through the front end for sm_90: raises where the backend or its API is missing."""
    front_end(ASTSource(_twin_of(_probe.fn), {"x_ptr": "*fp32"}, {}), {})


if triton is not None:
    @triton.jit
    def _probe(x_ptr):
        triton.language.store(x_ptr, 1.0)


def _twin_of(fn) -> "JITFunction":
    """The JITFunction of a plain Python kernel function (one per function)."""
    twin = _twins.get(fn)
    if twin is None:
        twin = _twins[fn] = JITFunction(fn)
    return twin


_pristine: list = []  # (module or class of triton.language, its attributes before any interpretation)


def _snapshot_lang() -> None:
    """The attributes of triton.language's modules and of the classes they define, before the interpreter runs:
    its device-function calls patch triton.language.core and never restore it (triton 3.9)."""
    import triton.language  # noqa: F401 - its modules loaded before the snapshot
    seen = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for obj in (module, *(v for v in vars(module).values()
                              if isinstance(v, type) and v.__module__.startswith("triton.language"))):
            if id(obj) not in seen:
                seen.add(id(obj))
                _pristine.append((obj, dict(vars(obj))))


class _PristineLang:
    """While active: triton.language as it was before any interpretation (the compiler's own functions);
    the interpreter's patches put back on exit."""

    def __enter__(self):
        self._changed = []
        for obj, before in _pristine:
            now = vars(obj)
            for attr in set(now) | set(before):
                old, cur = before.get(attr, _MISSING), now.get(attr, _MISSING)
                if old is not cur:
                    self._changed.append((obj, attr, cur))
                    _set(obj, attr, old)
        return self

    def __exit__(self, *exc):
        for obj, attr, cur in reversed(self._changed):
            _set(obj, attr, cur)
        return False


_MISSING = object()


def _set(obj, attr, value) -> None:
    if value is _MISSING:
        if attr in vars(obj):
            delattr(obj, attr)
    else:
        setattr(obj, attr, value)


class _JitGlobals:
    """While active: every InterpretedFunction in the package's module globals and in triton.language (whose
    standard functions are @jit code too) replaced by its JITFunction twin (the code generator resolves callees
    there); restored on exit."""

    def __enter__(self):
        self._swapped = []
        spaces = [module for name, module in list(sys.modules.items())
                  if module is not None and (name == PACKAGE or name.startswith(PACKAGE + "."))]
        spaces += [obj for obj, _ in _pristine]  # triton.language's own @jit functions (tl.max, tl.sum, ...)
        for obj in spaces:
            for attr, value in list(vars(obj).items()):
                if isinstance(value, InterpretedFunction):
                    self._swapped.append((obj, attr, value))
                    setattr(obj, attr, _twin_of(value.fn))
        return self

    def __exit__(self, *exc):
        for obj, attr, value in reversed(self._swapped):
            setattr(obj, attr, value)
        return False


def compile_launch(kernel: "InterpretedFunction", args: tuple, kwargs: dict) -> None:
    """Compiles this launch of `kernel` for sm_90 unless an identical one was (raises the compiler's error)."""
    twin = _twin_of(kernel.fn)
    names = [p.name for p in twin.params]
    call_kw = {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    bound = inspect.signature(kernel.fn).bind(*args, **call_kw)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for p in twin.params:
        value = bound.arguments[p.name]
        if p.is_constexpr or value is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        else:
            signature[p.name] = mangle_type(value)  # triton's own: *fp32, i32, tensordesc<u8[64, 128]>, ...
    key = (kernel.fn, tuple(signature.items()), tuple((k, repr(v)) for k, v in constexprs.items()),
           tuple(sorted(options.items())))
    if key in _compiled:
        return
    with _PristineLang(), _JitGlobals():
        front_end(ASTSource(twin, signature, constexprs), options)
    _compiled.add(key)


def front_end(src: "ASTSource", options: dict):
    """The compiler's front end for sm_90: the kernel's Python to Triton IR (code generation: types, constexprs,
    callees, shapes) and the TTIR passes; returns the TTIR module. The later stages (TTGIR layouts, LLVM, PTX,
    ptxas) took ~26 of ~27 s on the planner's tests and catch little the front end does not; SPIN_SM90_COMPILE=full
    runs them too (triton.compile to a cubin)."""
    target = GPUTarget(*TARGET)
    if os.environ.get("SPIN_SM90_COMPILE") == "full":
        return triton.compile(src, target=target, options=options)
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend
    backend = make_backend(target)
    opts = backend.parse_options(dict(options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    stages = {}
    backend.add_stages(stages, opts, src.language)
    return stages["ttir"](module, {"target": target, **opts.__dict__})


def install() -> None:
    """Wraps InterpretedFunction.run: each launch is compiled for sm_90 (once) before the interpreter runs it."""
    if getattr(InterpretedFunction.run, "_sm90", False):
        return
    _snapshot_lang()
    interpret = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.split(".")[0] == PACKAGE:
            compile_launch(self, args, kwargs)
        return interpret(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._sm90 = True
    InterpretedFunction.run = run
