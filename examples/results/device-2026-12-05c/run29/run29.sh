#!/bin/bash
# run29: MTP with natural acceptance on the bundled model, the cells' calls interleaved (auto against the
# best fixed k); then the deterministic mode's decode cost on a 2-layer slice, bf16 and MXFP4 experts
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
rm -rf /tmp/pc /tmp/fs /tmp/fb
T0=$(date +%s)
timeout 110 python examples/bench_mtp_forced.py --bundled --work /tmp/fb --compile-only --compile-batches 1,8 \
    --batches 1,8 --new-tokens 96 > $OUT/compile_log.txt 2>&1
echo "compile rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/compile_log.txt
timeout 170 python examples/bench_mtp.py --art /tmp/fb/art --batches 1,8 --temperatures 0,0.7 --new-tokens 96 \
    --repeats 3 --out $OUT/mtp_auto.json > $OUT/mtp_auto_log.txt 2>&1
echo "bench_mtp rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/mtp_auto_log.txt
LEFT=$(( ${LIMIT:-330} - ($(date +%s) - T0) - 10 ))
timeout $LEFT python examples/bench_deterministic.py --layers 2 --prompt 1024 --steps 12 \
    --modes default deterministic default-mxfp4 deterministic-mxfp4 --out $OUT/det_cost.json > $OUT/det_log.txt 2>&1
echo "bench_deterministic rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/det_log.txt
cat $OUT/gpu.txt
tail -2 $OUT/compile_log.txt
grep "^|" $OUT/mtp_auto_log.txt | tail -12; tail -1 $OUT/mtp_auto_log.txt
grep -v USDT $OUT/det_log.txt | tail -8
