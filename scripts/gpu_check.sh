#!/usr/bin/env bash
# The prepared check for a lent GPU machine: one command, at most 6 minutes (a rerun fits in a lease), never CI.
#
#   here, once:   make gpu-wheels   (what the GPU image lacks, into .whl/: datasets, math-verify, trl 1.16, and the
#                                    transformers that constraints.txt pins, with the huggingface-hub it needs)
#   on the GPU:   bash scripts/gpu_check.sh            (device run: carry [".whl"], timeout_s 420)
#   here:         bash scripts/gpu_check.sh --dry-run  (the same phases on this CPU at tiny sizes, two at a time)
#
# Results go to $OUT (the folder a device run hands back; /tmp/gpu-check otherwise): results.jsonl, summary.md,
# logs.txt, equivalence.log and trees.log (the tests' whole output). bench/gpu_check.py runs the phases, most
# valuable first, each in its own process under a time limit, so one failure or hang does not stop the next. The
# wheels install into /tmp/site, first on PYTHONPATH: the carried transformers replaces the image's. Only src/ and the wheels go on PYTHONPATH, never tests/ (a folder there named like a
# package would shadow it). The image has no vLLM, which cannot be carried there (far over 64 MiB), so nothing here
# needs it.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
if [ "${1:-}" = "--dry-run" ]; then
  py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
  exec timeout 540 "$py" bench/gpu_check.py --out "$out" --dry-run --deadline 520 --jobs 2
fi
py=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "gpu_check: the wheels in .whl/ did not install; phases that need them will say so"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check: no wheels in .whl/ (make gpu-wheels here, then carry .whl): datasets, math-verify, trl and the pinned transformers missing"
fi
pinned="$(sed -n 's/^transformers==//p' constraints.txt)"
found="$("$py" -c 'import importlib.metadata as m; print(m.version("transformers"))' 2>&1 | tail -1)"
[ "$found" = "$pinned" ] || echo "gpu_check: transformers $found here, not the pinned $pinned (results may differ from CPU runs)"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 345 "$py" bench/gpu_check.py --out "$out" --deadline 335
