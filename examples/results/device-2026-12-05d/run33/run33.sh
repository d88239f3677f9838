#!/bin/bash
# run33: MTP with natural acceptance on the bundled model, the cells' calls interleaved: auto (now timing
# its own rounds and the plain steps, d4fabcf / b09cb8a / 5773d8c) against the best fixed k; then issue 28's
# per-kernel-class profile of the slice's batch-1 decode step (examples/profile_step.py, never run before)
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
rm -rf /tmp/pc /tmp/fs /tmp/fb
T0=$(date +%s)
timeout 110 python examples/bench_mtp_forced.py --bundled --work /tmp/fb --compile-only --compile-batches 1,8 \
    --batches 1,8 --new-tokens 96 > $OUT/compile_log.txt 2>&1
echo "compile rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/compile_log.txt
timeout 200 python examples/bench_mtp.py --art /tmp/fb/art --batches 1,8 --temperatures 0,0.7 --new-tokens 96 \
    --repeats 3 --out $OUT/mtp_auto.json > $OUT/mtp_auto_log.txt 2>&1
echo "bench_mtp rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/mtp_auto_log.txt
rm -rf /tmp/fb
T1=$(date +%s)
timeout $(( 585 - (T1 - T0) )) python examples/profile_step.py --batch 1 --out $OUT/profile_b1.json > $OUT/profile_log.txt 2>&1
echo "profile rc=$? $(( $(date +%s) - T1 )) s" >> $OUT/profile_log.txt
cat $OUT/gpu.txt
tail -2 $OUT/compile_log.txt
grep "^|" $OUT/mtp_auto_log.txt | tail -14; tail -1 $OUT/mtp_auto_log.txt
grep -v USDT $OUT/profile_log.txt | tail -45
