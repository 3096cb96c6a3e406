"""The run's settings: option values parsed and checked before any server starts."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from .models import DTYPE_BYTES, ModelError, ModelInfo, load_model

# What --kv-dtype accepts besides "auto" (the dtype this machine computes natively, machine.native_dtype).
DTYPES = ("bfloat16", "float16", "float32")


class OptionError(ValueError):
    """A bad option value; the message names the option and what would be valid."""


@dataclass(frozen=True)
class Settings:
    backends: tuple[str, ...]
    model: ModelInfo
    lengths: tuple[int, ...]
    fractions: tuple[float, ...]
    rounds: int
    results_dir: Path
    block_size: int
    server_url: str | None = None
    server_args: tuple[str, ...] = ()
    server_timeout: float = 600.0
    seed: int = 0
    extra: dict = field(default_factory=dict)
    # Sizes of the tiers and of the engine: --kv-cpu-gib, --kv-disk-gb, --kv-gpu-memory-utilization.
    cpu_gib: float = 16.0
    disk_gb: float = 64.0
    gpu_memory_utilization: float = 0.9
    tensor_parallel: int = 1
    # The dtype vLLM computes and stores KV in (--kv-dtype), and why it was chosen.
    dtype: str = "bfloat16"
    dtype_reason: str = ""
    # Default lengths whose cold prefill, measured at server start, exceeds this many seconds are left
    # out (speed.py); None keeps every length, as do lengths the user gave (lengths_given).
    max_prefill_s: float | None = None
    lengths_given: bool = False
    # The rule the admission suite's guarded server runs (--kv-admission; connector/admission.py).
    admission: str = "queue"
    # --kv-ab: the two backends an A/B run compares, both up at once (suites/test_ab.py); None: no A/B.
    ab: tuple[str, str] | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(DTYPE_BYTES[self.dtype])

    @property
    def max_model_len(self) -> int:
        # Room for the longest prompt plus output, at least 8k so that tests of multi-step prefills fit,
        # never past what the model supports.
        return min(self.model.max_model_len, max(max(self.lengths), 8192) + self.block_size)


def split_backends(value: str) -> list[str]:
    """A --kv-backend list split on the commas outside brackets: `a,b[x=1,y=2]` is two backends."""
    names, depth, current = [], 0, ""
    for char in value:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(current.strip())
            current = ""
        else:
            current += char
    names.append(current.strip())
    return [n for n in names if n]


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


def parse_positive_int(option: str, value: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise OptionError(f"{option} {value!r}: expected a whole number of at least 1") from None
    if number < 1:
        raise OptionError(f"{option} {value!r}: expected a whole number of at least 1")
    return number


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
    from .connector.config import ADMISSION_MODES

    if value not in ADMISSION_MODES:
        raise OptionError(f"--kv-admission {value!r}: expected one of {', '.join(ADMISSION_MODES)}")
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


# --kv-weights auto writes random weights only for models this small (tiny-llama: 55M parameters, 220 MB in
# float32); a 3B model would be 12 GB of cache for a CPU run nobody should make with it.
AUTO_RANDOM_MAX_PARAMS = 200_000_000


def parse_weights(value: str, model: ModelInfo, on_gpu: bool) -> ModelInfo:
    """--kv-weights: the model as served. A model with weights of its own is served with them whatever this says."""
    if value not in ("auto", "random", "dummy"):
        raise OptionError(f"--kv-weights {value!r}: expected auto, random or dummy")
    if value == "dummy" or model.has_weights:
        return model
    if value == "auto" and (on_gpu or model.config.get("model_type") != "llama"
                            or model.parameter_count() > AUTO_RANDOM_MAX_PARAMS):
        return model
    from .weights import with_random_weights

    try:
        return with_random_weights(model)
    except ModelError as exc:
        raise OptionError(str(exc)) from None
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


def parse_disk_opts(values: list[str], block_size: int) -> dict:
    """KEY=VALUE pairs for the kvoffload-disk connector, checked as the connector will check them."""
    import json

    from .connector.config import ConnectorConfig, ConnectorConfigError

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
        ConnectorConfig.from_extra({"store_dir": "/check", **options}, block_size)
    except ConnectorConfigError as exc:
        raise OptionError(f"--kv-disk-opt: {str(exc).removeprefix('kvoffload connector: ')}") from None
    return options
