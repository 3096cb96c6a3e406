"""Servers of a run share one compiled graph on the CPU build; a user's own settings win; CUDA is left alone."""

from pathlib import Path

from pytest_kvoffload.serve import compile_cache


def test_cpu_servers_turn_the_aot_path_off_and_keep_inductor_under_vllms_cache():
    env = compile_cache.server_env(cuda=False, environ={"VLLM_CACHE_ROOT": "/c/vllm"})
    assert env == {"VLLM_USE_AOT_COMPILE": "0", "TORCHINDUCTOR_CACHE_DIR": "/c/vllm/torch_compile_cache/inductor"}


def test_the_cache_root_follows_vllms_own_rule():
    assert compile_cache.vllm_cache_root({"XDG_CACHE_HOME": "/x"}) == Path("/x/vllm")
    assert compile_cache.vllm_cache_root({"VLLM_CACHE_ROOT": "/r", "XDG_CACHE_HOME": "/x"}) == Path("/r")


def test_a_users_own_settings_win_and_the_header_says_so():
    user = {"VLLM_USE_AOT_COMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": "/mine"}
    assert compile_cache.server_env(cuda=False, environ=user) == {}
    assert "every server compiles again" in compile_cache.describe(False, user)
    assert "/mine" in compile_cache.describe(False, user)


def test_cuda_servers_get_vllms_defaults():
    assert compile_cache.server_env(cuda=True, environ={}) == {}
    assert "vLLM's defaults" in compile_cache.describe(True, {})

