#!/bin/bash
# run15: MTP grid re-run (c5ac668's warm-up) + batched-prefill GPU test
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
T0=$(date +%s)
python examples/bench_mtp_forced.py --bundled --work /tmp/fb --compile-only --compile-batches 1,8 --batches 1,8 --new-tokens 96 > $OUT/mtp_log.txt 2>&1
echo "compile done $(( $(date +%s) - T0 )) s" >> $OUT/mtp_log.txt
timeout 300 python examples/bench_mtp.py --art /tmp/fb/art --batches 1,8 --temperatures 0,0.7 --new-tokens 96 --repeats 3 --out $OUT/mtp_auto.json >> $OUT/mtp_log.txt 2>&1
echo "mtp rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/mtp_log.txt
timeout 150 python -m pytest -q -m gpu tests/test_batched_prefill.py -p no:logging --tb=short > $OUT/batched_gpu.txt 2>&1
echo "batched rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/batched_gpu.txt
tail -5 $OUT/mtp_log.txt; tail -5 $OUT/batched_gpu.txt
