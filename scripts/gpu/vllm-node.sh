#!/usr/bin/env bash
# On a GPU machine (Linux, NVIDIA driver with CUDA 12), from a clone of Shoal:
#     scripts/gpu/vllm-node.sh
# 1. installs vLLM (pinned, into .venv-vllm) and Shoal (into .venv) if missing;
# 2. starts vLLM on 127.0.0.1:$VLLM_PORT serving $VLLM_MODEL with --max-num-seqs $LANES,
#    under the name the head gives its GGUF of the same model, and waits for /health;
# 3. runs scripts/bench/engine_node.py --engine vllm: it starts a Shoal node fronting vLLM
#    (shoal node --runtime vllm --upstream ...) and a head dialing it, calls vLLM directly
#    (/v1/completions, token ids) and through head and node at 1, 4 and 8 streams, and
#    prints the side-by-side figures (and the second-turn TTFT with affinity);
# 4. stops what it started, by process id (vLLM by its own process group).
# Settings (environment): VLLM_VERSION, VLLM_MODEL, HEAD_MODEL, MODEL_NAME, VLLM_PORT,
# LANES, GPU_MEMORY, ROUNDS, TOKENS, OUT (a file for the report section; default: print only).
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.11.0}"  # return_token_ids needs 0.10.2 or newer
VLLM_MODEL="${VLLM_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}"
# the head's tokenizer and template: a GGUF of the same model (empty: the embedded SmolLM2)
HEAD_MODEL="${HEAD_MODEL:-}"
MODEL_NAME="${MODEL_NAME:-SmolLM2-135M-Instruct.Q4_1}"  # what the head calls that GGUF
VLLM_PORT="${VLLM_PORT:-8000}"
LANES="${LANES:-8}"
GPU_MEMORY="${GPU_MEMORY:-0.5}"
ROUNDS="${ROUNDS:-6}"
TOKENS="${TOKENS:-128}"
OUT="${OUT:--}"
HEALTH_TIMEOUT=900  # s: the first start downloads the model and compiles CUDA graphs

root="$(cd "$(dirname "$0")/../.." && pwd)"
. "$root/scripts/lib/venv.sh"
cd "$root"
logs="$(mktemp -d -t shoal-vllm-node.XXXXXX)"
vllm_pid=""

stop_vllm() {
    if [ -n "$vllm_pid" ] && kill -0 "$vllm_pid" 2>/dev/null; then
        echo "shoal: stopping vLLM (process group $vllm_pid)"
        kill -TERM -- "-$vllm_pid" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 "$vllm_pid" 2>/dev/null || break
            sleep 1
        done
        kill -KILL -- "-$vllm_pid" 2>/dev/null || true
    fi
}
trap stop_vllm EXIT
trap 'exit 130' INT TERM

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "shoal: no NVIDIA GPU here (nvidia-smi fails); run this on the GPU machine" >&2
    exit 1
fi

ensure_venv "llamacpp,hub,dev"
if [ ! -x .venv-vllm/bin/vllm ] ||
    [ "$(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)' 2>/dev/null)" != "$VLLM_VERSION" ]; then
    py="$(shoal_python)"
    echo "shoal: installing vLLM $VLLM_VERSION into .venv-vllm (a few GB, once)"
    "$py" -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install --quiet --upgrade pip
    .venv-vllm/bin/python -m pip install --progress-bar off "vllm==$VLLM_VERSION"
fi

echo "shoal: starting vLLM $VLLM_VERSION on 127.0.0.1:$VLLM_PORT ($VLLM_MODEL as $MODEL_NAME," \
    "--max-num-seqs $LANES; log: $logs/vllm.log)"
# its own session: the engine processes it spawns share its process group, ended together
setsid .venv-vllm/bin/vllm serve "$VLLM_MODEL" --host 127.0.0.1 --port "$VLLM_PORT" \
    --served-model-name "$MODEL_NAME" --max-num-seqs "$LANES" --max-model-len 4096 \
    --gpu-memory-utilization "$GPU_MEMORY" >"$logs/vllm.log" 2>&1 &
vllm_pid=$!

deadline=$((SECONDS + HEALTH_TIMEOUT))
until .venv/bin/python - "$VLLM_PORT" <<'PY' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2) as r:
    sys.exit(0 if r.status == 200 else 1)
PY
do
    if ! kill -0 "$vllm_pid" 2>/dev/null; then
        tail -n 20 "$logs/vllm.log" >&2
        echo "shoal: vLLM exited while starting (log above: $logs/vllm.log)" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "shoal: vLLM did not answer /health within $HEALTH_TIMEOUT s (log: $logs/vllm.log)" >&2
        exit 1
    fi
    sleep 2
done
echo "shoal: vLLM is up"

bench=(.venv/bin/python scripts/bench/engine_node.py --engine vllm
    --upstream "http://127.0.0.1:$VLLM_PORT" --rounds "$ROUNDS" --tokens "$TOKENS"
    --out "$OUT" --cache "$logs")
if [ -n "$HEAD_MODEL" ]; then
    bench+=(--head-model "$HEAD_MODEL")
fi
"${bench[@]}"
