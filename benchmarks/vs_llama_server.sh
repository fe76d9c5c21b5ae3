#!/usr/bin/env bash
# tinyllm against llama.cpp's llama-server on the same GGUF file, in one run: each server is
# started in turn with the same threads, and the same client (`tinyllm bench serve`, token-id
# prompts from the serve workload) sends it a single stream (4 requests one at a time) and a
# batch (16 at once), 64 output tokens each. Prints each engine's output tok/s, mean TTFT and
# mean TPOT, and tinyllm / llama.cpp.
#
#   benchmarks/vs_llama_server.sh LLAMA_SERVER MODEL.gguf [THREADS] [VOCAB_SIZE]
#
# LLAMA_SERVER: the llama-server binary (docs/MEASUREMENTS.md says how it was built); VOCAB_SIZE:
# the file's vocabulary, the range prompt ids are drawn from (default: 49152).
set -euo pipefail
server=$1 model=$2 threads=${3:-2} vocab=${4:-49152}
tinyllm=${TINYLLM:-tinyllm}
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT

wait_up() {
  for _ in $(seq 900); do
    curl -sf "localhost:$1/v1/models" >/dev/null && return 0
    sleep 1
  done
  echo "server on port $1 did not start; its log: $out/$2.log" >&2
  return 1
}

bench() {  # engine port shape requests [more flags]
  "$tinyllm" bench serve --base-url "http://127.0.0.1:$2" --num-requests "$4" "${@:5}" \
    --output-len 64 --vocab-size "$vocab" --json "$out/$1-$3.json" >"$out/$1-$3.txt" 2>&1
}

run() {  # engine port
  bench "$1" "$2" single 4 --max-concurrency 1
  bench "$1" "$2" batch 16
}

"$server" -m "$model" -t "$threads" -tb "$threads" -c 16384 -np 16 --port 18501 \
  >"$out/llama.cpp.log" 2>&1 &
pid=$!
wait_up 18501 llama.cpp && run llama.cpp 18501
kill "$pid" && wait "$pid" 2>/dev/null || true

"$tinyllm" serve --model "$model" --threads "$threads" --max-model-len 1024 --port 18502 \
  >"$out/tinyllm.log" 2>&1 &
pid=$!
wait_up 18502 tinyllm && run tinyllm 18502
kill -INT "$pid" && wait "$pid" 2>/dev/null || true

python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
for shape in ("single", "batch"):
    r = {e: json.load(open(f"{out}/{e}-{shape}.json")) for e in ("tinyllm", "llama.cpp")}
    for e, d in r.items():
        print(f"{shape:>6} {e:>9}: {d['output_throughput']:6.2f} out tok/s, "
              f"TTFT {d['mean_ttft_ms']:8.0f} ms, TPOT {d['mean_tpot_ms']:7.1f} ms")
    t, b = r["tinyllm"], r["llama.cpp"]
    print(f"{shape:>6} tinyllm/llama.cpp: {t['output_throughput'] / b['output_throughput']:.2f}x "
          f"output tok/s, {b['mean_tpot_ms'] / t['mean_tpot_ms']:.2f}x per token (TPOT)")
EOF
echo "logs and JSON: $out"
