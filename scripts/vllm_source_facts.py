"""Record what a vLLM release's own source accepts, from its wheel, for the command-line tests.

The GPU path runs vLLM's CUDA build, which cannot be installed here. This script downloads that release's
wheel (`pip download --no-deps vllm==VERSION`, cached), unpacks its Python files, builds the release's own
argument parser from them under this interpreter's packages, and writes what our command lines rely on:
every option string with whether it takes a value, the KV connectors it registers, KVTransferConfig's
fields and the kv_connector_extra_config keys each offloading spec reads. tests/serve/test_vllm_release.py
checks every backend's CUDA command line against the file, so the file comes from vLLM, not from us.

Usage: python scripts/vllm_source_facts.py [--version 0.33.0] [--wheels DIR] [--out FILE]
Writes tests/serve/golden/vllm-VERSION.json by default (about 340 MB downloaded once, 30 s).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run under the extracted source: the CUDA build finds no platform here, and the parser only needs one.
PARSER_FACTS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
import vllm
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
try:
    from vllm.entrypoints.common.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
import dataclasses
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
parser = make_arg_parser(FlexibleArgumentParser())
flags = {}
for action in parser._actions:
    for option in action.option_strings:
        flags[option] = action.nargs != 0
print(json.dumps({"flags": dict(sorted(flags.items())),
                  "kv_connectors": sorted(KVConnectorFactory._registry),
                  "kv_transfer_config_fields": sorted(f.name for f in dataclasses.fields(KVTransferConfig))}))
"""

# The offloading specs our native backends name, and the files whose extra_config reads they inherit.
# The OffloadingConnector's own config (block_size, blocks_per_chunk) and the spec factory are read for both.
CONNECTOR_FILES = ["vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py", "vllm/v1/kv_offload/factory.py",
                   "vllm/v1/kv_offload/base.py", "vllm/v1/kv_offload/cpu/spec.py"]
SPEC_FILES = {
    "CPUOffloadingSpec": CONNECTOR_FILES,
    "TieringOffloadingSpec": CONNECTOR_FILES + ["vllm/v1/kv_offload/tiering/spec.py"],
}


def wheel(version: str, folder: Path) -> Path:
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"vllm=={version}",
                        "-d", str(folder)], check=True)
        found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"vllm_source_facts: no wheel of vllm {version} in {folder}")
    return found[-1]


def extra_config_keys(source: str) -> set[str]:
    """String keys read as `<...>extra_config.get("KEY"...)` or `<...>extra_config["KEY"]`."""
    keys = set()
    for node in ast.walk(ast.parse(source)):
        target, key = None, None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant):
            target, key = node.func.value, node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            target, key = node.value, node.slice.value
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if isinstance(key, str) and name.endswith("extra_config"):
            keys.add(key)
    return keys


def facts(version: str, wheels: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel(version, wheels)) as archive:
            archive.extractall(tmp, [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")])
        out = subprocess.run([sys.executable, "-c", PARSER_FACTS, tmp], capture_output=True, text=True, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
        found["offloading_spec_keys"] = {
            spec: sorted(set().union(*(extra_config_keys((Path(tmp) / f).read_text()) for f in files)))
            for spec, files in SPEC_FILES.items()}
    return {"vllm": version, "source": f"vllm-{version} wheel (pip download --no-deps), scripts/vllm_source_facts.py",
            **found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.33.0", help="the vLLM release (default 0.33.0, the gpu extra's)")
    parser.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "kvoffload" / "wheels",
                        help="where the wheel is cached")
    parser.add_argument("--out", type=Path, default=None, help="default tests/serve/golden/vllm-VERSION.json")
    args = parser.parse_args(argv)
    out = args.out or ROOT / "tests" / "serve" / "golden" / f"vllm-{args.version}.json"
    found = facts(args.version, args.wheels)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(found, indent=1) + "\n")
    print(f"{out}: {len(found['flags'])} flags, {len(found['kv_connectors'])} connectors, offloading keys "
          + "; ".join(f"{s} {len(k)}" for s, k in found["offloading_spec_keys"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
