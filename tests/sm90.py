"""A recorded kernel launch compiled for sm_90a without a GPU: the step the compile-only tests share
(tests/test_gluon_compile.py, tests/test_fused_forward.py).

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
