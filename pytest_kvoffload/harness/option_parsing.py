"""Each --kv-* option's value parsed and checked (harness/options.py declares and reads them): a bad value is an
OptionError, one line naming the option and what would be valid, raised before any server starts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from urllib.parse import urlparse

from pytest_kvoffload.core import machine
from pytest_kvoffload.harness.backend_options import split_backends
from pytest_kvoffload.core.calibration import CalibrationError, check_fingerprint, machine_fingerprint, read_calibration
from pytest_kvoffload.connector.config import ADMISSION_MODES, ConnectorConfigError
from pytest_kvoffload.rigged import knobs
from pytest_kvoffload.core.models import DTYPE_BYTES, ModelError, ModelInfo, load_model
from pytest_kvoffload.core.settings import Settings

# What --kv-dtype accepts besides "auto" (the dtype this machine computes natively, machine.native_dtype).
DTYPES = ("bfloat16", "float16", "float32")


class OptionError(ValueError):
    """A bad option value; the message names the option and what would be valid."""


def parse_backends(value: str, known: list[str]) -> tuple[str, ...]:
    names = split_backends(value)
    if not names:
        raise OptionError(f"--kv-backend is empty; use 'all' or a comma list of {', '.join(known)}")
    if "all" in names:
        return tuple(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise OptionError(
            f"--kv-backend: unknown backend {', '.join(map(repr, unknown))}; valid: all, {', '.join(known)}"
        )
    return tuple(dict.fromkeys(names))


def parse_lengths(value: str, block_size: int) -> tuple[int, ...]:
    try:
        lengths = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise OptionError(f"--kv-lengths {value!r}: expected a comma list of whole token counts, e.g. 512,2048") from None
    if not lengths:
        raise OptionError("--kv-lengths is empty; expected a comma list of token counts, e.g. 512,2048")
    short = [n for n in lengths if n <= block_size]
    if short:
        raise OptionError(
            f"--kv-lengths: {', '.join(map(str, short))} not above one KV block ({block_size} tokens); "
            f"a prompt needs more than one block for any of it to be cached"
        )
    return tuple(sorted(set(lengths)))


def parse_fractions(value: str) -> tuple[float, ...]:
    try:
        fractions = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise OptionError(f"--kv-fractions {value!r}: expected a comma list of numbers in (0, 1], e.g. 0.5,1.0") from None
    if not fractions:
        raise OptionError("--kv-fractions is empty; expected a comma list of numbers in (0, 1]")
    bad = [f for f in fractions if not 0.0 < f <= 1.0]
    if bad:
        raise OptionError(f"--kv-fractions: {', '.join(map(str, bad))} outside (0, 1]; the cached prefix is a share of the prompt")
    return tuple(sorted(set(fractions)))


def parse_whole_number(option: str, value, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise OptionError(f"{option} {value!r}: expected a whole number of at least {minimum}") from None
    if number < minimum:
        raise OptionError(f"{option} {value!r}: expected a whole number of at least {minimum}")
    return number


def parse_positive_int(option: str, value) -> int:
    return parse_whole_number(option, value, minimum=1)


def parse_positive_float(option: str, value, upper: float | None = None) -> float:
    limit = f" and at most {upper:g}" if upper is not None else ""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{option} {value!r}: expected a number above 0{limit}") from None
    if not number > 0 or (upper is not None and number > upper):
        raise OptionError(f"{option} {value!r}: expected a number above 0{limit}")
    return number


def parse_admission(value: str) -> str:
    try:
        knobs.planted_mode(value)
    except ValueError:
        raise OptionError(f"--kv-admission {value!r}: expected one of {', '.join(ADMISSION_MODES + knobs.PLANTED_MODES)} "
                          "(F a number above 0, e.g. static:scale=1.5)") from None
    return value


ENGINES = ("vllm", "one-process")


def parse_page_cache(value: str) -> str:
    if value not in ("cold", "warm"):
        raise OptionError(f"--kv-page-cache {value!r}: expected cold (the default: hits read the disk) or warm")
    return value


def parse_engine(value: str) -> str:
    if value not in ENGINES:
        raise OptionError(f"--kv-engine {value!r}: expected vllm (the default: vLLM's own executor) or one-process")
    return value


def parse_max_prefill(value) -> float | None:
    """--kv-max-prefill: seconds, or 'off'."""
    if value is None or str(value).lower() == "off":
        return None
    return parse_positive_float("--kv-max-prefill", value)


def parse_server_url(value: str | None) -> str | None:
    if not value:
        return None
    url = urlparse(value)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise OptionError(f"--kv-server-url {value!r}: expected an http(s) URL such as http://127.0.0.1:8000")
    return value.rstrip("/")


def parse_server_args(values: list[str]) -> tuple[str, ...]:
    args: list[str] = []
    for value in values:
        try:
            args.extend(shlex.split(value))
        except ValueError as exc:
            raise OptionError(f"--kv-server-arg {value!r}: cannot split it like a shell would ({exc})") from None
    return tuple(args)


def parse_dtype(value: str, native: tuple[str, str]) -> tuple[str, str]:
    """--kv-dtype: 'auto' takes `native` (dtype, reason); otherwise one of DTYPES, chosen by the user."""
    if value == "auto":
        return native
    if value not in DTYPES:
        raise OptionError(f"--kv-dtype {value!r}: expected auto or one of {', '.join(DTYPES)}")
    return value, "chosen with --kv-dtype"


# --kv-weights auto writes random weights only for models this small. On a CPU: tiny-llama (55M parameters,
# 220 MB in float32); a 3B model would be 12 GB of cache for a CPU run nobody should make with it. On a GPU
# they are drawn on the GPU and kept in bf16: Llama 3.2 3B is 6.4 GB, 3.1 8B 16 GB, written once; a 70B
# checkpoint (about 140 GB) is not, and is served with dummy weights, its output checks blind.
AUTO_RANDOM_MAX_PARAMS = 200_000_000
AUTO_RANDOM_MAX_PARAMS_GPU = 10_000_000_000


def output_checks(model: ModelInfo) -> str:
    """What the output checks can see with the model as served: one line for the header and run.json."""
    if model.has_weights:
        return "the model's own or seeded random weights: wrong KV changes the output"
    return ("blind: vLLM's dummy weights (+-1e-3), which wrong KV does not change; --kv-weights random writes "
            "seeded weights (Llama configs)")


def parse_weights(value: str, model: ModelInfo, on_gpu: bool) -> ModelInfo:
    """--kv-weights: the model as served, random weights planned, not written (the plugin writes them before
    any server: plugin.write_weights). A model with weights of its own is served with them whatever this says."""
    if value not in ("auto", "random", "dummy"):
        raise OptionError(f"--kv-weights {value!r}: expected auto, random or dummy")
    if value == "dummy" or model.has_weights:
        return model
    limit = AUTO_RANDOM_MAX_PARAMS_GPU if on_gpu else AUTO_RANDOM_MAX_PARAMS
    if value == "auto" and (model.config.get("model_type") != "llama" or model.parameter_count() > limit):
        return model
    from pytest_kvoffload.serve.weights import random_weights_plan

    try:
        return random_weights_plan(model, on_gpu=on_gpu)
    except ModelError as exc:
        raise OptionError(str(exc)) from None


def write_weights(model: ModelInfo, on_gpu: bool) -> ModelInfo:
    """The planned random weights written (once; later runs find them), or one line saying why they cannot be."""
    from pytest_kvoffload.serve.weights import write_planned

    try:
        return write_planned(model, on_gpu)
    except OSError as exc:
        raise OptionError(f"--kv-weights random: cannot write the weights ({exc}); set KVOFFLOAD_CACHE to a "
                          "writable folder or use --kv-weights dummy") from None


def parse_model(value: str) -> ModelInfo:
    try:
        return load_model(value)
    except ModelError as exc:
        raise OptionError(str(exc)) from None


def check_fits_model(lengths: tuple[int, ...], model: ModelInfo) -> None:
    too_long = [n for n in lengths if n >= model.max_model_len]
    if too_long:
        raise OptionError(
            f"--kv-lengths: {', '.join(map(str, too_long))} not below the model's context of "
            f"{model.max_model_len} tokens ({model.name})"
        )


def check_engine_tokens(settings: Settings) -> None:
    """vLLM refuses to start an engine whose KV cache cannot hold one prompt of --max-model-len."""
    tokens = settings.engine_tokens
    if tokens is not None and tokens < settings.max_model_len:
        raise OptionError(f"--kv-engine-tokens {tokens}: expected at least {settings.max_model_len} (the servers' "
                          "--max-model-len: the longest --kv-lengths plus room, at least 8,192 tokens)")


def parse_disk_opts(values: list[str], block_size: int) -> dict:
    """KEY=VALUE pairs for the kvoffload-disk connector, checked as the connector will check them; a
    calibration file named here is read now, so a bad one stops the run before its server starts."""
    options: dict = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise OptionError(f"--kv-disk-opt {item!r}: expected KEY=VALUE, e.g. store_dir=/nvme/kv or read_gbps=6")
        try:
            options[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            options[key.strip()] = raw
    try:
        knobs.check({"store_dir": "/check", **options}, block_size)  # test knobs too: rigged/knobs.py
        if options.get("calibration"):
            read_calibration(options["calibration"])
    except (ConnectorConfigError, CalibrationError) as exc:
        raise OptionError(f"--kv-disk-opt: {str(exc).removeprefix('kvoffload connector: ')}") from None
    return options


def check_calibration_here(disk_opts: dict, model, dtype: str, block_size: int, tensor_parallel: int,
                           results: Path) -> None:
    """A --kv-disk-opt calibration measured for another model or machine stops the run here, with the field
    and both values, rather than its server's start-up (the connector checks the same fields)."""
    if not disk_opts.get("calibration"):
        return
    here = {"model": model.name, "dtype": dtype, "kv_bytes_per_token": model.kv_bytes_per_token(DTYPE_BYTES[dtype]),
            "block_size": block_size, "device": machine.device_kind(),
            **machine_fingerprint(disk_opts.get("store_dir") or results, tensor_parallel)}
    try:
        check_fingerprint(read_calibration(disk_opts["calibration"]), here, disk_opts["calibration"],
                          str(disk_opts.get("calibration_mismatch", "refuse")))
    except CalibrationError as exc:
        raise OptionError(f"--kv-disk-opt: {exc}") from None


def parse_results_dir(value, root: Path) -> Path:
    results = Path(str(value)).expanduser()
    if not results.is_absolute():
        results = root / results
    if results.exists() and not results.is_dir():
        raise OptionError(f"--kv-results-dir {str(value)!r}: a file; expected a folder (created when missing)")
    return results


def parse_window(value) -> tuple[float, float] | None:
    """--kv-trace-window START:END in seconds."""
    if not value:
        return None
    try:
        start, end = (float(x) for x in str(value).split(":"))
    except ValueError:
        raise OptionError(f"--kv-trace-window {value!r}: expected START:END in seconds, e.g. 0:60") from None
    if end <= start:
        raise OptionError(f"--kv-trace-window {value!r}: END must be after START")
    return start, end
