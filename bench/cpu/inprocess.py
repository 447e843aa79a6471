"""What the CPU serving probes share: an app served by uvicorn in a thread of this process, and one
`eaglet bench-serve` run against it from its own process (128-token ShareGPT requests, EOS ignored,
prompts of at most 600 characters), its record's results returned."""
import json
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn


@contextmanager
def serving(app, port: int, loop: str = "uvloop", http: str = "httptools"):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop=loop, http=http,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(10)


def bench_serve(port: int, prompts: str, num_requests: int, concurrency: int) -> dict:
    """One bench-serve run's results (its record is not kept); its last lines of stderr on failure."""
    with tempfile.TemporaryDirectory() as out:
        p = subprocess.run([sys.executable, "-m", "eaglet", "bench-serve", "--url", f"http://127.0.0.1:{port}",
                            "--prompts", prompts, "--max-tokens", "128", "--ignore-eos", "--max-prompt-chars", "600",
                            "--num-requests", str(num_requests), "--concurrency", str(concurrency), "--seed", "0",
                            "--no-progress", "--out", out], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"bench-serve failed: {p.stderr.strip()[-2000:]}")
        [path] = Path(out).glob("bench-serve-*[0-9].json")
        return json.loads(path.read_text())["results"]
