"""The CPU-platform copy worker moves exactly the bytes vLLM's CUDA worker would, and refuses a GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,  # noqa: E402
                                     CanonicalKVCacheTensor, GPULoadStoreSpec)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from pytest_kvoffload import cpu_copy_worker  # noqa: E402
from pytest_kvoffload.cpu_copy_worker import CopyWorker, engine_tensors, plan_copy  # noqa: E402

BLOCKS, PAGE, PER_CHUNK, CHUNKS = 16, 64, 4, 8


def kv_caches(num_tensors=2, unpadded=PAGE, groups=1):
    generator = torch.Generator().manual_seed(0)
    tensors = [CanonicalKVCacheTensor(torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8,
                                                    generator=generator).view(torch.float32), PAGE)
               for _ in range(num_tensors)]
    if groups == 1:
        refs = [[CanonicalKVCacheRef(i, unpadded) for i in range(num_tensors)]]
    else:
        refs = [[CanonicalKVCacheRef(i, unpadded)] for i in range(num_tensors)]
    return CanonicalKVCaches(tensors, refs)


def worker(caches, offload=None):
    engine = engine_tensors(caches)
    if offload is None:
        offload = [torch.zeros((CHUNKS, PAGE * PER_CHUNK), dtype=torch.int8) for _ in engine]
    return CopyWorker(engine, offload, caches.group_data_refs, PER_CHUNK), engine, offload


def finish(copy_worker, job_ids):
    copy_worker.wait(set(job_ids))
    results = copy_worker.get_finished()
    assert [r.job_id for r in results] == list(job_ids) and all(r.success for r in results)
    return results


def test_plan_skips_into_the_first_chunk_and_stops_inside_the_last():
    (copy,) = plan_copy(np.array([3, 7, 1, 9, 12, 2]), np.array([5, 0]), [6], [2], PER_CHUNK)
    assert copy.engine_rows.tolist() == [3, 7, 1, 9, 12, 2]
    assert copy.chunk_ids.tolist() == [5, 5, 0, 0, 0, 0] and copy.sub_ids.tolist() == [2, 3, 0, 1, 2, 3]


def test_plan_refuses_a_spec_whose_counts_do_not_add_up():
    with pytest.raises(ValueError, match="need 2 chunks, got 1"):
        plan_copy(np.array([3, 7, 1, 9, 12, 2]), np.array([5]), [6], [2], PER_CHUNK)


@pytest.mark.parametrize("start, count", [(0, 8), (2, 6), (4, 2), (1, 1), (3, 5)],
                         ids=["whole-chunks", "skip-into-first", "aligned-partial", "one-block", "both-partial"])
def test_store_then_load_into_other_blocks_is_byte_exact(start, count):
    caches = kv_caches()
    copy_worker, engine, offload = worker(caches)
    source = list(range(count))
    chunks = list(range(-(-(start % PER_CHUNK + count) // PER_CHUNK)))
    chunks = [CHUNKS - 1 - c for c in chunks]  # chunk ids that are not the block ids
    before = [t.clone() for t in offload]
    copy_worker.submit_store(1, GPULoadStoreSpec(source, [count], [start]), CPULoadStoreSpec(chunks))
    finish(copy_worker, [1])
    # Exactly the stored sub-blocks changed; the skipped head and the unused tail of a chunk did not.
    for e, o, b in zip(engine, offload, before):
        rows = o.view(CHUNKS, PER_CHUNK, PAGE)
        for i, block in enumerate(source):
            position = start % PER_CHUNK + i
            assert torch.equal(rows[chunks[position // PER_CHUNK], position % PER_CHUNK], e[block])
        touched = {(chunks[(start % PER_CHUNK + i) // PER_CHUNK], (start % PER_CHUNK + i) % PER_CHUNK)
                   for i in range(count)}
        untouched = [(c, s) for c in range(CHUNKS) for s in range(PER_CHUNK) if (c, s) not in touched]
        before_rows = b.view(CHUNKS, PER_CHUNK, PAGE)
        assert all(torch.equal(rows[c, s], before_rows[c, s]) for c, s in untouched)
    # Load into other engine blocks: byte for byte what was stored; every other block as it was.
    targets = list(range(BLOCKS - count, BLOCKS))
    originals = [t.clone() for t in engine]
    for t in engine:
        t[targets] = 0
    copy_worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(targets, [count], [start]))
    finish(copy_worker, [2])
    for e, original in zip(engine, originals):
        assert torch.equal(e[targets], original[source])
        others = [b for b in range(BLOCKS) if b not in targets]
        assert torch.equal(e[others], original[others])
    copy_worker.shutdown()


def test_unpadded_refs_copy_only_their_bytes_and_groups_use_their_own_tensors():
    caches = kv_caches(num_tensors=2, unpadded=48, groups=2)
    copy_worker, engine, offload = worker(caches)
    spec = GPULoadStoreSpec([4, 5, 6, 7], [2, 2], [0, 0])
    results = copy_worker.submit_store(3, spec, CPULoadStoreSpec([1, 2])) and finish(copy_worker, [3])
    assert results[0].transfer_size == 4 * 48
    first, second = (o.view(CHUNKS, PER_CHUNK, PAGE) for o in offload)
    assert torch.equal(first[1, :2, :48], engine[0][[4, 5], :48])
    assert torch.equal(second[2, :2, :48], engine[1][[6, 7], :48])
    assert not first[1, :2, 48:].any() and not first[2].any() and not second[1].any()


def test_a_row_strided_offload_region_like_vllms_shared_one():
    # vLLM's shared region interleaves ranks in a chunk row: this rank's view has a row stride of two pages.
    caches = kv_caches(num_tensors=1)
    base = torch.zeros((CHUNKS, 2 * PAGE * PER_CHUNK), dtype=torch.int8)
    view = torch.as_strided(base, (CHUNKS, PAGE * PER_CHUNK), (2 * PAGE * PER_CHUNK, 1), PAGE * PER_CHUNK)
    copy_worker, engine, _ = worker(caches, [view])
    copy_worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3, 4], [5], [0]), CPULoadStoreSpec([6, 7]))
    finish(copy_worker, [1])
    assert not base[:, :PAGE * PER_CHUNK].any()  # the other rank's half of every row is untouched
    assert torch.equal(view[6].view(PER_CHUNK, PAGE), engine[0][:4])
    assert torch.equal(view[7][:PAGE], engine[0][4])


def test_jobs_finish_in_submission_order_and_a_failed_copy_is_reported_not_raised():
    caches = kv_caches()
    copy_worker, _, _ = worker(caches)
    copy_worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
    copy_worker.submit_store(2, GPULoadStoreSpec([BLOCKS + 5], [1], [0]), CPULoadStoreSpec([1]))  # no such block
    copy_worker.submit_store(3, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([2]))
    copy_worker.wait({1, 2, 3})
    results = copy_worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True)]
    assert copy_worker.get_finished() == []


def test_the_cpu_platform_spec_refuses_a_gpu_platform(monkeypatch):
    monkeypatch.setattr(cpu_copy_worker.current_platform, "is_cuda_alike", lambda: True)
    with pytest.raises(cpu_copy_worker.PlatformError, match="CPUPlatformOffloadingSpec is for vLLM's CPU platform"):
        cpu_copy_worker.refuse_gpu_platform("CPUPlatformOffloadingSpec")
