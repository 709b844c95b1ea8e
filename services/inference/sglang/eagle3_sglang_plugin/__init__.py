"""EAGLE-3 capture for SGLang 0.5.23: the project's capture protocol (docs/capture-protocol.md) inside a stock server.

Loaded through SGLang's general plugin entry point (`sglang.srt.plugins`, `python/sglang/srt/plugins/__init__.py`
at v0.5.23); `hooks.register` installs everything with `HookRegistry`. No SGLang file is patched or forked.

Modules, pure ones first (they import neither SGLang nor CUDA and are unit tested without SGLang):
- `config`    the plugin's environment, and layer ids in both conventions (ours: layer output; SGLang's
              `layers_to_capture`: the input of layer id + 1).
- `capture`   scheduler side: which request wants a capture, splitting a flattened extend batch back into
              requests, refusing a partial prefill, writing the true-length tensors, the TP-rank-0 rule.
- `protocol`  HTTP side: validating a capture request, translating it to SGLang's `GenerateReqInput`, and
              SGLang's answer back to the protocol's `meta_info`.
- `http`      an ASGI middleware in front of SGLang's FastAPI app that serves capture requests and passes
              every other request to SGLang untouched.
- `launch`    the container's entry point: SGLang's launch arguments, built from the environment.
- `hooks`     the only module that touches SGLang's runtime: the five hooks and the backend for `http`.
"""

__version__ = "0.1.0"

# The SGLang release this plugin was written against; its hook targets are private names of that release.
SGLANG_VERSION = "0.5.23"
