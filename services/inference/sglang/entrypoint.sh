#!/bin/sh
# The container's one entry point: SGLang with the EAGLE-3 capture plugin. Extra arguments go to
# sglang.launch_server unchanged (e.g. --log-level debug). Settings: see eagle3_sglang_plugin/launch.py.
set -eu
exec python3 -m eagle3_sglang_plugin.launch "$@"
