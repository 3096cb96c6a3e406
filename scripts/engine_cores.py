"""Cold prefill of one vLLM CPU server with and without a KV connector: do the engines compute alike?

    python scripts/engine_cores.py float32 none            # no connector
    python scripts/engine_cores.py float32 connector       # the kvoffload connector
    python scripts/engine_cores.py float32 none VLLM_CPU_NUM_OF_RESERVED_CPU=1

vLLM's CPU build reserves a core for its engine process, and one more when a KV connector is configured;
on a 2-core machine that made a connector's engine compute on both cores and a plain one on one
(docs/machines.md). Prints the cold TTFT of 4 fresh prompts at 1,024 and 2,048 tokens (the first is a
warm-up) and their median.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pytest_kvoffload.serve.client import stream_completion
from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.measure.prompts import make_prompt
from pytest_kvoffload.serve.processes import free_port
from pytest_kvoffload.serve.server import VllmServer


def main(dtype: str, mode: str, *env_pairs: str) -> None:
    model = load_model("tiny-llama")
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="engine-cores-"))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.path),
            "--served-model-name", model.name, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
            "--block-size", "128", "--max-model-len", "8320", "--load-format", "dummy", "--dtype", dtype,
            "--no-enable-prefix-caching", "--seed", "0"]
    if mode == "connector":
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVOffloadDiskConnector", "kv_connector_module_path": "pytest_kvoffload.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store_dir": str(scratch / "store")}})]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", **dict(pair.split("=", 1) for pair in env_pairs))
    server = VllmServer(mode, argv, env, port, scratch / "server.log", model.name)
    server.start()
    try:
        server.wait_healthy(600)
        for n in (1024, 2048):
            ttfts = [stream_completion(server, make_prompt(n, 0.0, salt=f"{mode}|{r}|{time.time()}").tokens).client_ttft_s
                     for r in range(4)]
            print(f"{dtype} {mode} {n} tokens: {[round(t * 1e3) for t in ttfts]} ms, "
                  f"median {statistics.median(ttfts[1:]) * 1e3:.0f} ms", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] not in ("none", "connector"):
        sys.exit("usage: engine_cores.py DTYPE none|connector [ENV=VALUE ...]")
    main(*sys.argv[1:])
