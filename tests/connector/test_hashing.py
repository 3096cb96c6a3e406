import subprocess
import sys

from pytest_kvoffload.connector.hashing import block_keys, key_root

ROOT = key_root("model=a|block=16")


def test_only_full_chunks_get_keys():
    assert len(block_keys(list(range(1000)), 256, ROOT)) == 3


def test_a_key_depends_on_everything_before_it():
    a = block_keys(list(range(768)), 256, ROOT)
    b = block_keys([7] + list(range(1, 768)), 256, ROOT)
    assert all(x != y for x, y in zip(a, b))


def test_shared_leading_chunks_share_keys_whatever_follows():
    a = block_keys(list(range(512)) + [1] * 256, 256, ROOT)
    b = block_keys(list(range(512)) + [2] * 256, 256, ROOT)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_root_separates_models():
    tokens = list(range(512))
    assert block_keys(tokens, 256, key_root("model=a")) != block_keys(tokens, 256, key_root("model=b"))


def test_stable_across_processes():
    code = ("from pytest_kvoffload.connector.hashing import block_keys, key_root;"
            "print(block_keys(list(range(512)), 256, key_root('model=a|block=16'))[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHROOT": "123"}).stdout.strip()
    assert out == block_keys(list(range(512)), 256, ROOT)[1]
