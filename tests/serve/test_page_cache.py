"""Disk tiers that read the disk: I/O mode, page-cache residency and the drop (serve/page_cache.py), no server."""

import json
import os

from pytest_kvoffload.serve import page_cache
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


def test_tier_folders_come_from_the_servers_own_command_line():
    ours = ["--kv-transfer-config", json.dumps({"kv_connector_extra_config": {"store_dir": "/s/kv-store"}})]
    native = ["--kv-transfer-config", json.dumps({"kv_connector_extra_config": {
        "secondary_tiers": [{"type": "fs", "root_dir": "/s/fs"}], "cpu_bytes_to_use": 1}})]
    assert [str(p) for p in page_cache.tier_folders(ours)] == ["/s/kv-store"]
    assert [str(p) for p in page_cache.tier_folders(native)] == ["/s/fs"]
    assert page_cache.tier_folders(["--model", "x"]) == []
    off = ["--kv-transfer-config", json.dumps({"kv_connector_extra_config": {"store_dir": "/s", "direct_io": False}})]
    assert page_cache.configured_direct(ours) and not page_cache.configured_direct(off)


def test_an_lmcache_servers_fs_tier_and_its_o_direct_come_from_its_command_line():
    vllm = ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheMPConnector",
                                                "kv_connector_extra_config": {"lmcache.mp.port": 1}})]
    direct = ["-m", "lmcache.v1.multiprocess.server", "--l2-adapter",
              json.dumps({"type": "fs", "base_path": "/s/l2", "use_odirect": True})]
    buffered = ["--l2-adapter", json.dumps({"type": "fs", "base_path": "/s/l2"}),
                "--l2-adapter", json.dumps({"type": "s3", "base_path": "/not/a/folder"}), "--l2-adapter", "{bad"]
    assert [str(p) for p in page_cache.tier_folders(vllm + direct)] == ["/s/l2"]
    assert page_cache.configured_direct(vllm + direct)
    # LMCache's fs adapter is buffered unless told otherwise: the page-cache drop then applies.
    assert [str(p) for p in page_cache.tier_folders(buffered)] == ["/s/l2"]
    assert not page_cache.configured_direct(vllm + buffered)


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
