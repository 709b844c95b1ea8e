"""Unit tests of the SGLang plugin's pure parts; SGLang itself is not installed here.

The plugin is its own small distribution (services/inference/sglang/pyproject.toml), installed into the SGLang
image; here its folder goes on sys.path so that `eagle3_sglang_plugin` imports as it does there. Only the folder
itself: its parent would make `sglang` resolve to services/inference/sglang.
"""

import sys
from pathlib import Path

PLUGIN_ROOT = Path(__file__).resolve().parents[2] / "services" / "inference" / "sglang"
if str(PLUGIN_ROOT) not in sys.path:
    sys.path.insert(0, str(PLUGIN_ROOT))
