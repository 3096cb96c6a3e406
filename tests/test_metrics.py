from pytest_kvoffload.metrics import parse, snapshot

TEXT = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 2000.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tiny",source="device"} 896.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tiny",source="disk"} 0.0
vllm:prompt_tokens_cached_by_source_created{engine="0",model_name="tiny",source="disk"} 1.79e+09
kvoffload:bytes_read_total{engine="0",model_name="tiny"} 1048576.0
kvoffload:bytes_read_created{engine="0",model_name="tiny"} 1.79e+09
garbage line
"""


def test_parse_labels_and_values():
    samples = parse(TEXT)
    device = [s for s in samples if s.label("source") == "device"][0]
    assert device.value == 896.0 and device.label("engine") == "0"


def test_snapshot_and_delta():
    before = snapshot(TEXT)
    after = snapshot(TEXT.replace('source="disk"} 0.0', 'source="disk"} 512.0').replace("2000.0", "3024.0"))
    delta = after.delta(before)
    assert delta.prompt_tokens == 1024
    assert delta.cached_by_source == {"device": 0.0, "disk": 512.0}
    assert before.extra == {"kvoffload:bytes_read_total": 1048576.0}


def test_label_values_with_escapes():
    samples = parse('m{a="x\\"y",b="z"} 1')
    assert samples[0].label("b") == "z"


def test_vllm_offload_counters_are_kept_per_direction():
    text = (TEXT + 'vllm:kv_offload_total_bytes_total{engine="0",model_name="tiny",transfer_type="CPU_to_GPU"} 4096.0\n'
            'vllm:kv_offload_total_bytes_total{engine="0",model_name="tiny",transfer_type="GPU_to_CPU"} 8192.0\n'
            'vllm:kv_offload_size_bucket{engine="0",le="1e+06",model_name="tiny",transfer_type="CPU_to_GPU"} 6.0\n'
            'vllm:kv_offload_load_bytes_total{engine="0",model_name="tiny"} 4096.0\n')
    extra = snapshot(text).extra
    assert extra['vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}'] == 4096.0
    assert extra['vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}'] == 8192.0
    assert extra["vllm:kv_offload_load_bytes_total"] == 4096.0
    assert not any("bucket" in key for key in extra)
