"""A recorded kernel launch compiled for sm_90a without a GPU: the step the compile-only tests share
(tests/test_gluon_compile.py; tests/test_fused_pass.py and tests/test_kernels_gemm.py through
`compile_in_child`, which compiles in a child process and runs ptxas -v on the result).

The launch is specialised as Triton's launcher would for a GPUTarget("cuda", 90) (its binder and argument packing:
pointer and integer divisibility, constexprs, options), then compiled to a cubin by `triton.compile`; the caller
reads the PTX, the shared memory, and runs ptxas for its report.
"""

import triton


def compile_for_sm90(kernel, args, kwargs, *, gluon: bool):
    """triton.compile of kernel[grid](*args, **kwargs) for sm_90a; gluon: a @gluon.jit kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    return triton.compile(source(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_in_child(script: str, args: list, tmp_path):
    """(shared memory bytes, ptxas -v report) of one launch compiled for sm_90a by `script` in a child process.

    The child runs with TRITON_INTERPRET=0 (set here, serval's helpers would otherwise be interpreter functions in
    it): it records the launch, compiles it with `compile_for_sm90`, prints "SHARED <bytes>" and writes the PTX to
    the path given as its last argument. Skips the test where Triton has no NVIDIA backend to compile with."""
    import os
    import subprocess
    import sys

    import pytest

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path  # the ptxas Triton compiles sm_90 with
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no NVIDIA backend to compile with: {e}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ptx = tmp_path / "kernel.ptx"
    done = subprocess.run([sys.executable, "-c", script, *map(str, args), str(ptx)], cwd=root,
                          env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shared = int(done.stdout.split("SHARED")[-1].split()[0])
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "kernel.cubin")],
                            capture_output=True, text=True)
    assert report.returncode == 0, report.stderr[-3000:]
    return shared, report.stderr


def compile_launch_in_this_child(module, kernel_name: str, launch, ptx_path: str):
    """The child side of `compile_in_child`: run launch() with module.<kernel_name> replaced by a recorder (on a
    machine of 132 SMs, no TMA allocator), compile the one launch it made for sm_90a, print "SHARED <bytes>" and
    write the PTX to ptx_path."""
    from serval.kernels import common

    common.num_sms = lambda *a: 132
    common.install_tma_allocator = lambda: None
    kernel, launches = getattr(module, kernel_name), []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((a, k))

    setattr(module, kernel_name, Recorder())
    try:
        launch()
    finally:
        setattr(module, kernel_name, kernel)
    (args, kwargs), = launches
    compiled = compile_for_sm90(kernel, args, kwargs, gluon=False)
    print("SHARED", compiled.metadata.shared)
    with open(ptx_path, "w") as f:
        f.write(compiled.asm["ptx"])
