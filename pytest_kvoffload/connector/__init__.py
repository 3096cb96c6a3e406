"""pytest-kvoffload's disk KV connector for vLLM.

Load it with --kv-transfer-config '{"kv_connector": "KVOffloadDiskConnector",
"kv_connector_module_path": "pytest_kvoffload.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {"store_dir": "/path"}}'.
"""


def __getattr__(name):
    # Import vLLM only when vLLM asks for the class, so the plugin imports without vLLM.
    if name == "KVOffloadDiskConnector":
        from pytest_kvoffload.connector.connector import KVOffloadDiskConnector

        return KVOffloadDiskConnector
    raise AttributeError(name)
