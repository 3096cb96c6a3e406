"""The scheduler half's bookkeeping for the queue-aware admission rule, driven with vLLM-shaped stand-ins."""

from types import SimpleNamespace

from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.index import ChunkIndex
from pytest_kvoffload.connector.scheduler import SchedulerSide

BLOCK = 128


class Recorder:
    def __init__(self) -> None:
        self.calls = []

    def __call__(self, load, prompt, local, ahead=(), loading_tokens=0):
        self.calls.append((load, list(ahead), loading_tokens))
        return True


class StoresEverything(ChunkIndex):
    """An index that holds every chunk asked for."""

    def lookup(self, keys):
        return len(keys)

    def locate(self, keys):
        return [(key, 1, [(0, i)]) for i, key in enumerate(keys)]


def side(tmp_path, admit):
    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path), "chunk_tokens": 256}, BLOCK)
    return SchedulerSide(config, BLOCK, b"root", StoresEverything(tmp_path, 1 << 30, 4096), admit=admit)


def request(req_id, n):
    # Prompts of different requests share no prefix (a shared one would wait for the other's load).
    start = sum(map(ord, req_id)) * 100_000
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(start, start + n)))


def step(new=(), cached=(), scheduled=None):
    """A SchedulerOutput with new requests [(id, prompt, computed, block ids)] and cached ones [(id, computed)]."""
    new_reqs = [SimpleNamespace(req_id=i, prompt_token_ids=list(range(n)), num_computed_tokens=c, block_ids=(b,))
                for i, n, c, b in new]
    cached_reqs = SimpleNamespace(req_ids=[i for i, _ in cached], new_block_ids=[None for _ in cached],
                                  resumed_req_ids=set(), num_computed_tokens=[c for _, c in cached])
    return SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                           num_scheduled_tokens=scheduled or {})


def test_lookup_sees_the_running_prefill_ahead_and_the_loads_in_flight(tmp_path):
    admit = Recorder()
    s = side(tmp_path, admit)
    # A 4,032-token prompt gets 2,048 tokens in its first step: 1,984 remain ahead of anything new.
    s.build_connector_meta(step(new=[("bg", 4032, 0, list(range(32)))], scheduled={"bg": 2048}))
    matched, is_async = s.get_num_new_matched_tokens(request("p", 1100), 0)
    assert (matched, is_async) == (1024, True)
    assert admit.calls[-1] == (1024, [(2048, 4032)], 0)
    s.update_state_after_alloc(request("p", 1100), SimpleNamespace(get_block_ids=lambda: (list(range(40, 49)),)), 1024)
    # The next step finishes the background prompt; the first load is still in flight.
    s.build_connector_meta(step(cached=[("bg", 2048)], scheduled={"bg": 1984}))
    s.get_num_new_matched_tokens(request("q", 600), 0)
    assert admit.calls[-1] == (512, [], 1024)
    # Once the worker reports the load done it no longer counts.
    s.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"p"},
                                              kv_connector_worker_meta=None))
    s.get_num_new_matched_tokens(request("r", 600), 0)
    assert admit.calls[-1] == (512, [], 0)


def test_one_admission_decision_per_request(tmp_path):
    admit = Recorder()
    s = side(tmp_path, admit)
    s.get_num_new_matched_tokens(request("p", 1100), 0)
    s.get_num_new_matched_tokens(request("p", 1100), 0)  # not scheduled the first time: asked again
    assert len(admit.calls) == 1
    s.request_finished(request("p", 1100), [])
    s.get_num_new_matched_tokens(request("p", 1100), 0)
    assert len(admit.calls) == 2


def test_a_request_that_opts_out_is_neither_loaded_nor_saved(tmp_path):
    s = side(tmp_path, admit=None)
    s.counters = None
    plain, skip = request("plain", 1024), request("skip", 1024)
    skip.kv_transfer_params = {"kvoffload": "skip"}
    # The plain request is the control: everything is stored, so it loads, and its chunks are saved.
    assert s.get_num_new_matched_tokens(plain, 0)[0] > 0
    assert s.get_num_new_matched_tokens(skip, 0) == (0, False)
    meta = s.build_connector_meta(step(new=[("plain", 1024, 0, list(range(8))), ("skip", 1024, 0, list(range(8, 16)))],
                                       scheduled={"plain": 1024, "skip": 1024}))
    assert {job.req_id for job in meta.saves} == {"plain"}
