#!/bin/bash
# run35: run34's profiles again on a 2-layer slice (the 4-layer bf16 build plus its FP8 experts ran out of the
# H100's 80 GB): the batch-1 and batch-8 decode step per kernel class, experts fp8_block and mxfp4_w4a16
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
rm -rf /tmp/pc /tmp/fs /tmp/fb
for f in fp8_block mxfp4_w4a16; do for b in 1 8; do
  T0=$(date +%s)
  timeout 70 python examples/profile_step.py --layers 2 --batch $b --expert-format $f --top 40 \
      --out $OUT/profile_${f}_b$b.json > $OUT/profile_${f}_b$b.txt 2>&1
  echo "rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/profile_${f}_b$b.txt
done; done
cat $OUT/gpu.txt
for f in fp8_block mxfp4_w4a16; do for b in 1 8; do echo "## $f batch $b"; grep -A6 "^| class" $OUT/profile_${f}_b$b.txt; grep "^== " $OUT/profile_${f}_b$b.txt; tail -1 $OUT/profile_${f}_b$b.txt; done; done
