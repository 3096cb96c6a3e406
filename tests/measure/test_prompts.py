from pytest_kvoffload.measure.prompts import expected_cached, make_prompt


def test_deterministic_from_its_key():
    assert make_prompt(1000, 0.5, seed=1, salt="run") == make_prompt(1000, 0.5, seed=1, salt="run")


def test_prefix_share_and_length():
    p = make_prompt(1000, 0.3, salt="a")
    assert len(p) == 1000 and len(p.prefix) == 300


def test_variants_share_exactly_the_prefix():
    a = make_prompt(1000, 0.5, salt="s", variant="prime")
    b = make_prompt(1000, 0.5, salt="s", variant="measure")
    assert a.prefix == b.prefix
    assert a.suffix[0] != b.suffix[0]
    assert sum(x == y for x, y in zip(a.suffix, b.suffix)) < 5


def test_cells_and_rounds_never_share_a_leading_token():
    keys = [(n, f, salt) for n in (512, 1024) for f in (0.5, 1.0) for salt in ("r1", "r2", "other-run")]
    firsts = {tuple(make_prompt(n, f, salt=s).tokens[:4]) for n, f, s in keys}
    assert len(firsts) == len(keys)


def test_tokens_inside_the_vocabulary():
    tokens = make_prompt(5000, 1.0, vocab_size=100).tokens
    assert min(tokens) >= 4 and max(tokens) < 100


def test_expected_cached_whole_blocks_leaving_one_token():
    assert expected_cached(1000, 1000, 128) == 896
    assert expected_cached(1024, 1024, 128) == 896
    assert expected_cached(512, 1024, 128) == 512
    assert expected_cached(100, 1024, 128) == 0


def test_expected_cached_all_but_the_last_token_only_for_a_prompt_held_whole():
    assert expected_cached(1280, 1280, 128, 256, last_block=True, all_but_last_token=True) == 1279
    assert expected_cached(1280, 1280, 128, 256, last_block=True) == 1280
    # 384 tokens in chunks of 256: the partial last chunk is not held, so 256 (not 383).
    assert expected_cached(384, 384, 128, 256, last_block=True, all_but_last_token=True) == 256
    assert expected_cached(1279, 1280, 128, 256, last_block=True, all_but_last_token=True) == 1024


def test_expected_cached_in_storage_units():
    assert expected_cached(512, 1024, 128, granularity=256) == 512
    assert expected_cached(640, 1024, 128, granularity=256) == 512
    assert expected_cached(1024, 1024, 128, granularity=256) == 896
