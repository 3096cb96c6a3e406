"""Repository-level pytest configuration.

The plugin itself loads through its `pytest11` entry point (pip install -e . is enough); this file
only keeps pytest out of the generated results.
"""

collect_ignore = ["results", ".venv"]
