"""The drive figure's buffer: how many device requests a request becomes from 4 KiB or huge pages, where fio
can be given huge pages, and the reason printed where it cannot."""

import shutil

import pytest

from pytest_kvoffload.cli import main
from pytest_kvoffload.drive.fio import fio_command
from pytest_kvoffload.drive.page_segments import (HUGE_PAGE, SMALL_PAGE, QueueLimits, hugetlbfs_with_room,
                                                  queue_limits, why_no_huge_fio)

VIRTIO = QueueLimits("vda", max_segments=254, max_request_bytes=4 << 20, max_segment_bytes=1 << 32)


def test_a_4_mib_request_is_5_device_requests_from_small_pages_and_1_from_huge_ones():
    assert VIRTIO.device_requests(4 << 20, SMALL_PAGE) == 5  # 1,024 segments, 254 a request
    assert VIRTIO.device_requests(4 << 20, HUGE_PAGE) == 1
    assert VIRTIO.device_requests(1 << 20, SMALL_PAGE) == 2 and VIRTIO.device_requests(1 << 20, HUGE_PAGE) == 1
    small_segments = QueueLimits("sda", 128, 1 << 20, 64 << 10)  # segments capped at 64 KiB: huge pages help less
    assert small_segments.device_requests(4 << 20, HUGE_PAGE) == 4


def test_hugetlbfs_is_used_only_where_a_mount_has_free_pages_enough(tmp_path):
    mounts, meminfo = tmp_path / "mounts", tmp_path / "meminfo"
    mounts.write_text("proc /proc proc rw 0 0\nnone /mnt/huge hugetlbfs rw 0 0\n")
    meminfo.write_text("MemTotal: 1 kB\nHugePages_Free:        4\nHugepagesize:       2048 kB\n")
    assert hugetlbfs_with_room(8 << 20, str(mounts), str(meminfo)) == "/mnt/huge"
    assert hugetlbfs_with_room(10 << 20, str(mounts), str(meminfo)) is None  # 4 free pages hold 8 MiB
    mounts.write_text("proc /proc proc rw 0 0\n")
    assert hugetlbfs_with_room(1, str(mounts), str(meminfo)) is None
    assert hugetlbfs_with_room(1, str(tmp_path / "missing"), str(meminfo)) is None


def test_fio_is_given_huge_page_buffers_from_the_mount(tmp_path):
    argv = fio_command(tmp_path / "f", 4 << 20, 64 << 20, 2, write=False, huge_dir="/mnt/huge")
    assert "--mem=mmaphuge:/mnt/huge/.kvoffload-fio-buffer" in argv
    assert not any(a.startswith("--mem=") for a in fio_command(tmp_path / "f", 4 << 20, 64 << 20, 2, write=False))


def test_the_reason_names_the_mount_it_lacks_and_the_split_where_the_queue_is_known(tmp_path):
    text = why_no_huge_fio(tmp_path, 4 << 20)
    assert "hugetlbfs" in text and "vm.nr_hugepages" in text
    limits = queue_limits(tmp_path)
    if limits is not None:  # a folder on a block device: the split is stated with its figures
        assert f"at most {limits.max_segments} segments" in text


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_probe_with_fio_prints_each_buffer_kind_against_fio(tmp_path, capsys):
    assert main(["probe", "disk", str(tmp_path), "--request-mib", "4", "--size-mib", "16", "--repeats", "1",
                 "--fio"]) == 0
    out = capsys.readouterr().out
    assert "4 KiB-page buffers (fio's default): fio read" in out and "probe / fio: read" in out
    assert "huge-page buffers (the connector's" in out
    assert not list(tmp_path.iterdir())  # no probe or fio file left
