"""The test-only connector: pytest-kvoffload's connector with the knobs its suites need and a deployment must
not have: an emulated drive (read_gbps, read_latency_ms), planted wrong KV (fault) and planted admission rules
(static:scale=F, static:no-fixed, queue:full-credit). The harness loads it for every server started with one
of them (serve/builtin/kvoffload_disk.py); the connector users deploy (pytest_kvoffload.connector) refuses them.

kv_connector_module_path: pytest_kvoffload.rigged, kv_connector: RiggedKVOffloadConnector.
"""


def __getattr__(name):
    # Import vLLM only when vLLM asks for the class, as pytest_kvoffload.connector does.
    if name == "RiggedKVOffloadConnector":
        from pytest_kvoffload.rigged.rigged_connector import RiggedKVOffloadConnector

        return RiggedKVOffloadConnector
    raise AttributeError(name)
