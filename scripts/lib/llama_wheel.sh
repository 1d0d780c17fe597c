# Sourced by scripts/lib/venv.sh (.venv) and scripts/build-installer (the bundle): a PORTABLE
# llama-cpp-python wheel, built once per machine and set of CPU variants, and reused: the one
# llama.cpp build that .venv, the tests and the installer's tests all run.
#
# Portable means: no -march=native. On Linux each CPU variant of ggml's CPU backend is
# built as its own library (libggml-cpu-x64.so ... libggml-cpu-sapphirerapids.so) and
# llama.cpp loads the best one for the machine it runs on; on macOS the Metal backend.
# Which variants (SHOAL_LLAMA_VARIANTS): `dev`, the default, is the baseline x64 and the best
# one this CPU runs (two libraries: the node runs at native speed, and ggml still scores and
# picks); `all` is every variant, what a release carries (scripts/build-installer's default:
# about 14 more minutes on 2 cores); or the names.
# pip's wheel cache does not key on CMAKE_ARGS, so the wheel is built with --no-cache-dir
# into a folder named after the version and the exact options: a native wheel built
# elsewhere can never be taken for this one, and options that change make a new folder.
#
#   . scripts/lib/llama_wheel.sh
#   wheel="$(ensure_llama_wheel "$python")"   # prints the wheel's path; builds if absent
#   "$python" -m pip install "$wheel"

SHOAL_LLAMA_VERSION="0.3.36"
shoal_root="${shoal_root:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"

# The CMake options of the portable build for this platform.
llama_portable_cmake_args() {
    case "$(uname -s)" in
        Darwin)
            # Metal (its shaders embedded) with the CPU backend linked in; -march stays generic
            echo "-DGGML_NATIVE=OFF -DGGML_METAL=ON -DGGML_METAL_EMBED_LIBRARY=ON -DLLAVA_BUILD=OFF"
            ;;
        *)
            # BACKEND_DL + CPU_ALL_VARIANTS: one libggml-cpu-<variant>.so per instruction set,
            # scored and picked at load time. CMAKE_INSTALL_BINDIR puts those modules into the
            # package's lib/ (llama.cpp installs them to bin/ otherwise, outside the package).
            # OpenMP off: ggml's own thread pool, so the variants need no libgomp at dlopen.
            echo "-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON" \
                "-DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
            ;;
    esac
}

# llama_variants PYTHON: the CPU variants to build, space-separated ("" on macOS)
llama_variants() {
    [ "$(uname -s)" = Darwin ] && return 0
    PYTHONPATH="$shoal_root" "$1" -m installers.bundle variants "${SHOAL_LLAMA_VARIANTS:-dev}"
}

# The folder the wheel lives in: one per version, machine kind, set of options and variants.
llama_wheel_dir() {
    local key
    key="$(printf '%s %s %s %s' "$SHOAL_LLAMA_VERSION" "$(uname -sm)" \
        "$(llama_portable_cmake_args)" "$1" | sha256sum | cut -c1-12)"
    # inside pip's own cache folder: a machine (or CI) that keeps pip's built wheels keeps
    # this one too, and `pip cache purge` leaves it alone
    echo "${SHOAL_WHEEL_CACHE:-${PIP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pip}/shoal-wheels}/portable-$key"
}

# llama_wheel_tree PYTHON: the folder that keeps the wheel's CMake tree (src/ and build/)
# after the build, so scripts/lib/llama_server.py builds llama-server over the objects the
# wheel has just compiled instead of compiling llama.cpp a second time. A fixed path: a CMake
# tree cannot be moved. llama_server.py deletes it once the server is built.
llama_wheel_tree() {
    local variants
    variants="$(llama_variants "$1")" || return 1
    echo "$(llama_wheel_dir "$variants").tree"
}

# ensure_llama_wheel PYTHON: print the portable wheel's path, building it first if needed.
# The wheel goes to a temporary folder that is renamed into place only when it is checked,
# so an interrupted build is never reused.
ensure_llama_wheel() {
    local py="$1" dir tmp tree wheel args variants every
    variants="$(llama_variants "$py")" || return 1
    dir="$(llama_wheel_dir "$variants")"
    wheel="$(ls "$dir"/llama_cpp_python-"$SHOAL_LLAMA_VERSION"-*.whl 2>/dev/null | head -n1)"
    if [ -n "$wheel" ]; then
        echo "$wheel"
        return 0
    fi
    args="$(llama_portable_cmake_args)"
    tmp="$dir.tmp.$$"
    tree="$dir.tree"
    rm -rf "$tmp" "$tree"
    mkdir -p "$tmp" "$tree/src" "$tree/sdist"
    echo "shoal: building llama.cpp once for this machine into $dir" \
        "(CPU variants: ${variants:-none}; about 8 minutes on 2 cores, 20 with every variant)" >&2
    # the sdist unpacked at a path that stays (the kept tree points at it), and ggml's list
    # of CPU variants edited there when fewer than all are wanted
    every="$(PYTHONPATH="$shoal_root" "$py" -m installers.bundle variants all)"
    if ! "$py" -m pip download --quiet --no-deps --no-binary :all: --no-cache-dir \
        -d "$tree/sdist" "llama-cpp-python==$SHOAL_LLAMA_VERSION" >"$tmp/build.log" 2>&1 ||
        ! tar -xzf "$tree"/sdist/llama_cpp_python-*.tar.gz -C "$tree/src" --strip-components=1 ||
        { [ -n "$variants" ] && [ "$variants" != "$every" ] &&
            ! PYTHONPATH="$shoal_root" "$py" -m installers.bundle keep-variants \
                "$tree/src/vendor/llama.cpp/ggml/src/CMakeLists.txt" $variants; }; then
        tail -n 5 "$tmp/build.log" >&2
        echo "shoal: could not get llama.cpp's source (see above); check the network" \
            "and run again" >&2
        return 1
    fi
    rm -rf "$tree/sdist"
    if ! CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(llama_jobs)}" \
        "$py" -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
        --config-settings=build-dir="$tree/build" \
        --progress-bar off -w "$tmp" "$tree/src" >>"$tmp/build.log" 2>&1; then
        tail -n 30 "$tmp/build.log" >&2
        echo "shoal: building llama.cpp failed (log above, whole log in $tmp/build.log);" \
            "install a C++ compiler and cmake (apt install build-essential cmake) and run again" >&2
        return 1
    fi
    wheel="$(ls "$tmp"/llama_cpp_python-*.whl | head -n1)"
    llama_wheel_check "$py" "$wheel" "$variants" || return 1
    printf '%s\n' "$args" >"$tmp/CMAKE_ARGS"
    printf '%s\n' "$variants" >"$tmp/VARIANTS"
    printf '%s\n' "$SHOAL_LLAMA_VERSION" >"$tree/VERSION"  # the tree is whole
    rm -rf "$dir"
    mv "$tmp" "$dir"
    echo "$dir/$(basename "$wheel")"
}

# llama_wheel_check PYTHON WHEEL [VARIANTS]: refuse a wheel that is not the portable build
# with those variants.
llama_wheel_check() {
    "$1" - "$2" "${3:-}" <<'PY'
import sys, zipfile
names = [n.rsplit("/", 1)[-1] for n in zipfile.ZipFile(sys.argv[1]).namelist()]
libs = [n for n in names if n.startswith("libggml-cpu")]
wanted = {f"libggml-cpu-{v}.so" for v in sys.argv[2].split()}
if sys.platform == "darwin":
    ok = any(n.startswith("libggml-metal") for n in names)
else:
    # a native build has one libggml-cpu.so; the portable one a library per variant
    ok = len([n for n in libs if n.startswith("libggml-cpu-")]) >= 2 \
        and "libggml-cpu.so" not in libs and wanted <= set(libs)
if not ok:
    sys.exit(f"shoal: {sys.argv[1]} is not the portable llama.cpp build (CPU libraries: {libs}); "
             "delete it and run again")
PY
}

llama_jobs() {
    getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2
}
