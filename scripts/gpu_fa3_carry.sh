#!/bin/bash
# FA3 for the staged SGLang on the lent GPU machine, in carries of at most 56 MiB (a command sends 64 MiB with the
# checkout). The staged sglang-kernel 0.4.5 comes without FA3's 1.1 GB library (sgl_kernel/flash_ops.abi3.so), so its
# SGLang serves with Triton attention; stock SGLang on Hopper serves plain decoding and chains of drafts (topk 1) with
# FA3. This takes the library from the same wheel, xz-compresses it and splits it over .gpu_fa3_1, .gpu_fa3_2, ...
# (git-excluded), one carry each:
#   bash scripts/gpu_fa3_carry.sh                      here, from the repository root (a few minutes: xz -9 on 1.1 GB)
#   carry .gpu_fa3_K                                   bash scripts/gpu_product.sh keep     (K = 1, 2, ...: one call each)
#   after the SGLang install (call 4 of gpu_product.sh's header)   bash scripts/gpu_product.sh fa3
# The `fa3` step joins the parts, checks the library's SHA-256 and puts it into the installed sgl_kernel; from then
# on gpu_product.sh's servers use SGLang's own choice of attention backend instead of Triton.
set -euo pipefail
PY=${PY:-python3}
PART_BYTES=$((56 * 1024 * 1024))
LIBRARY=sgl_kernel/flash_ops.abi3.so
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$tmp" sglang-kernel==0.4.5
unzip -q "$tmp"/sglang_kernel-0.4.5-*.whl "$LIBRARY" -d "$tmp"
sha256=$(sha256sum "$tmp/$LIBRARY" | cut -d' ' -f1)
xz -9 -T0 -c "$tmp/$LIBRARY" > "$tmp/flash_ops.abi3.so.xz"
split -b "$PART_BYTES" -d -a 2 "$tmp/flash_ops.abi3.so.xz" "$tmp/flash_ops.abi3.so.xz.part"

rm -rf .gpu_fa3_*
k=0
for part in "$tmp"/flash_ops.abi3.so.xz.part*; do
  k=$((k + 1))
  mkdir -p ".gpu_fa3_$k"
  mv "$part" ".gpu_fa3_$k/"
  grep -qxF "/.gpu_fa3_$k/" .git/info/exclude 2>/dev/null || echo "/.gpu_fa3_$k/" >> .git/info/exclude
done
echo "$sha256  flash_ops.abi3.so" > .gpu_fa3_1/flash_ops.abi3.so.sha256
du -sh .gpu_fa3_*
