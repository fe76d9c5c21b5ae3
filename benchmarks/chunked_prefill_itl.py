"""Does a long prompt stall the streams already decoding? The same scenario against two servers,
one after the other in one run: 16 streams decode, then a long prompt arrives; the other streams'
inter-token latency while it is prefilled, with chunked prefill (the default token budget) and
without (a budget larger than the prompt, so it is prefilled in one step).

    python benchmarks/chunked_prefill_itl.py [--long-prompt 4000] [--chunked-budget 512]
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def measure(budget: int, args: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "tinyllm.entrypoints.cli", "serve", "--port", str(port)]
    serve += ["--max-num-batched-tokens", str(budget), "--max-model-len", str(args.max_model_len)]
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        bench = [sys.executable, "-m", "tinyllm.entrypoints.cli", "bench", "serve"]
        bench += ["--base-url", url, "--num-requests", str(args.streams)]
        bench += ["--output-len", str(args.output_len), "--long-prompt", str(args.long_prompt)]
        bench += ["--json", str(out)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--long-prompt", type=int, default=4000)
    p.add_argument("--chunked-budget", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args()
    whole = args.long_prompt + args.streams  # the whole prompt and every decode in one step
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, budget in (("chunked", args.chunked_budget), ("one step", whole)):
            r = measure(budget, args, Path(tmp) / f"{budget}.json")
            rows[name] = (budget, r["long_prompt"], r)
    print(
        f"\n{args.streams} streams of {args.output_len} tokens, then a {args.long_prompt}-token "
        "prompt; the other streams' inter-token latency (ms) while it is prefilled:"
    )
    head = ["budget", "window ITLs", "median", "p99", "max", "long TTFT", "all p99 ITL"]
    print(f"{'prefill':<10}" + "".join(f"{h:>13}" for h in head))
    for name, (budget, lp, r) in rows.items():
        cells = [budget, lp["window_itls"], f"{lp['median_itl_ms']:.0f}", f"{lp['p99_itl_ms']:.0f}"]
        cells += [f"{lp['max_itl_ms']:.0f}", f"{lp['ttft_ms']:.0f}", f"{r['p99_itl_ms']:.0f}"]
        print(f"{name:<10}" + "".join(f"{c:>13}" for c in cells))
    chunked, whole_step = rows["chunked"][1], rows["one step"][1]
    print(f"p99 ratio chunked / one step: {chunked['p99_itl_ms'] / whole_step['p99_itl_ms']:.2f}")


if __name__ == "__main__":
    main()
