from pytest_kvoffload.measure.cells import Cell, Expectation, expectation, grid
from pytest_kvoffload.core.cell_state import State


def test_grid_has_cold_once_per_length():
    cells = grid((256, 1024), (0.5, 1.0))
    assert [c.id for c in cells if c.state is State.COLD] == ["256-cold", "1024-cold"]
    assert len(cells) == 2 * (1 + 2 * 2)


def test_cold_must_have_nothing_cached():
    assert Expectation(None, 0).check({}) is None
    assert "17 tokens came from cache" in Expectation(None, 0).check({"device": 17})


def test_tier_hit_from_the_engine_cache_fails_with_numbers():
    message = Expectation("disk", 896).check({"device": 896})
    assert message == "expected 896 cached tokens from 'disk', got 0 and {'device': 896} from elsewhere"


def test_expectation_per_state():
    cell = Cell(1024, 1.0, State.TIER_HIT)
    assert expectation(cell, 1024, 128, "disk", 256) == Expectation("disk", 896)
    assert expectation(Cell(1024, 0.5, State.ENGINE_HIT), 512, 128, "disk", 256) == Expectation("device", 512)


def test_a_tier_that_serves_the_last_block_joins_engine_hits_and_covers_the_whole_prompt():
    # Seen with vLLM's OffloadingConnector (native-cpu, 384 tokens, block 128): engine 256 + host 128; tier 384.
    engine = expectation(Cell(384, 1.0, State.ENGINE_HIT), 384, 128, "host", 128, last_block_source="host")
    assert engine == Expectation("device", 256, "host", 128)
    assert engine.check({"device": 256, "host": 128}) is None
    assert engine.check({"device": 256}) == "expected 256 cached tokens from 'device' and 128 from 'host', got 256"
    assert engine.check({"device": 256, "disk": 128}).endswith("got 256 and {'disk': 128} from elsewhere")
    tier = expectation(Cell(384, 1.0, State.TIER_HIT), 384, 128, "disk", 128, last_block_source="host")
    assert tier == Expectation("disk", 384)
    # A prefix that stops short of the prompt's last block adds nothing.
    half = expectation(Cell(1024, 0.5, State.ENGINE_HIT), 512, 128, "host", 128, last_block_source="host")
    assert half == Expectation("device", 512) and half.check({"device": 512}) is None


def test_lmcache_counts_a_prompt_it_holds_whole_as_all_tokens_but_the_last():
    # Seen with LMCacheMPConnector (lmcache-disk, block 128, chunk 256): 1,280 tokens, engine 1,152 +
    # external 127, tier 1,279; 384 tokens (its last chunk partial, never stored): engine 256, tier 256.
    kw = dict(last_block_source="external_unspecified", all_but_last_token=True)
    lm = "external_unspecified"
    assert expectation(Cell(1280, 1.0, State.ENGINE_HIT), 1280, 128, lm, 256, **kw) == \
        Expectation("device", 1152, lm, 127)
    assert expectation(Cell(1280, 1.0, State.TIER_HIT), 1280, 128, lm, 256, **kw) == Expectation(lm, 1279)
    assert expectation(Cell(384, 1.0, State.ENGINE_HIT), 384, 128, lm, 256, **kw) == Expectation("device", 256)
    assert expectation(Cell(384, 1.0, State.TIER_HIT), 384, 128, lm, 256, **kw) == Expectation(lm, 256)
    assert expectation(Cell(1280, 0.5, State.TIER_HIT), 640, 128, lm, 256, **kw) == Expectation(lm, 512)
    # Near misses: vLLM's whole-block count (1,280) and one token fewer (1,278) both fail.
    tier = expectation(Cell(1280, 1.0, State.TIER_HIT), 1280, 128, lm, 256, **kw)
    assert tier.check({lm: 1279}) is None and tier.check({lm: 1280}) and tier.check({lm: 1278})


def test_a_tier_hit_counts_only_if_the_connector_loaded_it():
    # Seen on a real server: every chunk corrupt, the connector recomputed them all, and vLLM's
    # per-source counter still said 2,816 tokens came from disk.
    from pytest_kvoffload.serve.builtin.kvoffload_disk import load_proof as kvoffload_load_proof
    corrupt = {"kvoffload:chunks_corrupt_total": 11, "kvoffload:blocks_load_failed_total": 22}
    assert "recomputed, not loaded" in kvoffload_load_proof(corrupt, 2816, 4096)
    assert "less than the 11,534,336" in kvoffload_load_proof({"kvoffload:useful_bytes_read_total": 4096}, 2816, 4096)
    assert kvoffload_load_proof({"kvoffload:useful_bytes_read_total": 11 * 256 * 4096}, 2816, 4096) is None
