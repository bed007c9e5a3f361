# Install SonicMoE 0.1.2.post1 and what it needs beyond the GPU image, from the wheels in .whl/
# (no internet there; .whl/ is not in the repository: `pip download --no-deps` the versions below into it). Run from the repo root, sourced so that PYTHONPATH is exported:
#
#   source benchmarks/install_sonicmoe.sh [TARGET]      # TARGET defaults to /tmp/site
#   python3 benchmarks/bench_layer.py --impls sonicmoe
#
# (run with bash instead, it installs and prints the export line). .whl/ holds:
#   sonic_moe 0.1.2.post1, quack_kernels 0.4.1, nvidia_cutlass_dsl 4.4.2 (metadata only),
#   apache_tvm_ffi 0.1.15.post2, torch_c_dlpack_ext 0.1.5: wheels, installed with --no-deps;
#   nvidia_cutlass_dsl_libs_cu13-4.4.2.tar.xz: that wheel unpacked (the wheel is over 64 MiB).
#     It is a complete replacement for nvidia-cutlass-dsl-libs-base, which is not needed.
# The cutlass package sits in <target>/nvidia_cutlass_dsl/python_packages, which the wheel's
# .pth file adds in a site-packages folder; a --target folder reads no .pth, so PYTHONPATH names it.

_sm_target="${1:-/tmp/site}"
_sm_pkgs="$_sm_target/nvidia_cutlass_dsl/python_packages"
if [ ! -d "$_sm_target/sonicmoe" ] || [ ! -d "$_sm_pkgs/cutlass" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$_sm_target" .whl/*.whl &&
        tar -xJf .whl/nvidia_cutlass_dsl_libs_cu13-4.4.2.tar.xz -C "$_sm_target" ||
        echo "install_sonicmoe: install FAILED" >&2
fi
if [ -d "$_sm_pkgs/cutlass" ]; then
    export PYTHONPATH="$_sm_target:$_sm_pkgs${PYTHONPATH:+:$PYTHONPATH}"
    echo "export PYTHONPATH=$PYTHONPATH"
    python3 -c "import cuda.bindings, cutlass, quack, sonicmoe; print('sonicmoe', sonicmoe.__version__, 'quack', quack.__version__, 'cutlass', cutlass.__version__, 'cuda.bindings', cuda.bindings.__version__)" ||
        echo "install_sonicmoe: import check FAILED" >&2
else
    echo "install_sonicmoe: $_sm_pkgs/cutlass missing (are the wheels in .whl/? see the header)" >&2
    unset _sm_target _sm_pkgs
    return 1 2>/dev/null || exit 1  # sourced: the caller's && chain stops; run with bash: exit status 1
fi
unset _sm_target _sm_pkgs
