#!/bin/bash
# run34: issue 28's per-kernel-class profile of the slice's batch-1 decode step with the experts as lowered
# (fp8_block, h200's default, then mxfp4_w4a16); then MTP with natural acceptance on the slice (random
# weights: drafts are rarely accepted), default mode, MXFP4 experts: auto against every fixed k
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
rm -rf /tmp/pc /tmp/fs /tmp/fb
T0=$(date +%s)
timeout 80 python examples/profile_step.py --batch 1 --out $OUT/profile_b1_fp8.json > $OUT/profile_fp8_log.txt 2>&1
echo "profile fp8 rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/profile_fp8_log.txt
T1=$(date +%s)
timeout 80 python examples/profile_step.py --batch 1 --expert-format mxfp4_w4a16 --out $OUT/profile_b1_mxfp4.json \
    > $OUT/profile_mxfp4_log.txt 2>&1
echo "profile mxfp4 rc=$? $(( $(date +%s) - T1 )) s" >> $OUT/profile_mxfp4_log.txt
T2=$(date +%s)
timeout 170 python examples/bench_mtp_forced.py --slice /tmp/fs --expert-format mxfp4_w4a16 --compile-only \
    --compile-batches 1,8 --batches 1,8 > $OUT/compile_log.txt 2>&1
echo "compile rc=$? $(( $(date +%s) - T2 )) s" >> $OUT/compile_log.txt
T3=$(date +%s)
timeout $(( 590 - (T3 - T0) )) python examples/bench_mtp.py --art /tmp/fs/art_mxfp4_w4a16 --batches 1,8 \
    --temperatures 0 --new-tokens 48 --repeats 3 --out $OUT/mtp_slice_auto.json > $OUT/mtp_slice_log.txt 2>&1
echo "bench_mtp rc=$? $(( $(date +%s) - T3 )) s" >> $OUT/mtp_slice_log.txt
cat $OUT/gpu.txt
for f in fp8 mxfp4; do grep -A6 "^| class" $OUT/profile_${f}_log.txt; grep "^== " $OUT/profile_${f}_log.txt; tail -1 $OUT/profile_${f}_log.txt; done
tail -2 $OUT/compile_log.txt
grep "^|" $OUT/mtp_slice_log.txt | tail -12; tail -3 $OUT/mtp_slice_log.txt
