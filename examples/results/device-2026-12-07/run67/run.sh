# run67 (any GPU, about 2 min; planned in the thirty-sixth session, not yet run): overlap.py, the shared expert
# on a second captured stream against one stream (4 layers of Flash-shaped FP8 weights, batch 1), twice
# interleaved; then the same with 8 layers. At most 8 files to $OUT.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
H=examples/results/device-2026-12-07/run67
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/overlap.txt
timeout 150 python $H/overlap.py 4 2>&1 | tail -6 | tee -a $OUT/overlap.txt
timeout 200 python $H/overlap.py 8 2>&1 | tail -6 | tee -a $OUT/overlap.txt
