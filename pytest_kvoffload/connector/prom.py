"""The connector's counters as vLLM connector stats (worker to engine) and Prometheus metrics (API process).

Module-level classes: vLLM pickles the stats object between processes.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pytest_kvoffload.connector.counters import COUNTERS, FLAGS, HISTOGRAMS, PREFIX


class KVOffloadStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other):
        for key, value in (other.data or {}).items():
            if key in FLAGS:
                self.data[key] = value
            elif key in HISTOGRAMS:
                self.data[key] = list(self.data.get(key, [])) + list(value)
            else:
                self.data[key] = self.data.get(key, 0.0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {k: v for k, v in self.data.items() if k not in HISTOGRAMS}
        for name in HISTOGRAMS:
            if self.data.get(name):
                out[f"{name}_count"] = len(self.data[name])
        if out.get("load_seconds"):
            out["read_gbps"] = out.get("bytes_read", 0.0) / out["load_seconds"] / 1e9
        if out.get("save_seconds"):
            out["write_gbps"] = out.get("bytes_written", 0.0) / out["save_seconds"] / 1e9
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in FLAGS)


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"{PREFIX}{name}", documentation=text, labelnames=self._labelnames)
            for name, text in COUNTERS.items()
        }
        self._histograms = {
            name: self._histogram_cls(name=f"{PREFIX}{name}", documentation=text, buckets=buckets,
                                      labelnames=self._labelnames)
            for name, (text, buckets) in HISTOGRAMS.items()
        }
        self._gauges = {
            name: self._gauge_cls(name=f"{PREFIX}{name}", documentation=text, labelnames=self._labelnames,
                                  multiprocess_mode="mostrecent")
            for name, text in FLAGS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
            elif name in self._histograms:
                histogram = self._histograms[name].labels(*labels)
                for sample in value:
                    histogram.observe(sample)
            elif name in self._gauges:
                self._gauges[name].labels(*labels).set(value)
