from pytest_kvoffload.serve.metrics import parse, snapshot

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


HISTOGRAM_TEXT = """# HELP kvoffload:load_duration_seconds wall seconds of one request's load
# TYPE kvoffload:load_duration_seconds histogram
kvoffload:load_duration_seconds_bucket{engine="0",le="0.01",model_name="tiny"} 2.0
kvoffload:load_duration_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 6.0
kvoffload:load_duration_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 8.0
kvoffload:load_duration_seconds_count{engine="0",model_name="tiny"} 8.0
kvoffload:load_duration_seconds_sum{engine="0",model_name="tiny"} 1.2
kvoffload:load_duration_seconds_bucket{engine="1",le="0.01",model_name="tiny"} 2.0
kvoffload:load_duration_seconds_bucket{engine="1",le="0.1",model_name="tiny"} 2.0
kvoffload:load_duration_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 2.0
kvoffload:load_duration_seconds_count{engine="1",model_name="tiny"} 2.0
kvoffload:load_duration_seconds_sum{engine="1",model_name="tiny"} 0.01
# HELP kvoffload:save_size_bytes bytes one step's saves wrote
# TYPE kvoffload:save_size_bytes histogram
kvoffload:save_size_bytes_bucket{engine="0",le="1e+06",model_name="tiny"} 0.0
kvoffload:save_size_bytes_bucket{engine="0",le="+Inf",model_name="tiny"} 0.0
kvoffload:save_size_bytes_count{engine="0",model_name="tiny"} 0.0
kvoffload:save_size_bytes_sum{engine="0",model_name="tiny"} 0.0
"""


def test_histograms_are_summed_over_engines_and_empty_ones_dropped():
    from pytest_kvoffload.serve.metrics import histograms
    found = histograms(HISTOGRAM_TEXT)
    assert list(found) == ["kvoffload:load_duration_seconds"]
    h = found["kvoffload:load_duration_seconds"]
    assert h["buckets"] == [[0.01, 4.0], [0.1, 8.0], [float("inf"), 10.0]]
    assert h["count"] == 10.0 and h["sum"] == 1.21


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    from pytest_kvoffload.analysis.cell_stats import quantile
    h = {"buckets": [[0.01, 4.0], [0.1, 8.0], [float("inf"), 10.0]], "count": 10.0, "sum": 1.21}
    assert quantile(h, 0.2) == 0.005  # rank 2 of 4 in [0, 0.01]
    assert abs(quantile(h, 0.6) - 0.055) < 1e-12  # rank 6: 2 of 4 into (0.01, 0.1]
    assert quantile(h, 0.99) == 0.1  # in +Inf: the largest finite bound
    assert quantile({"buckets": [], "count": 0, "sum": 0}, 0.5) is None


def test_histograms_of_two_servers_add_up():
    from pytest_kvoffload.serve.metrics import merge_histograms
    a = {"x": {"buckets": [[1.0, 1.0], [float("inf"), 2.0]], "count": 2.0, "sum": 3.0}}
    b = {"x": {"buckets": [[1.0, 0.0], [float("inf"), 1.0]], "count": 1.0, "sum": 5.0},
         "y": {"buckets": [[1.0, 1.0]], "count": 1.0, "sum": 0.5}}
    merged = merge_histograms(a, b)
    assert merged["x"] == {"buckets": [[1.0, 1.0], [float("inf"), 3.0]], "count": 3.0, "sum": 8.0}
    assert merged["y"]["count"] == 1.0 and a["x"]["count"] == 2.0  # inputs untouched


def test_report_shows_load_and_save_percentiles():
    from pytest_kvoffload.serve.metrics import histograms
    from pytest_kvoffload.record.report import transfer_lines
    lines = transfer_lines({"kvoffload-disk": {"histograms": histograms(HISTOGRAM_TEXT)}, "gpu-only": {}})
    text = "\n".join(lines)
    assert "kvoffload-disk: loads and saves" in text and "gpu-only" not in text
    assert "load time, ms" in text and "121.00" in text  # mean 1.21 s / 10 loads
