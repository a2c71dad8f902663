#!/usr/bin/env bash
# Build, here (PyPI, no GPU), the site tree that real verl needs on the lent H200: the pinned
# packages of wheels.txt (verl 0.9.1, vLLM 0.24.0, Ray 2.60.0, Optuna 5.0 and their small
# dependencies the device image lacks) for CPython 3.12 manylinux, trimmed, xz-compressed and
# split into parts that fit one device call each (the travelling tree is capped at 64 MiB).
# Output (git-ignored build output): .realverl/c0/p00, .realverl/c1/p01, ... and
# .realverl/site.tar.xz.sha256.  usage: bash scripts/real_verl/pack.sh [PART_MIB]
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_MIB=${1:-18}  # + the tracked tree (~44 MiB, 37 of it benchmarks/results), which travels with every call
OUT=$PWD/.realverl; WHL=$OUT/whl; SITE=$OUT/site
mkdir -p "$WHL"
PLAT=""; for n in $(seq 5 39); do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# antlr4-python3-runtime 4.9.3 (hydra's parser) is published as an sdist only: build that wheel here.
grep -v '^antlr4-python3-runtime' scripts/real_verl/wheels.txt > "$OUT/specs_bin.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d "$WHL" -r "$OUT/specs_bin.txt"
ls "$WHL"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps -w "$WHL" antlr4-python3-runtime==4.9.3
rm -rf "$SITE"
python3 -m pip install -q --no-deps --no-compile --no-index --target "$SITE" --python-version 3.12 \
  --implementation cp $PLAT --only-binary=:all: "$WHL"/*.whl
# What a dense bf16 model on an H200 never loads (each import is guarded in vLLM 0.24.0; Ray's
# jars serve Java workers only): ~100 MB of the compressed tree.
rm -f "$SITE"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$SITE"/vllm/_moe_C_stable_libtorch.abi3.so "$SITE"/vllm/vllm-rs
rm -rf "$SITE"/ray/jars "$SITE"/bin
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
du -sm "$SITE"
tar -C "$SITE" --sort=name --mtime=2026-01-01 --owner=0 --group=0 -cf - . | xz -T0 -6 > "$OUT/site.tar.xz"
( cd "$OUT" && sha256sum site.tar.xz > site.tar.xz.sha256 && cat site.tar.xz.sha256 )
rm -rf "$OUT"/c[0-9]* "$OUT/split"; mkdir -p "$OUT/split"
( cd "$OUT/split" && split -b "${PART_MIB}M" -d "$OUT/site.tar.xz" p )
i=0; for p in "$OUT"/split/p*; do mkdir -p "$OUT/c$i"; mv "$p" "$OUT/c$i/"; i=$((i + 1)); done
rmdir "$OUT/split"; ls -la "$OUT"/c*/
cp "$OUT/site.tar.xz.sha256" "$OUT/c$((i - 1))/"   # travels with the last part
