#!/usr/bin/env bash
# An aarch64 Python 3.11 with numpy, tvm_ffi and libtvm_runtime.so (no TVM compiler), run on this
# machine under qemu-aarch64 user-mode emulation: scripts/aarch64_python.sh [SYSROOT]
# Then: SYSROOT/run script.py ... (Debian bookworm arm64 debs + manylinux aarch64 wheels; needs
# root for dpkg --add-architecture / apt-get update, qemu-user, unzip and a host pip.)
set -euo pipefail

root="$(realpath -m "${1:-${KILN_HOME:-$HOME/.cache/kiln}/aarch64-python}")"
host_python="${PYTHON:-python3}"
debs=(
    python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
    libc6 libgcc-s1 libstdc++6 libffi8 zlib1g libexpat1
)
wheels=(numpy==2.4.6 apache-tvm-ffi==0.1.14.post1 typing-extensions==4.16.0 apache-tvm==0.27.0.post1)
spec="${debs[*]} ${wheels[*]}"

command -v qemu-aarch64 >/dev/null || { echo "qemu-aarch64 missing: apt-get install qemu-user" >&2; exit 1; }
if [[ -e "$root" && ! -f "$root/.spec" && -n "$(ls -A "$root")" ]]; then
    echo "$root is not empty and not a sysroot made by this script; not replacing it" >&2
    exit 1
fi

write_runner() {
    cat >"$1/run" <<'EOF'
#!/usr/bin/env bash
# Runs the sysroot's aarch64 python3.11 under qemu-aarch64; the arguments go to python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
unset LD_PRELOAD LD_LIBRARY_PATH PYTHONSTARTUP
export QEMU_LD_PREFIX="$root" PYTHONHOME="$root/usr" PYTHONNOUSERSITE=1
export PYTHONPATH="$root/site-packages${PYTHONPATH:+:$PYTHONPATH}"
exec qemu-aarch64 -L "$root" "$root/usr/bin/python3.11" "$@"
EOF
    chmod +x "$1/run"
}

if [[ "$(cat "$root/.spec" 2>/dev/null)" != "$spec" ]]; then
    start=$SECONDS
    build="$root.partial"
    rm -rf "$build"
    mkdir -p "$build/downloads" "$build/site-packages"

    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        dpkg --add-architecture arm64
    fi
    download_debs() {
        (cd "$build/downloads" && apt-get -q -o APT::Sandbox::User=root download "${debs[@]/%/:arm64}")
    }
    if ! download_debs; then
        apt-get -q update
        download_debs
    fi
    for deb in "$build"/downloads/*.deb; do
        dpkg-deb -x "$deb" "$build"
    done

    "$host_python" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version 3.11 --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
        -d "$build/downloads" "${wheels[@]}"
    for wheel in "$build"/downloads/*.whl; do
        case "$(basename "$wheel")" in
            apache_tvm-*) unzip -q "$wheel" tvm/lib/libtvm_runtime.so -d "$build/site-packages" ;;
            *) unzip -q "$wheel" -d "$build/site-packages" ;;
        esac
    done

    write_runner "$build"
    # PYTHONDONTWRITEBYTECODE may be set, and the debs ship no .pyc: without these, importing
    # numpy + tvm_ffi under emulation takes ~10 s instead of ~2.5 s.
    "$build/run" -m compileall -q -j0 -x '/(tests?|idlelib|tkinter|lib2to3|ensurepip|3rdparty)/' \
        "$build/usr/lib/python3.11" "$build/site-packages"

    (cd "$build/downloads" && sha256sum -- *.deb *.whl) >"$build/SHA256SUMS"
    # gconv: glibc iconv modules (20 MB), which nothing here uses.
    rm -rf "$build/downloads" "$build/usr/share/doc" "$build/usr/share/man" "$build/usr/share/locale" \
        "$build/usr/lib/aarch64-linux-gnu/gconv"
    echo "$spec" >"$build/.spec"
    rm -rf "$root"
    mv "$build" "$root"
    echo "built $root in $((SECONDS - start))s ($(du -sh "$root" | cut -f1))"
fi

write_runner "$root"
# The version beside libtvm_runtime.so, as a kiln bundle's lib/ records it (apache-tvm is not installed).
tvm="$(grep -o 'apache-tvm==[^ ]*' <<<"${wheels[*]}")"
echo "${tvm#*==}" >"$root/site-packages/tvm/lib/apache-tvm.version"

"$root/run" -c '
import platform, numpy, tvm_ffi
assert platform.machine() == "aarch64", platform.machine()
print(platform.machine(), "python", platform.python_version())
print("numpy", numpy.__version__, "tvm_ffi", tvm_ffi.__version__)
'
