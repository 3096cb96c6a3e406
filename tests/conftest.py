import os

from pytest_kvoffload.weights import cache_dir

pytest_plugins = ["pytester"]

# pytester points HOME at a temporary folder; without this every pytester run would write the test
# model's random weights (220 MB) anew instead of reusing the cached ones.
os.environ.setdefault("KVOFFLOAD_CACHE", str(cache_dir()))
