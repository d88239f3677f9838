# run47 call B (planned, any GPU, ~4 min): what run46 left unfinished. tests/test_deterministic.py -m gpu
# after `704da21` (the decode tile's token groups; run46 reached 1 of its 3 tests), and the FP8 wo_a kernel
# against bf16 (the 2-layer slice's batch-64 step was 0.98x with it, one run), and its 64-row tile.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 230 python -m pytest -q -m gpu tests/test_deterministic.py > $OUT/gpu_det.txt 2>&1
echo rc=$? >> $OUT/gpu_det.txt; tail -3 $OUT/gpu_det.txt
for s in on off on off; do
  python examples/results/device-2026-12-06/run46/wo_a_switch.py $s examples/bench_deterministic.py --layers 2 \
    --modes default-mxfp4 --batches 1 64 2>&1 | grep "^default" | sed "s/^/wo_a $s: /" | tee -a $OUT/steps.txt
done
# the wo_a kernel's 64-row tile above 16 rows (wo_a_tile.py) against its 16-row tiles, batch 64, interleaved
for t in 16 64 16 64; do
  python examples/results/device-2026-12-06/run47/wo_a_tile.py $t examples/bench_deterministic.py --layers 2 \
    --modes default-mxfp4 --batches 64 2>&1 | grep "^default" | sed "s/^/wo_a tile $t: /" | tee -a $OUT/steps.txt
done
