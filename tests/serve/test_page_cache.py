"""Disk tiers that read the disk: I/O mode, page-cache residency and the drop (serve/page_cache.py), no server."""

import json
import os

from pathlib import Path

from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.serve import page_cache
from pytest_kvoffload.serve.backend import LaunchContext, with_connector_options
from pytest_kvoffload.serve.builtin import default_registry
from pytest_kvoffload.record.report import tier_io_lines


def written(path, size=4 << 20):
    with open(path, "wb") as fh:
        fh.write(os.urandom(size))
    return path


def test_a_buffered_file_is_resident_after_writing_and_not_after_the_drop(tmp_path):
    (tmp_path / "tier" / "a").mkdir(parents=True)
    written(tmp_path / "tier" / "a" / "one.bin")
    written(tmp_path / "tier" / "two.bin", 1 << 20)
    with open(tmp_path / "tier" / "two.bin", "rb") as fh:
        fh.read()  # read through the page cache
    before = page_cache.residency([tmp_path / "tier"])
    assert before["files"] == 2 and before["bytes"] == 5 << 20
    assert before["resident_bytes"] > 0  # the control: a buffered read leaves pages behind
    dropped = page_cache.drop([tmp_path / "tier"])
    assert dropped["before"]["resident_bytes"] > 0
    assert dropped["after"]["resident_bytes"] <= 64 << 10, dropped  # what the kernel keeps is a page or two


def settings():
    return Settings(backends=("gpu-only",), model=load_model("tiny-llama"), lengths=(512,), fractions=(1.0,),
                    rounds=1, results_dir=Path("/tmp/r"), block_size=128)


def extra_of(args):
    return json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def test_each_disk_backend_declares_the_folders_its_command_line_configures(tmp_path):
    registry = default_registry()
    ctx = LaunchContext(settings(), tmp_path)
    ours = registry.get("kvoffload-disk").configure(ctx)
    assert ours.tier_folders == (Path(extra_of(ours.args)["store_dir"]),) and ours.direct_io
    off = with_connector_options(registry.get("kvoffload-disk"), "off", direct_io=False).configure(ctx)
    assert not off.direct_io and off.tier_folders == (Path(extra_of(off.args)["store_dir"]),)
    native = registry.get("native-disk").configure(ctx)
    assert native.tier_folders == (Path(extra_of(native.args)["secondary_tiers"][0]["root_dir"]),)
    assert registry.get("native-cpu").configure(ctx).tier_folders == ()
    assert registry.get("gpu-only").configure(ctx).tier_folders == ()


def test_an_lmcache_servers_fs_tier_and_its_o_direct_are_what_its_command_line_says(tmp_path):
    registry = default_registry()
    spec = registry.get("lmcache-disk").configure(LaunchContext(settings(), tmp_path))
    argv = spec.companion.argv
    adapter = json.loads(argv[argv.index("--l2-adapter") + 1])
    assert spec.tier_folders == (Path(adapter["base_path"]),)
    # LMCache's fs adapter is buffered unless told otherwise: the page-cache drop then applies.
    assert spec.direct_io == adapter["use_odirect"]


def test_the_io_mode_follows_the_filesystem_and_the_configuration(tmp_path):
    mode = page_cache.io_mode(tmp_path / "not-yet")
    assert mode in ("O_DIRECT", "buffered")
    assert page_cache.io_mode(tmp_path, configured_direct=False) == "buffered"


def test_the_report_says_how_each_disk_tier_read():
    backends = {"native-disk": {"tier_io": {"folders": ["/s/fs"], "mode": "O_DIRECT", "page_cache": "not used"}},
                "lmcache-disk": {"tier_io": {"folders": ["/s/l2"], "mode": "buffered", "page_cache": "cold"}},
                "x-warm": {"tier_io": {"folders": ["/w"], "mode": "buffered", "page_cache": "warm"}}}
    measurements = [{"backend": "lmcache-disk", "tier_page_cache": {"after": {"resident_bytes": 0}}},
                    {"backend": "x-warm", "tier_page_cache": {"after": {"resident_bytes": 5e6}}}]
    text = "\n".join(tier_io_lines(backends, measurements))
    assert "native-disk: disk tier reads with O_DIRECT (/s/fs)" in text
    assert "lmcache-disk: buffered disk tier: its files dropped from the page cache before every tier-only round; " \
           "0.0 MB resident (median of 1 rounds)" in text
    assert "x-warm: FLAG: buffered disk tier with --kv-page-cache=warm: tier hits served from memory" in text
